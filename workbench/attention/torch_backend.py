"""The plain-PyTorch attention backend: the specification every faster backend is tested against.

One call per layer does two things:
1. write the new tokens' keys and values into the KV cache at `slot_mapping`;
2. for every sequence, attend its new queries to all of its cached keys, causally.

The causal mask is aligned *bottom-right*: the i-th of a sequence's `q_len` new queries sits at
position `seq_len - q_len + i` and may see every key up to and including that position. That one rule
covers prefill (q_len == seq_len), decode (q_len == 1) and, later, chunked prefill on top of cached
blocks (1 < q_len < seq_len).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values (num_tokens, kv_heads, head_dim) in their cache slots."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def causal_mask(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """Boolean (num_seqs, 1, max_q, max_kv): True where query i of a sequence may see key j."""
    q_lens = torch.tensor(meta.query_lens, device=device)
    q_pos = (meta.seq_lens - q_lens)[:, None] + torch.arange(meta.max_query_len, device=device)
    kv_pos = torch.arange(meta.max_seq_len, device=device)
    visible = kv_pos[None, None, :] <= q_pos[:, :, None]
    return visible[:, None]


class TorchAttention:
    """Reference attention over a slot-addressed KV cache, batched with padding and one SDPA call."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D); caches: (num_slots, KVH, D). Returns (T, H * D)."""
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        batch, max_q, max_kv = meta.num_seqs, meta.max_query_len, meta.max_seq_len
        keys = k_cache[meta.slot_table].transpose(1, 2)      # (B, KVH, max_kv, D)
        values = v_cache[meta.slot_table].transpose(1, 2)
        uniform = all(n == max_q for n in meta.query_lens)
        if uniform:
            queries = q.view(batch, max_q, num_heads, head_dim)
        else:
            queries = q.new_zeros(batch, max_q, num_heads, head_dim)
            for i, (start, n) in enumerate(zip(meta.query_start_loc.tolist(), meta.query_lens)):
                queries[i, :n] = q[start:start + n]
        queries = queries.transpose(1, 2)                    # (B, H, max_q, D)

        same_len = all(n == max_kv for n in meta.seq_lens_list)
        if uniform and same_len and max_q == max_kv:
            # Every sequence prefills from position 0 with no padding: the plain causal mask.
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                 scale=scale, enable_gqa=True)
        elif uniform and same_len and max_q == 1:
            # Decode with equal lengths: every query sees every key, no mask needed.
            out = F.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                 enable_gqa=True)
        else:
            mask = causal_mask(meta, q.device)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                 scale=scale, enable_gqa=True)
        out = out.transpose(1, 2)                            # (B, max_q, H, D)
        if uniform:
            return out.reshape(num_tokens, num_heads * head_dim)
        rows = [out[i, :n] for i, n in enumerate(meta.query_lens)]
        return torch.cat(rows).reshape(num_tokens, num_heads * head_dim)
