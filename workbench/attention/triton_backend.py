"""The Triton attention backend: the paged cache is read in place, through block tables.

- A decode-only step (one new token per sequence) goes to paged_decode_attention, which splits each
  long context over several programs and merges them (Flash-Decoding).
- Any step with a prompt or a chunk of one goes to flash_attention_varlen in its paged form: every
  sequence's new queries, packed, attend causally (bottom-right) to all of the sequence's keys in
  the cache. Decode rows in a mixed step are just sequences with one query.
New keys and values are written into the cache first (one index_copy_ per tensor, quantized to
FP8/INT8 rows first if the cache holds them), so the kernels read this step's tokens from the cache
like all earlier ones, dequantizing quantized rows as they load them.
"""
from __future__ import annotations

import torch

from workbench.attention.metadata import AttentionMetadata
from workbench.attention.torch_backend import write_kv
from workbench.kernels.flash_attention import flash_attention_varlen
from workbench.kernels.paged_decode import choose_num_splits, paged_decode_attention
from workbench.layers.ops import TritonOps


class TritonAttention:
    name = "triton"

    def __init__(self):
        self._prefill, self._decode = flash_attention_varlen, paged_decode_attention
        self._choose_splits = choose_num_splits
        self.ops = TritonOps()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.kv_cache_dtype)
        num_tokens, num_heads, head_dim = q.shape
        if meta.is_decode_only:
            if meta.plan is None:   # same for every layer of the step
                meta.plan = self._choose_splits(meta.num_seqs, k_cache.shape[1], meta.max_seq_len,
                                                q.device)
            out = self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                               meta.block_size, sm_scale=scale, num_splits=meta.plan,
                               max_seq_len=meta.max_seq_len, kv_cache_dtype=meta.kv_cache_dtype)
        else:
            out = self._prefill(q, k_cache, v_cache, meta.query_start_loc, meta.max_query_len,
                                seq_lens_k=meta.seq_lens, block_table=meta.block_tables,
                                block_size=meta.block_size, causal=True, sm_scale=scale,
                                kv_cache_dtype=meta.kv_cache_dtype)
        return out.view(num_tokens, num_heads * head_dim)
