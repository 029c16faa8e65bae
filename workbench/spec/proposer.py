"""Draft: what a drafter proposes for one sequence. Every drafter implements

    propose(seqs, ks, runner_ctx) -> list[Draft]      up to ks[i] tokens for seqs[i]
    apply_block_ops(ops)                              mirror the target's block copies, if it
                                                      keeps its own KV cache
    release(request_id)                               forget a finished or aborted sequence

and sees each sequence's tokens (prompt + output) and, for model drafters, its block table: the
scheduler has already allocated blocks for the 1 + k positions the verification will write, and a
draft model writes its own K/V at those same slots in its own cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None   # (len(token_ids), vocab) the distributions sampled from,
    #                                     or None when the proposal is deterministic (one-hot q)


class NgramProposer:
    """Prompt lookup decoding (Saxena, 2023; vLLM's "ngram"): find the latest earlier occurrence of
    the sequence's last n tokens, for n from `max_n` down to `min_n`, and propose the tokens that
    followed it. No model, no KV cache: it costs a search over the sequence's tokens. It pays when
    the output repeats its input or itself (summaries, code edits, extraction, loops)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n:]
            # Windows that start before the suffix itself and leave at least one token after them.
            windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n                  # the latest match: most local context
                return arr[start:start + k].tolist()
        return []

    def propose(self, seqs, ks, ctx=None) -> list[Draft]:
        return [Draft(self.propose_one(seq.all_token_ids, k)) for seq, k in zip(seqs, ks)]

    def apply_block_ops(self, ops) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass
