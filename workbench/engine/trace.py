"""StepRecord: what one engine step did, for plots, metrics and tests.

Figures and metrics read these records; they never reach into the engine's internals.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    step: int
    num_seqs: int              # sequences in this step's batch
    num_prefill_tokens: int    # prompt (or recomputed) tokens processed this step
    num_decode_tokens: int     # generated tokens fed back this step (one per decoding sequence)
    num_waiting: int           # requests queued (new, preempted or swapped) after scheduling
    num_running: int           # requests holding KV blocks after this step
    kv_tokens_used: int        # tokens whose K/V the running sequences hold after this step
    blocks_used: int           # blocks held by at least one sequence
    blocks_cached: int         # unheld blocks kept for prefix reuse (evictable)
    blocks_free: int
    blocks_total: int
    block_size: int
    num_preempted: int         # sequences preempted while scheduling this step
    blocks_swapped_out: int
    blocks_swapped_in: int
    blocks_copied: int         # copy-on-write copies
    prefix_hit_tokens: int     # prompt tokens taken from the prefix cache this step
    schedule_s: float          # time spent choosing what runs
    draft_s: float             # the drafter proposing tokens (speculative decoding; else 0)
    prepare_s: float           # block copies, input tensors and metadata
    forward_s: float           # the model's forward pass and the LM head
    sample_s: float            # sampling
    postprocess_s: float       # detokenization and stop checks
    total_s: float
    scheduled: list[tuple[str, int]] = field(default_factory=list)  # (request id, tokens)
    preempted: list[str] = field(default_factory=list)
    sampled: list[str] = field(default_factory=list)   # requests that received a token
    finished: list[str] = field(default_factory=list)
    # Speculative decoding: (request id, drafted tokens verified, accepted) per verified sequence.
    spec: list[tuple[str, int, int]] = field(default_factory=list)
    # ... and the tokens themselves: (request id, drafted token ids, token ids emitted this step:
    # the accepted drafts, then the target's own token).
    spec_tokens: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Parallel engines: per collective, (calls, payload bytes, seconds) summed over the first rank
    # of every stage; when each stage's first rank started (had its inputs) and ended this batch
    # (time.monotonic, one clock for all processes of a machine); which scheduler (pipeline micro-batch slot) it
    # came from; batches in the pipeline when this one was collected.
    comm: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    # ... bytes that rank put on the wire per collective: (with the algorithm used, with a ring
    # algorithm on the unpadded tensor); per stage, the bytes of the hidden states and residual
    # stream one of its ranks held between layers (1/tp of them with sequence_parallel).
    comm_sent: dict[str, tuple[int, int]] = field(default_factory=dict)
    residual_bytes: list[int] = field(default_factory=list)
    stage_spans: list[tuple[float, float]] = field(default_factory=list)
    micro_batch: int = 0
    num_in_flight: int = 1
    # With record_block_tables=True: request id -> its block ids after this step.
    block_tables: dict[str, list[int]] | None = None
    # Prefill tokens the next step may take (max_num_batched_tokens unless tpot_slo adapts it).
    prefill_budget: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_finished(self) -> int:
        return len(self.finished)

    @property
    def kv_tokens_total(self) -> int:
        """The pool's capacity in tokens."""
        return self.blocks_total * self.block_size

    @property
    def kv_tokens_reserved(self) -> int:
        """Token slots in blocks that sequences hold (used + the unfilled rest of their blocks)."""
        return self.blocks_used * self.block_size

    @property
    def comm_bytes(self) -> int:
        return sum(b for _, b, _ in self.comm.values())

    @property
    def stage_busy_s(self) -> list[float]:
        """Seconds each stage spent on this batch: compute plus its collectives."""
        return [end - start for start, end in self.stage_spans]

    @property
    def comm_s(self) -> float:
        return sum(t for _, _, t in self.comm.values())

    def as_dict(self) -> dict:
        return asdict(self)


def record_step(number: int, batch, ops, schedulers, blocks, sampled, finished, spec, spec_tokens,
                phases: dict[str, float], comm: dict, with_tables: bool,
                prefill_budget: int | None) -> StepRecord:
    """The StepRecord of a completed step. `phases`: seconds per phase (schedule_s, draft_s,
    prepare_s, forward_s, sample_s, postprocess_s, total_s); `comm`: a parallel engine's
    collectives and stage spans."""
    pool = blocks.pool
    return StepRecord(
        step=number, num_seqs=len(batch.seqs), num_prefill_tokens=batch.num_prefill_tokens,
        num_decode_tokens=batch.num_decode_tokens,
        num_waiting=sum(len(s.waiting) for s in schedulers),
        num_running=sum(len(s.running) for s in schedulers),
        kv_tokens_used=sum(q.num_computed_tokens for s in schedulers for q in s.running),
        blocks_used=pool.num_used, blocks_cached=pool.num_cached, blocks_free=pool.num_free,
        blocks_total=pool.num_blocks, block_size=blocks.block_size,
        num_preempted=len(batch.preempted), blocks_swapped_out=len(ops.swap_out),
        blocks_swapped_in=len(ops.swap_in), blocks_copied=len(ops.copy),
        prefix_hit_tokens=batch.prefix_hit_tokens,
        scheduled=[(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)],
        preempted=[s.request_id for s in batch.preempted], sampled=[s.request_id for s in sampled],
        finished=[s.request_id for s in finished],
        block_tables={r: list(t) for r, t in blocks.tables.items()} if with_tables else None,
        spec=spec, spec_tokens=spec_tokens, num_draft_tokens=sum(d for _, d, _ in spec),
        num_accepted_tokens=sum(a for _, _, a in spec), prefill_budget=prefill_budget,
        **phases, **comm)
