"""Scheduler: each step, decide which sequences run and how many new tokens each gets.

Iteration-level (continuous) batching, first come first served:
1. every running sequence gets its next token (decode, 1 token each);
2. waiting requests join, oldest first, while there is a free sequence slot (`max_num_seqs`), a free
   KV cache row, and room in the token budget (`max_num_batched_tokens`) for the whole prompt.
Prefills and decodes therefore share a step, and a finished sequence frees its slot at once, so the
next waiting request joins in the very next step instead of waiting for the whole batch to drain.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .config import EngineConfig
from .kv.contiguous_cache import ContiguousKVCache
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]   # tokens each sequence feeds through the model this step
    num_prefill_tokens: int
    num_decode_tokens: int

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: EngineConfig, cache: ContiguousKVCache):
        self.config, self.cache = config, cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        seqs, counts, decode_tokens = [], [], 0
        for seq in self.running:
            seqs.append(seq)
            counts.append(seq.num_uncomputed_tokens)
            decode_tokens += seq.num_uncomputed_tokens
        budget -= decode_tokens
        prefill_tokens = 0
        while (self.waiting and len(self.running) < self.config.max_num_seqs
               and self.cache.num_free_rows > 0
               and self.waiting[0].num_uncomputed_tokens <= budget):
            seq = self.waiting.popleft()
            seq.cache_row = self.cache.allocate()
            seq.status = SequenceStatus.RUNNING
            seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            n = seq.num_uncomputed_tokens
            seqs.append(seq)
            counts.append(n)
            prefill_tokens += n
            budget -= n
        return ScheduledBatch(seqs, counts, prefill_tokens, decode_tokens)

    def free_finished(self) -> list[Sequence]:
        """Release the cache rows of sequences that finished this step."""
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self.running.remove(seq)
            self.cache.free(seq.cache_row)
            seq.cache_row = None
        return done

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.cache.free(seq.cache_row)
                seq.cache_row = None
                return seq
        return None
