"""Scheduler: each step, decide which sequences run and how many new tokens each gets.

Iteration-level (continuous) batching with a token budget, as in vLLM's v1 scheduler. There is no
separate "prefill phase": every sequence simply has tokens whose K/V are not cached yet (a whole
prompt, a chunk of one, or the one token sampled last step), and each step hands out up to
`max_num_batched_tokens` of them.

1. Running sequences first, in priority order (lower `priority` value first, then arrival). Each
   gets all its uncomputed tokens, or as many as the budget allows (chunked prefill). If the KV pool
   cannot hold them, the lowest-priority running sequence is preempted (swapped to CPU memory, or
   freed to be recomputed later) until it can; a sequence that cannot grow even alone ends with
   finish_reason "length".
2. Then, if nobody was preempted this step, waiting sequences join in priority order while there
   is budget, a free sequence slot (`max_num_seqs`) and KV blocks: swapped ones are swapped back in;
   new ones first reuse the blocks of any cached prefix (prefix caching).
A sequence whose last prefill chunk ran gets a token sampled; one in the middle of its prompt
does not.

Speculative decoding: a decoding sequence may get 1 + k tokens instead of 1, its last token plus
k lookahead slots for drafted tokens (`seq.num_lookahead`; the engine asks the drafter for the
drafts after scheduling). k is the request's (or the engine's) num_speculative_tokens, cut to the
budget, the context and the request's remaining max_tokens; the blocks for the lookahead are
allocated like any others, and if the pool is short the lookahead is dropped before anybody is
preempted. Drafted tokens count against max_num_batched_tokens. Requests whose logits depend on
their own tokens (penalties, min_tokens, bad_words) and parallel samples are not drafted for.

SLO-aware batching (`tpot_slo`): a step that carries decodes also carries prefill chunks, so
its time, the TPOT every decoding request feels, grows with the prefill tokens it takes. With a
target T, prefill tokens per step are capped by `prefill_budget`, set from two running estimates
of this machine's costs: a decode-only step takes d seconds, each prefill token adds c, so the
budget is (T - d) / c tokens, between an eighth of max_num_batched_tokens and all of it. Until
both are measured, a decode step over T halves the budget and one under 80% of T adds an eighth
back. Without decodes running, prefill takes the whole budget.

Parallel sampling: a request with n samples is admitted only when n sequence slots are free; its
first sequence prefills the prompt, and the others join `running` when they fork (llm_engine.py).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from workbench.config import EnginePlan
from workbench.kv.block_manager import BlockManager
from workbench.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]        # tokens each sequence feeds through the model this step
    num_prefill_tokens: int          # prompt (or recomputed) tokens among them
    num_decode_tokens: int           # one per sequence that is generating
    num_lookahead_tokens: int = 0    # slots for drafted tokens (speculative decoding)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_hit_tokens: int = 0       # tokens new sequences took from the prefix cache this step

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, plan: EnginePlan, blocks: BlockManager, max_num_seqs: int | None = None):
        """max_num_seqs: this scheduler's share when pipeline micro-batches split the plan's."""
        config = plan.config
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs or config.max_num_seqs
        self.max_num_batched_tokens = plan.max_num_batched_tokens
        self.max_model_len = plan.max_model_len
        self.block_size = config.block_size
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.tpot_slo = config.tpot_slo
        self.batch_invariant = config.batch_invariant
        self.preemption_mode = config.preemption_mode
        self.spec = config.spec_config
        self.waiting: list[Sequence] = []   # sorted by sort_key; holds WAITING and SWAPPED
        self.running: list[Sequence] = []
        self.ended: list[Sequence] = []     # finished by the scheduler itself ("length")
        # With pipeline parallelism several schedulers share one block pool; a sequence that does
        # not fit while another scheduler's sequences hold blocks must wait, not end.
        self.others_hold_blocks = lambda: False
        self.prefill_budget = self.max_num_batched_tokens    # adapted with tpot_slo
        self.decode_step_s: float | None = None    # running estimate: a decode-only step
        self.prefill_token_s: float | None = None  # running estimate: one more prefill token

    def observe_step(self, seconds: float, num_decode_tokens: int,
                     num_prefill_tokens: int = 0) -> None:
        """Adapt the prefill budget to the last step's time (only with tpot_slo)."""
        slo, top = self.tpot_slo, self.max_num_batched_tokens
        if slo is None:
            return
        self._estimate(seconds, num_decode_tokens, num_prefill_tokens)
        floor = max(self.block_size, top // 8)   # a chunk of 16 would starve the prompts
        if self.decode_step_s is not None and self.prefill_token_s:
            budget = (slo - self.decode_step_s) / self.prefill_token_s
            self.prefill_budget = int(min(top, max(floor, budget)))
        elif num_decode_tokens and seconds > slo:
            self.prefill_budget = max(floor, self.prefill_budget // 2)
        elif num_decode_tokens and seconds < 0.8 * slo:
            self.prefill_budget = min(top, self.prefill_budget + max(1, top // 8))

    def _estimate(self, seconds: float, decodes: int, prefills: int, weight: float = 0.3) -> None:
        """Exponential moving averages of the two costs the budget is computed from."""
        def ema(old, new):
            return new if old is None else (1 - weight) * old + weight * new
        if decodes and not prefills:
            self.decode_step_s = ema(self.decode_step_s, seconds)
        elif prefills and self.decode_step_s is not None:
            base = self.decode_step_s if decodes else 0.0
            self.prefill_token_s = ema(self.prefill_token_s,
                                       max(seconds - base, 0.0) / prefills)

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        keys = [s.sort_key for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.sort_key), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.blocks.free(request_id)
                    return seq
        return None

    # ------------------------------------------------------------------ the decision
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], 0, 0)
        self.running.sort(key=lambda s: s.sort_key)
        decoding = any(s.num_uncomputed_tokens == 1 for s in self.running)
        prefill_left = self.prefill_budget if self.tpot_slo and decoding else budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            prefilling = seq.num_uncomputed_tokens > 1
            n = self._tokens_for(seq, min(budget, prefill_left) if prefilling else budget)
            if n == 0:
                i += 1
                continue
            while not self.blocks.allocate(seq.request_id, seq.num_computed_tokens, n):
                if seq.num_lookahead:               # drop the speculation before preempting
                    n -= seq.num_lookahead
                    seq.num_lookahead = 0
                    continue
                if len(self.running) == 1 and not self.others_hold_blocks():
                    self._end_for_length(seq)       # alone and still too big: it can never fit
                    break
                victim = self.running.pop()         # lowest priority, latest arrival
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add(batch, seq, n)
                budget -= n
                if prefilling:
                    prefill_left -= n
                i += 1
        if not batch.preempted:
            self._admit(batch, min(budget, prefill_left))
        return batch

    def _tokens_for(self, seq: Sequence, budget: int, lookahead: bool = True) -> int:
        n = seq.num_uncomputed_tokens
        seq.num_lookahead = 0
        if self.batch_invariant and n > 1:
            # Chunks end at multiples of the step budget from the prompt's start, whatever else
            # shares the step: a chunk that does not fit waits, rather than being cut elsewhere.
            chunk = self.max_num_batched_tokens
            n = min(n, chunk - seq.num_computed_tokens % chunk)
            return n if n <= budget else 0
        if n <= budget:
            if lookahead and n == 1 and seq.output_token_ids:
                seq.num_lookahead = self._lookahead(seq, budget - 1)
            return n + seq.num_lookahead
        return budget if self.enable_chunked_prefill else 0

    def _lookahead(self, seq: Sequence, spare_budget: int) -> int:
        """Drafts for a decoding sequence: its k, within the budget; the step emits at most k + 1
        tokens, which must fit the context and the request's max_tokens."""
        if self.spec is None or seq.params.uses_history or seq.params.best_of > 1:
            return 0       # penalties and bans change with every token; samples share no drafts
        k = seq.params.num_speculative_tokens
        if k is None:
            k = self.spec.num_speculative_tokens
        room = min(self.max_model_len - seq.num_tokens,
                   seq.params.max_tokens - len(seq.output_token_ids)) - 1
        return max(0, min(k, spare_budget, room))

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        if seq.num_computed_tokens >= seq.num_prompt_tokens and n == 1 + seq.num_lookahead:
            batch.num_decode_tokens += 1
            batch.num_lookahead_tokens += seq.num_lookahead
        else:
            batch.num_prefill_tokens += n

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.members and not seq.forked and \
                    len(self.running) + len(seq.members) > self.max_num_seqs:
                break                   # its samples join it at its first token: keep them slots
            if seq.status == SequenceStatus.SWAPPED:
                n = self._tokens_for(seq, budget, lookahead=False)
                if n == 0 or not self.blocks.can_swap_in(seq.request_id,
                                                         seq.num_computed_tokens + n):
                    if not self.running and n > 0 and not self.others_hold_blocks():
                        self.waiting.pop(0)          # even an empty pool cannot hold it
                        self._end_for_length(seq)
                        continue
                    break
                self.blocks.swap_in(seq.request_id)
                self.blocks.allocate(seq.request_id, seq.num_computed_tokens, n)
            else:
                hits = [] if seq.params.prompt_logprobs is not None else \
                    self.blocks.cached_prefix(seq.all_token_ids)
                num_cached = len(hits) * self.blocks.block_size
                seq.num_computed_tokens = num_cached
                n = self._tokens_for(seq, budget, lookahead=False)
                if n == 0 or not self.blocks.allocate(seq.request_id, num_cached, n, hits):
                    seq.num_computed_tokens = 0
                    if not self.running and n > 0 and not self.others_hold_blocks():
                        # even an empty pool cannot hold it
                        self.waiting.pop(0)
                        self._end_for_length(seq)
                        continue
                    break
                self.blocks.record_lookup(seq.num_tokens, num_cached)
                batch.prefix_hit_tokens += num_cached
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.perf_counter()
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            budget -= n

    # ------------------------------------------------------------------ preemption and endings
    def _preempt(self, seq: Sequence) -> None:
        """Take the sequence's blocks away; it waits at the head of its priority class."""
        seq.num_preemptions += 1
        seq.num_lookahead = 0
        if self.preemption_mode == "swap" and self.blocks.can_swap_out(seq.request_id):
            self.blocks.swap_out(seq.request_id)
            seq.status = SequenceStatus.SWAPPED
        else:  # recompute: forget the K/V; prompt and generated tokens are prefilled again
            self.blocks.free(seq.request_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.add(seq)

    def _end_for_length(self, seq: Sequence) -> None:
        """The KV pool cannot hold this sequence any longer: end it as if it hit max_tokens."""
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.finish_reason = "length"
        seq.status = SequenceStatus.FINISHED
        seq.finished_time = time.perf_counter()
        self.ended.append(seq)

    def free_finished(self) -> list[Sequence]:
        """Release the blocks of sequences that finished this step (and those ended above)."""
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self.running.remove(seq)
            self.blocks.free(seq.request_id)
        done += self.ended
        self.ended = []
        return done
