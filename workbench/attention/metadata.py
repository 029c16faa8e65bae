"""AttentionMetadata: everything attention needs to know about one packed forward batch.

The engine runs every step as one *packed* batch: the new tokens of all scheduled sequences are
concatenated into a single row of `num_tokens` (no padding), as vLLM does. This dataclass says how
that row splits into sequences and where each sequence's keys and values live in the KV cache. It is
built by the model runner and handed down the forward call explicitly (no module-level context).

Example, two sequences: A is prefilling 3 prompt tokens, B is decoding its 6th token.

    input tokens       a0 a1 a2 b5
    query_start_loc    [0, 3, 4]          sequence i owns rows query_start_loc[i]:query_start_loc[i+1]
    seq_lens           [3, 6]             tokens in the cache for each sequence after this step
    slot_mapping       [s_a0 s_a1 s_a2 s_b5]   where each new token's K/V is written
    slot_table         [[s_a0 s_a1 s_a2  .  .  .], [s_b0 ... s_b5]]   where to read them back

With the paged cache, slot = block_table[position // block_size] * block_size + position % block_size.
`slot_table` is that formula expanded for every position (what the plain-PyTorch backend gathers
with); `block_tables` is the compact form that paged attention kernels read directly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int64, prefix sums of new tokens per sequence
    seq_lens: torch.Tensor         # (num_seqs,) int64, context length after this step's tokens
    slot_mapping: torch.Tensor     # (num_tokens,) int64, cache slot written by each new token
    slot_table: torch.Tensor       # (num_seqs, max_seq_len) int64, cache slot of each position
    max_query_len: int             # longest run of new tokens (1 in a pure decode step)
    max_seq_len: int               # longest context in the batch
    query_lens: list[int]          # the same as query_start_loc, as Python ints (no device sync)
    seq_lens_list: list[int]
    block_tables: torch.Tensor | None = None  # (num_seqs, max_blocks) int64, for paged kernels
    block_size: int = 0
    # "fp8"/"int8"/"int4": cache rows are codes + scale (layers/kv_formats.py); a tuple: one per layer
    kv_cache_dtype: str | tuple[str, ...] = "auto"
    plan: object = None  # what the backend precomputes once per step (index tensors, masks)
    # every new token gets logits (decode, or a verification's k + 1): no prompt is being read
    decode_like: bool = False
    layer_views: dict | None = None  # with a per-layer plan: one view of this step per format

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """What layer `layer`'s attention reads: this object, or with a per-layer plan a view
        whose kv_cache_dtype is that layer's format. Views are made once per format and step, so
        a backend plans once per format, as it plans once per step with one format."""
        if isinstance(self.kv_cache_dtype, str):
            return self
        fmt = self.kv_cache_dtype[layer]
        if self.layer_views is None:
            self.layer_views = {}
        if fmt not in self.layer_views:
            self.layer_views[fmt] = dataclasses.replace(self, kv_cache_dtype=fmt, plan=None,
                                                        layer_views=None)
        return self.layer_views[fmt]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
