"""Paged decode attention with the KV sequence split across programs (Flash-Decoding).

In a decode step every sequence has one new query per head, and its keys and values are scattered
over cache blocks listed in its block table. The work is tiny per query (a dot with every key) and
the cost is reading the cache, so the kernel's job is to keep every SM streaming bytes.

One program per (sequence, kv head) would leave most of a GPU idle when the batch is small and the
context long (8 sequences x 8 kv heads = 64 programs on 132 SMs, each walking 32k keys alone). So
the context is cut into `num_splits` ranges, one program each (phase 1), and the partial results are
merged afterwards (phase 2), exactly like merging tiles in the online softmax:

    phase 1, split s:  o_s = softmax(q k_s^T) v_s  (normalized over its own keys)
                       lse_s = log(sum(exp(q k_s^T)))      its log-sum-exp
    phase 2:           w_s = exp(lse_s - max_s lse_s);     out = sum_s w_s o_s / sum_s w_s

Grouped-query attention: the query heads that share a kv head are processed together by one
program, as the rows of a small matrix, so each key block is read once for the whole group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_attention import (LOG2E, _check_head_dim, _dot, _precision, kv_quant_code,
                              load_kv_tile)


@triton.jit
def _paged_decode_split(
        Q, K, V, PartialOut, PartialLse, block_table, seq_lens,
        stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        num_heads, group_size, split_len, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr = 0):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)                   # query heads of this kv head's group
    heads = kv_head * group_size + offs_g
    head_ok = offs_g < group_size
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for pos0 in range(start, end, BLOCK_N):
        pos = pos0 + offs_n
        ok = pos < end
        block = tl.load(block_table + seq * stride_bt + pos // PAGE, mask=ok, other=0)
        rows = block.to(tl.int64) * PAGE + pos % PAGE    # cache slot of each key (64-bit)
        k = load_kv_tile(K, kv_head * stride_kh, rows, stride_kn, offs_d, ok, q.dtype, True,
                         KV_QUANT, HEAD_DIM)
        s = _dot(q, tl.trans(k), PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(V, kv_head * stride_vh, rows, stride_vn, offs_d, ok, q.dtype, True,
                         KV_QUANT, HEAD_DIM)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    # An empty split (start >= seq_len) stores lse = -inf, so phase 2 gives it zero weight.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(PartialOut + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps
             + offs_d[None, :], out, mask=head_ok[:, None])
    tl.store(PartialLse + seq * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _paged_decode_merge(
        PartialOut, PartialLse, Out, num_splits,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s < num_splits
    lse = tl.load(PartialLse + seq * stride_lb + head * stride_lh + offs_s, mask=ok,
                  other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))           # log2 domain, like phase 1
    parts = tl.load(PartialOut + seq * stride_pb + head * stride_ph
                    + offs_s[:, None] * stride_ps + offs_d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + seq * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def decode_config(head_dim: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N keys per tile, num_warps): 64-key tiles; at head_dim 128 over 8 warps, where 4
    would spill registers (ptxas counts, python -m workbench.kernels.compile_check)."""
    if device.type != "cuda":
        return 16, 4
    return 64, (8 if head_dim > 64 else 4)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      min_split_len: int = 256) -> int:
    """Enough programs to give every SM about two, but no split shorter than `min_split_len` keys
    (below that, the merge costs more than the parallelism gains)."""
    if device.type != "cuda":   # the interpreter: split anything past one tile, so merging is used
        return max(1, min(4, triton.cdiv(max_seq_len, 16)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, min_split_len), 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           sm_scale: float | None = None, num_splits: int | None = None,
                           max_seq_len: int | None = None, kv_cache_dtype: str = "auto"
                           ) -> torch.Tensor:
    """q (B, H, D): one query per sequence; caches (num_blocks * block_size, KVH, D); block_table
    (B, max_blocks) int; seq_lens (B,) keys per sequence (>= 1). Returns (B, H, D).

    `max_seq_len` (the longest of seq_lens) sizes the splits; pass it when known to avoid reading
    seq_lens back from the device.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    _check_head_dim(head_dim)
    kv_quant = kv_quant_code(kv_cache_dtype, k_cache, head_dim, paged=True)
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads}")
    if block_size < 1 or k_cache.shape[0] % block_size:
        raise ValueError(f"block_size={block_size} must be positive and divide the cache's "
                         f"{k_cache.shape[0]} slots")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    group = heads // kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_seq_len, q.device)
    block_n, warps = decode_config(head_dim, q.device)
    # Every split but the last covers the same whole number of key tiles.
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, split_len)
    partial = torch.empty(batch, heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, heads, num_splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    scale = (head_dim ** -0.5 if sm_scale is None else sm_scale) * LOG2E
    _paged_decode_split[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, partial, lse, block_table, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        heads, group, split_len, scale,
        HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        PAGE=block_size, PRECISION=_precision(q), KV_QUANT=kv_quant, num_warps=warps,
        num_stages=2)
    _paged_decode_merge[(batch, heads)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), num_warps=4)
    return out
