"""Plain-PyTorch references: the specification of every kernel in this package.

Each function computes what its kernel computes, the obvious way (whole score matrices, fp32,
no tiling), so a test can compare the two on any shape. They are deliberately slow and simple:
read them first, then the kernel.
"""
from __future__ import annotations

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in fp32, for q (B, H, Sq, D) and k, v (B, KVH, Sk, D).

    The causal mask is aligned bottom-right: query i sits at position i + Sk - Sq.
    """
    heads, seq_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    kv_heads, seq_k = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    group = heads // kv_heads
    k = k.float().repeat_interleave(group, dim=1)   # each kv head serves `group` query heads
    v = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ k.transpose(-1, -2) * scale                  # (B, H, Sq, Sk)
    if causal:
        q_pos = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
        hidden = torch.arange(seq_k, device=q.device)[None, :] > q_pos
        scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(q.dtype)


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """Packed sequences (T, H, D): run attention_reference on each sequence's slice."""
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        qs, ks = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        one = attention_reference(q[qs].transpose(0, 1)[None], k[ks].transpose(0, 1)[None],
                                  v[ks].transpose(0, 1)[None], causal, sm_scale)
        out[qs] = one[0].transpose(0, 1)
    return out


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 block_size: int) -> torch.Tensor:
    """The first `seq_len` positions of one sequence, read out of a paged cache
    (num_blocks * block_size, KVH, D) through its row of the block table."""
    pos = torch.arange(seq_len, device=cache.device)
    slots = block_table[pos // block_size] * block_size + pos % block_size
    return cache[slots]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, block_size: int, causal: bool = True,
                              sm_scale: float | None = None) -> torch.Tensor:
    """Packed queries (T, H, D) against keys/values in a paged cache: gather, then attend.
    Decode is the case of one query per sequence."""
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        rows = slice(bounds[b], bounds[b + 1])
        k = gather_paged(k_cache, block_table[b], n, block_size)
        v = gather_paged(v_cache, block_table[b], n, block_size)
        one = attention_reference(q[rows].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  v.transpose(0, 1)[None], causal, sm_scale)
        out[rows] = one[0].transpose(0, 1)
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           sm_scale: float | None = None) -> torch.Tensor:
    """One query per sequence, q (B, H, D): it sees all of its sequence's seq_lens[b] keys."""
    cu = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_reference(q, k_cache, v_cache, cu, seq_lens, block_table, block_size,
                                     causal=False, sm_scale=sm_scale)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """x / rms(x) * weight, normalized in fp32 and cast back before the weight multiply (as Llama's
    reference code does). With `residual`, first x = x + residual, and that sum is returned too:
    (normed, new_residual)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return out if residual is None else (out, x)


def rotary_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x (T, heads, D) at `positions` (T,), with fp32 tables
    cos/sin (max_positions, D) whose two halves are equal: each pair (x_i, x_{i+D/2}) turns by its
    frequency's angle. The arithmetic is transformers' Llama code, in x's dtype: tables cast to it,
    x * cos and rotate_half(x) * sin each rounded, then their sum (so the kernel matches the model
    bit for bit in bf16 too)."""
    half = x.shape[-1] // 2
    c = cos[positions].to(x.dtype)[:, None, :]
    s = sin[positions].to(x.dtype)[:, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rotated * s
