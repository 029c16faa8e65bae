"""ContiguousKVCache: every running sequence reserves `max_model_len` slots up front.

Storage is one flat pool of slots per layer, `k[slot]` and `v[slot]` of shape (kv_heads, head_dim),
with row r owning slots [r * max_model_len, (r + 1) * max_model_len). This is how simple engines and
transformers' static cache work. It is easy to reason about and wasteful: a 40-token chat reserves
as much memory as a full-context document. The paged cache replaces the rows by small blocks handed
out on demand; the attention backends do not change, because they only see slot numbers.
"""
from __future__ import annotations

import torch

from ..models.llama import LlamaArgs


class ContiguousKVCache:
    def __init__(self, args: LlamaArgs, max_num_seqs: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.num_slots = max_num_seqs * max_model_len
        shape = (self.num_slots, args.num_key_value_heads, args.head_dim)
        # torch.zeros, not empty: memory is committed now, so what the engine reports is real.
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(args.num_hidden_layers)]
        self.bytes_per_token = args.kv_bytes_per_token(dtype)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out row 0 first
        self._row_base = torch.arange(max_model_len, device=device)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    def allocate(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free KV cache row; the scheduler must check num_free_rows first")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slot numbers of positions [start, end) of the sequence in `row`."""
        return self._row_base[start:end] + row * self.max_model_len
