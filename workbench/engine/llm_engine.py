"""LLMEngine: the step loop. One step = schedule, (draft,) run the model, sample, update outputs.

    batch  = scheduler.schedule()          which sequences run, how many tokens each (and which
                                           blocks they hold, after any preemption or swap)
    drafts = drafter.propose(...)          speculative decoding: k guesses per sequence
    inputs = plan_step(batch, blocks)      token ids, positions, block tables, logits rows
    out    = executor.submit / result      one forward pass for the whole batch, in this process
                                           or in the workers of a parallel engine
    tokens = sample(out.logits)            one token per sequence that finished its prompt (or
                                           the accepted drafts plus one)
    output_processor.append_token(...)     detokenize, check stop conditions, finish
    scheduler.free_finished()              finished sequences give their blocks back at once

Requests come in through the Processor (engine/processor.py), which checks every field before
anything is queued. Every step leaves a StepRecord in `self.trace`.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.config import EngineConfig, ModelFacts, plan_kernels, resolve
from workbench.engine.output_processor import OutputProcessor
from workbench.engine.processor import Processor, eos_token_ids
from workbench.engine.sample_step import StepSampler, fork_groups, record_speculation
from workbench.engine.scheduler import Scheduler
from workbench.engine.sequence import Sequence, SequenceStatus
from workbench.engine.step_inputs import plan_step
from workbench.engine.trace import StepRecord, record_step
from workbench.executor.factory import make_executor
from workbench.kv import disk_tier
from workbench.kv.block_manager import BlockManager
from workbench.kv.paged_cache import kv_bytes_per_token
from workbench.kv.tiers import KVTiers
from workbench.models.loader import load_tokenizer, read_args, resolve_checkpoint
from workbench.outputs import RequestOutput
from workbench.sample.sampler import Sampler
from workbench.sampling_params import SamplingParams
from workbench.spec import build_drafter


@dataclass
class InFlight:
    """A batch posted to the executor, not yet completed (a pipeline holds one per stage)."""
    scheduler: Scheduler
    batch: object
    ops: object
    handle: int
    times: list[float]      # start, scheduled, drafted, planned


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.checkpoint = resolve_checkpoint(config.model)
        args = read_args(self.checkpoint)
        kernels = plan_kernels(config)
        plan = resolve(config, kernels, ModelFacts(
            args.max_position_embeddings,
            kv_bytes_per_token(args, kernels.dtype, config.kv_cache_dtype), args.sliding_window))
        self.tokenizer = load_tokenizer(self.checkpoint)
        contiguous = config.kv_cache_layout == "contiguous"
        self.blocks = BlockManager(plan.num_kv_blocks, config.block_size,
                                   config.enable_prefix_caching, num_cpu_blocks=plan.num_cpu_blocks,
                                   reserve_tokens=plan.max_model_len if contiguous else None)
        self.executor = make_executor(plan, self.checkpoint, args, self.tokenizer, self.blocks)
        self.plan = self.executor.plan          # the plan once the model is built
        # What the executor built in this process (worker/builder.py); None with worker processes.
        self.built = built = getattr(self.executor, "built", None)
        self.model_args = built.args if built is not None else args
        self.model = built.model if built is not None else None
        self.quantization = built.quantization if built is not None else None
        self.offload = built.offload if built is not None else None
        self.weights_stored_bf16 = built.weights_stored_bf16 if built is not None else 0
        self.cache, self.runner, self.backend = (getattr(self.executor, name, None)
                                                 for name in ("cache", "runner", "backend"))
        self.device, self.dtype = self.plan.kernels.device, self.plan.kernels.dtype
        if config.cache_config.kv_tiers:
            self._attach_kv_tiers()
        # Pipeline parallelism keeps one micro-batch per stage in flight, each from its own
        # scheduler over the shared block pool (parallel/pipeline.py).
        self.schedulers = [Scheduler(self.plan, self.blocks, self.plan.micro_batch_max_num_seqs)
                           for _ in range(config.pipeline_parallel_size)]
        self.scheduler = self.schedulers[0]
        if len(self.schedulers) > 1:
            for sched in self.schedulers:
                sched.others_hold_blocks = self._others_hold_blocks(sched)
        self._in_flight: list[InFlight] = []
        self.sampler = Sampler(config.seed)
        eos = eos_token_ids(self.checkpoint, self.tokenizer)
        self.processor = Processor(self.plan, self.tokenizer, self.model_args.vocab_size, eos)
        self.sample_step = StepSampler(self.sampler, lambda: self.processor.grammars)
        self.drafter = None
        if config.spec_config is not None:
            self.drafter = build_drafter(self.plan, self.executor, self.tokenizer,
                                         self.sampler.generator)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.plan.max_model_len)
        self.trace: list[StepRecord] = []
        self._request_counter = itertools.count()
        self._sequences: dict[str, Sequence] = {}

    @property
    def kv_cache_tokens(self) -> int:
        return self.plan.kv_cache_tokens

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's size for the whole model (a parallel engine's workers hold shares)."""
        return self.kv_cache_tokens * kv_bytes_per_token(self.model_args, self.dtype,
                                                         self.config.kv_cache_dtype)

    def _attach_kv_tiers(self) -> None:
        """The CPU and disk tiers' books under the pool (kv/tiers.py; the executor holds their
        data); the disk tier first indexes the files a former engine left under a manifest that
        matches this one (kv/disk_tier.py)."""
        config, files = self.config, []
        if config.kv_disk_tier_bytes:
            files = disk_tier.open_directory(Path(config.kv_disk_tier_path), disk_tier.manifest(
                config.model, self.quantization, config.pruning, self.dtype,
                config.kv_cache_dtype, config.block_size, self.model_args))
        block_bytes = self.cache.bytes_per_token * config.block_size
        self.blocks.attach_tiers(KVTiers(self.plan.num_cpu_tier_blocks, config.kv_disk_tier_bytes,
                                         block_bytes, files))

    def _others_hold_blocks(self, me: Scheduler):
        return lambda: any(other.running for other in self.schedulers if other is not me)

    def close(self) -> None:
        """Stop the executor: a parallel engine's workers, the weight offload's prefetch thread
        (deleting its files)."""
        self.executor.close()

    # ----------------------------------------------------------------------------- requests
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return self.processor.tokenize(prompt)

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queue a request. `arrival_time` (time.perf_counter seconds) is when the request reached
        the system, if it waited outside the engine; TTFT and latency are measured from it."""
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        members = self.processor.process(prompt, params, request_id, priority, arrival_time,
                                         lambda rid: rid in self._sequences)
        for m in members:
            self._sequences[m.request_id] = m
        # With several schedulers (pipeline micro-batches), the one with the fewest requests.
        min(self.schedulers, key=lambda s: len(s.waiting) + len(s.running)).add(members[0])
        return request_id

    def abort_request(self, request_id: str) -> None:
        head = self._sequences.get(request_id)
        for member in (head.members if head is not None and head.members else [head]):
            rid = member.request_id if member is not None else request_id
            seq = None
            for scheduler in self.schedulers:
                seq = seq or scheduler.abort(rid)
            if self.drafter is not None:
                self.drafter.release(rid)
            if seq is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finished_time = time.perf_counter()
            self._sequences.pop(rid, None)

    def is_request_finished(self, request_id: str) -> bool:
        """Every sample of the request has finished (a group ends when its last member does)."""
        seq = self._sequences[request_id]
        if seq.members and seq.is_finished and not seq.forked:
            for m in seq.members[1:]:        # ended before its first token: the samples with it
                if not m.is_finished:
                    m.finish_reason, m.status = seq.finish_reason, SequenceStatus.FINISHED
                    m.finished_time = seq.finished_time
        return seq.group_finished

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or any(s.has_unfinished() for s in self.schedulers)

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._sequences.get(request_id)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The finished request's output; the engine forgets the request (all its samples)."""
        seq = self._sequences.pop(request_id)
        for m in (seq.members or [])[1:]:
            self._sequences.pop(m.request_id, None)
        return self.output_processor.to_request_output(seq)

    # ----------------------------------------------------------------------------- the step
    def step(self) -> list[Sequence]:
        """Run one iteration; returns the sequences that were scheduled in it. A pipeline-parallel
        engine first fills the pipeline (each scheduler without a batch in flight posts one), then
        completes the oldest batch: up to pipeline_parallel_size batches compute at any time."""
        busy = {id(f.scheduler) for f in self._in_flight}
        for scheduler in self.schedulers:
            if id(scheduler) not in busy:
                self._post(scheduler)
        if not self._in_flight:
            return []
        flight = self._in_flight.pop(0)
        result = self.executor.result(flight.handle)
        flight.times.append(time.perf_counter())
        return self._complete(flight, result)

    def _post(self, scheduler: Scheduler) -> None:
        """Schedule a batch, draft for it, and post its forward pass to the executor."""
        t0 = time.perf_counter()
        batch, ops = scheduler.schedule(), self.blocks.take_ops()
        if batch.empty:
            self.executor.apply_block_ops(ops)                   # a tier's deletions may be due
            self._release_finished(scheduler.free_finished())   # ended for length, if any
            return
        t1 = time.perf_counter()
        pending = ops
        if self.drafter is not None:          # drafts read the caches: the block copies go first
            self.executor.apply_block_ops(ops)
            self.drafter.apply_block_ops(ops)
            pending = None
            self._draft(batch)
        t_draft = time.perf_counter()
        inputs = plan_step(batch, self.blocks, pending)
        t_planned = time.perf_counter()        # one process: submit runs the forward itself
        handle = self.executor.submit(inputs)
        self._in_flight.append(InFlight(scheduler, batch, ops, handle, [t0, t1, t_draft, t_planned]))

    def _draft(self, batch) -> None:
        """Ask the drafter for the drafts the scheduler made room for; a sequence may get fewer
        (n-gram found no match), and then feeds fewer tokens (its spare block goes back after
        verification)."""
        idx = [i for i, s in enumerate(batch.seqs) if s.num_lookahead > 0]
        if not idx:
            return
        seqs = [batch.seqs[i] for i in idx]
        drafts = self.drafter.propose(seqs, [s.num_lookahead for s in seqs],
                                      [self.blocks.tables[s.request_id] for s in seqs])
        for i, seq, d in zip(idx, seqs, drafts):
            seq.spec_token_ids, seq.spec_probs = d.token_ids, d.probs
            unused = seq.num_lookahead - len(d.token_ids)
            batch.num_new_tokens[i] -= unused
            batch.num_lookahead_tokens -= unused

    def _complete(self, flight: InFlight, result) -> list[Sequence]:
        """Sample from the forward's logits, append the tokens, free what finished, record."""
        scheduler, batch, out = flight.scheduler, flight.batch, result.output
        sampled = [batch.seqs[i] for i in out.sample_indices]
        logits, forked = fork_groups(self.blocks, scheduler, sampled, out.logits)
        sampled += forked
        emitted = self.sample_step(sampled, logits)
        t_sampled = time.perf_counter()
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if i in out.prompt_logprobs:
                self.output_processor.extend_prompt_logprobs(seq, *out.prompt_logprobs[i])
            seq.num_computed_tokens += n
        spec = [self._append(seq, *e) for seq, e in zip(sampled, emitted) if not seq.is_finished]
        spec = [s for s in spec if s is not None]    # a finished seq: aborted in the pipeline
        if self.blocks.enable_prefix_caching:   # after the appends: accepted drafts are tokens now
            for seq in batch.seqs + forked:
                self.blocks.index_full_blocks(seq.request_id, seq.all_token_ids,
                                              min(seq.num_computed_tokens, seq.num_tokens))
        finished = scheduler.free_finished()
        self._release_finished(finished)
        t_end = time.perf_counter()
        t0, t1, t_draft, t_planned, t_forward = flight.times
        scheduler.observe_step(t_end - t0, batch.num_decode_tokens, batch.num_prefill_tokens)
        phases = dict(schedule_s=t1 - t0, draft_s=t_draft - t1,
                      prepare_s=t_planned - t_draft + result.pack_s,
                      forward_s=t_forward - t_planned - result.pack_s,
                      sample_s=t_sampled - t_forward, postprocess_s=t_end - t_sampled,
                      total_s=t_end - t0)
        comm = {**result.comm, "micro_batch": self.schedulers.index(scheduler),
                "num_in_flight": len(self._in_flight) + 1} if result.comm else {}
        self.trace.append(record_step(
            len(self.trace), batch, flight.ops, self.schedulers, self.blocks, sampled, finished,
            [s[0] for s in spec], [s[1] for s in spec], phases, comm,
            self.config.record_block_tables, scheduler.prefill_budget))
        return batch.seqs

    def _append(self, seq: Sequence, tokens, infos, accepted):
        """Append a sequence's new tokens; returns its speculation's record, if it drafted."""
        drafted, record = len(seq.spec_token_ids), None
        if drafted:
            # The K/V of rejected drafts were written but are not the sequence's: forget them.
            seq.num_computed_tokens -= drafted - accepted
            record_speculation(seq, drafted, accepted)
            record = ((seq.request_id, drafted, accepted),
                      (seq.request_id, list(seq.spec_token_ids), list(tokens)))
        self.output_processor.append_tokens(seq, tokens, infos)
        if seq.num_lookahead:
            seq.spec_token_ids, seq.spec_probs = [], None
            if not seq.is_finished:    # the blocks of rejected (or never drafted) slots go back
                self.blocks.trim(seq.request_id, seq.num_tokens)
                if hasattr(self.drafter, "rollback"):
                    self.drafter.rollback(seq)
        return record

    def _release_finished(self, finished: list[Sequence]) -> None:
        if self.drafter is not None:
            for seq in finished:
                self.drafter.release(seq.request_id)
