"""FlashAttention forward (FlashAttention-2's loop order) in Triton, dense and variable-length/paged.

The algorithm, for one tile of BLOCK_M queries of one head:

    m = -inf, l = 0, acc = 0                  running max, running sum, unnormalized output
    for each tile of BLOCK_N keys/values:
        s     = q @ k^T * scale               (BLOCK_M, BLOCK_N) scores, only in registers/SRAM
        m_new = max(m, rowmax(s))
        p     = exp(s - m_new)                this tile's probabilities, up to a common factor
        alpha = exp(m - m_new)                how much the old max was too small
        l     = l * alpha + rowsum(p)
        acc   = acc * alpha + p @ v           correct the old output, add this tile's share
        m     = m_new
    out = acc / l

The (seq_q, seq_k) score matrix never exists in memory: each K/V tile is read once per query tile
and the output is written once. Exponentials are computed as exp2 with log2(e) folded into the
scale (one multiply fewer per score; the GPU's fast instruction is exp2).

Causal masking, aligned bottom-right: query i of a sequence with `q_len` new queries and `kv_len`
keys sits at position i + kv_len - q_len and sees keys 0..that position. Only the tiles that straddle
the diagonal need a mask, so the key loop runs in two stages: tiles entirely visible to the whole
query tile (no mask, no wasted compares), then the diagonal tiles (masked). Tiles entirely above the
diagonal are never loaded: that is the 2x a causal kernel saves.

One kernel serves three layouts, chosen by constexpr flags so each compiles to its own code:
- dense: q (batch, heads, seq_q, dim), k/v (batch, kv_heads, seq_k, dim), SDPA's layout;
- VARLEN: q (total_tokens, heads, dim) packed, sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1];
- PAGED (with VARLEN): keys and values live in a paged cache (num_blocks * page, kv_heads, dim) and
  key position n of sequence b is at slot block_table[b, n // page] * page + n % page.
Grouped-query attention: query head h reads kv head h // (heads // kv_heads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in fp32. PRECISION "upcast" works around Triton's CPU interpreter, whose
    bf16 dot is wrong (it multiplies the raw 16-bit patterns); GPUs never take that branch."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _key_rows(n_offs, seq, kv_start, block_table, stride_bt, PAGED: tl.constexpr,
              PAGE: tl.constexpr):
    """Row index of each key position in the K/V tensors: direct, or through the block table.
    64-bit, because row * row_stride overflows 32 bits in caches of a few GB."""
    if PAGED:
        block = tl.load(block_table + seq * stride_bt + n_offs // PAGE)
        return block.to(tl.int64) * PAGE + n_offs % PAGE
    else:
        return (kv_start + n_offs).to(tl.int64)


@triton.jit
def load_kv_tile(Cache, base, rows, stride_n, offs_d, in_range, dtype, MASKED: tl.constexpr,
                 KV_QUANT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A (BLOCK_N, HEAD_DIM) tile of keys or values in `dtype`. With a quantized cache
    (KV_QUANT 1 = INT8, 2 = FP8 e4m3; workbench/layers/kv_formats.py) each row is HEAD_DIM bytes of codes
    followed by its fp32 scale: load the bytes, reinterpret, multiply by the row's scale."""
    ptrs = Cache + base + rows[:, None] * stride_n + offs_d[None, :]
    if KV_QUANT == 0:
        if MASKED:
            return tl.load(ptrs, mask=in_range[:, None], other=0.0)
        else:
            return tl.load(ptrs)
    else:
        scale_ptrs = (Cache + base + rows * stride_n + HEAD_DIM).to(tl.pointer_type(tl.float32))
        if MASKED:
            raw = tl.load(ptrs, mask=in_range[:, None], other=0)
            scale = tl.load(scale_ptrs, mask=in_range, other=0.0)
        else:
            raw = tl.load(ptrs)
            scale = tl.load(scale_ptrs)
        if KV_QUANT == 1:
            codes = raw.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            codes = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return (codes * scale[:, None]).to(dtype)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, K, V, k_base, v_base, stride_kn, stride_vn,
                  seq, kv_start, block_table, stride_bt, lo, hi, kv_len, q_pos,
                  offs_n, offs_d, qk_scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  KV_QUANT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online-softmax loop over key tiles [lo, hi). Unmasked tiles lie wholly inside the
    sequence and below the diagonal: plain loads, no compares. MASKED tiles check both."""
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        in_range = n < kv_len
        if MASKED:
            rows = _key_rows(tl.where(in_range, n, 0), seq, kv_start, block_table, stride_bt,
                             PAGED, PAGE)
        else:
            rows = _key_rows(n, seq, kv_start, block_table, stride_bt, PAGED, PAGE)
        k = load_kv_tile(K, k_base, rows, stride_kn, offs_d, in_range, q.dtype, MASKED,
                         KV_QUANT, HEAD_DIM)
        s = _dot(q, tl.trans(k), PRECISION) * qk_scale     # log2-domain scores (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = in_range[None, :]
            if CAUSAL:
                visible = visible & (n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(V, v_base, rows, stride_vn, offs_d, in_range, q.dtype, MASKED,
                         KV_QUANT, HEAD_DIM)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _flash_attention_fwd(
        Q, K, V, Out, cu_seqlens_q, cu_seqlens_k, seq_lens_k, block_table,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_bt,
        seq_len_q, seq_len_k, num_heads, group_size, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
        PRECISION: tl.constexpr, KV_QUANT: tl.constexpr = 0):
    # One program = one tile of BLOCK_M queries of one (sequence, head).
    tile = tl.program_id(0)
    # 64-bit batch/head offsets: seq * stride_qb overflows 32 bits past 2^31 elements.
    seq = (tl.program_id(1) // num_heads).to(tl.int64)
    head = (tl.program_id(1) % num_heads).to(tl.int64)
    kv_head = head // group_size
    if VARLEN:
        q_start = tl.load(cu_seqlens_q + seq)
        q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
        if PAGED:
            kv_start = 0
            kv_len = tl.load(seq_lens_k + seq)
        else:
            kv_start = tl.load(cu_seqlens_k + seq)
            kv_len = tl.load(cu_seqlens_k + seq + 1) - kv_start
    else:
        q_start = 0
        q_len = seq_len_q
        kv_start = 0
        kv_len = seq_len_k
    m0 = tile * BLOCK_M
    if m0 >= q_len:                     # varlen grids are sized for the longest sequence
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_start + offs_m      # 32-bit: a row offset stays below the tensor's element count
    q_ptrs = Q + seq * stride_qb + head * stride_qh + q_rows[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)
    k_base = seq * stride_kb + kv_head * stride_kh
    v_base = seq * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    q_pos = offs_m + (kv_len - q_len)   # bottom-right alignment

    if CAUSAL:
        # Keys 0..m0+shift are visible to every row of the tile: whole tiles of them need no mask.
        full_end = tl.minimum((m0 + kv_len - q_len + 1) // BLOCK_N * BLOCK_N,
                              kv_len // BLOCK_N * BLOCK_N)
        diag_end = tl.minimum(m0 + BLOCK_M + kv_len - q_len, kv_len)
    else:
        full_end = kv_len // BLOCK_N * BLOCK_N
        diag_end = kv_len
    full_end = tl.maximum(full_end, 0)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, K, V, k_base, v_base, stride_kn, stride_vn,
                                  seq, kv_start, block_table, stride_bt, 0, full_end, kv_len,
                                  q_pos, offs_n, offs_d, qk_scale,
                                  False, CAUSAL, PAGED, PAGE, BLOCK_N, PRECISION,
                                  KV_QUANT, HEAD_DIM)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, K, V, k_base, v_base, stride_kn, stride_vn,
                                  seq, kv_start, block_table, stride_bt, full_end, diag_end,
                                  kv_len, q_pos, offs_n, offs_d, qk_scale,
                                  True, CAUSAL, PAGED, PAGE, BLOCK_N, PRECISION,
                                  KV_QUANT, HEAD_DIM)
    out = acc / l_i[:, None]
    o_ptrs = Out + seq * stride_ob + head * stride_oh + q_rows[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < q_len)


def _tile_sizes(head_dim: int, device: torch.device, varlen: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Small tiles in the interpreter (each program is
    numpy work, and small tiles hit more edge cases). On a GPU: 128x64 tiles over 8 warps keep the
    tensor cores fed; the variable-length/paged form gathers key rows through per-row pointers,
    which costs registers, so at head_dim 128 it uses 64-row query tiles; 4-byte elements and
    head_dim 256 take smaller tiles so the staged K/V tiles fit in shared memory. These were chosen
    without a GPU, from ptxas's register, spill and shared-memory counts (python -m
    workbench.kernels.compile_check): no spills in bf16 dense attention at head_dim 64 and 128 and in paged
    decode; some in the variable-length forms at head_dim 128 (tens to hundreds of bytes), at head
    dim 256, and in fp32 (kilobytes). Tune them with `python -m workbench.bench kernels`."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    elem = torch.empty((), dtype=dtype).element_size()
    if elem == 4 and head_dim > 64:      # fp32 (exact fp32 dots, no tensor cores): correctness path
        return 32, 32, 4, 2
    if head_dim > 128:
        return 64, 32, 8, 2
    if varlen and head_dim > 64:
        return 64, 64, 8, 3
    return 128, 64, 8, 3


def _precision(q: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 dots (Triton would otherwise use TF32 on a GPU, 10-bit
    mantissas); bf16/fp16 inputs use the tensor cores and accumulate in fp32 either way. In the
    CPU interpreter, bf16 dots are done in fp32 (see _dot)."""
    if q.device.type != "cuda" and q.dtype == torch.bfloat16:
        return "upcast"
    return "ieee" if q.dtype == torch.float32 else "tf32"


KV_QUANT_CODES = {"auto": 0, "int8": 1, "fp8": 2}


def kv_quant_code(kv_cache_dtype: str, cache: torch.Tensor, head_dim: int, paged: bool) -> int:
    """The kernels' KV_QUANT constant, after checking the cache has the quantized row layout."""
    if kv_cache_dtype not in KV_QUANT_CODES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid: allowed are "
                         + ", ".join(repr(d) for d in KV_QUANT_CODES))
    code = KV_QUANT_CODES[kv_cache_dtype]
    if code and (not paged or cache.dtype != torch.uint8 or cache.shape[-1] != head_dim + 4):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a paged uint8 cache of rows "
                         f"head_dim + 4 = {head_dim + 4} bytes; got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    return code


def _check_head_dim(head_dim: int) -> None:
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim={head_dim} is not supported by the Triton kernels: allowed are "
                         "16, 32, 64, 128, 256")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    sm_scale: float | None = None) -> torch.Tensor:
    """Attention in SDPA's layout: q (B, H, Sq, D), k and v (B, KVH, Sk, D) with H % KVH == 0.

    With `causal`, the mask is aligned bottom-right (query i sees keys up to i + Sk - Sq), which is
    SDPA's `is_causal` when Sq == Sk.
    """
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    _check_head_dim(head_dim)
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"(batch={batch}, kv_heads, seq_k, head_dim={head_dim})")
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads}")
    if causal and seq_q > seq_k:
        raise ValueError(f"causal attention needs seq_q <= seq_k, got seq_q={seq_q}, seq_k={seq_k}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    block_m, block_n, warps, stages = _tile_sizes(head_dim, q.device, dtype=q.dtype)
    grid = (triton.cdiv(seq_q, block_m), batch * heads)
    _flash_attention_fwd[grid](
        q, k, v, out, q, q, q, q,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), 0,
        seq_q, seq_k, heads, heads // kv_heads, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, VARLEN=False,
        PAGED=False, PAGE=1, PRECISION=_precision(q), num_warps=warps, num_stages=stages)
    return out


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                           cu_seqlens_k: torch.Tensor | None = None,
                           seq_lens_k: torch.Tensor | None = None,
                           block_table: torch.Tensor | None = None, block_size: int = 0,
                           causal: bool = True, sm_scale: float | None = None,
                           kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Packed sequences: q (total_q, H, D); sequence b's queries are rows cu_seqlens_q[b]:[b+1].

    Keys/values either packed the same way (k, v (total_k, KVH, D) with `cu_seqlens_k`), or in a
    paged cache (k, v (num_blocks * block_size, KVH, D) with `block_table` (B, max_blocks),
    `block_size` and `seq_lens_k` (B,)). A paged cache may hold FP8/INT8 rows (`kv_cache_dtype`
    "fp8"/"int8", uint8 tensors of (..., KVH, D + 4)); the output is then in q's dtype. The causal mask is aligned bottom-right, so a chunk of a prompt whose
    earlier tokens are already cached attends to them all and causally to itself.
    """
    total_q, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    _check_head_dim(head_dim)
    kv_quant = kv_quant_code(kv_cache_dtype, k, head_dim, paged=block_table is not None)
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads}")
    paged = block_table is not None
    if paged == (cu_seqlens_k is not None) or paged != (seq_lens_k is not None):
        raise ValueError("pass either cu_seqlens_k (packed keys) or block_table with seq_lens_k "
                         "(paged keys)")
    if paged and (block_size < 1 or k.shape[0] % block_size):
        raise ValueError(f"block_size={block_size} must be positive and divide the cache's "
                         f"{k.shape[0]} slots")
    num_seqs = cu_seqlens_q.numel() - 1
    if causal and cu_seqlens_q.device.type == "cpu":   # free to check here; on a GPU it would sync
        q_lens = cu_seqlens_q.diff()
        kv_lens = seq_lens_k if paged else cu_seqlens_k.diff()
        if bool((q_lens > kv_lens.to(q_lens.device)).any()):
            raise ValueError("causal attention needs q_len <= kv_len for every sequence "
                             f"(q_lens {q_lens.tolist()}, kv_lens {kv_lens.tolist()})")
    out = torch.empty_like(q)
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    block_m, block_n, warps, stages = _tile_sizes(head_dim, q.device, varlen=True, dtype=q.dtype)
    page = block_size if paged else 1
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs * heads)
    dummy = cu_seqlens_q
    _flash_attention_fwd[grid](
        q, k, v, out, cu_seqlens_q,
        cu_seqlens_k if cu_seqlens_k is not None else dummy,
        seq_lens_k if seq_lens_k is not None else dummy,
        block_table if paged else dummy,
        0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0),
        0, v.stride(1), v.stride(0), 0, out.stride(1), out.stride(0),
        block_table.stride(0) if paged else 0,
        0, 0, heads, heads // kv_heads, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, VARLEN=True,
        PAGED=paged, PAGE=page, PRECISION=_precision(q), KV_QUANT=kv_quant, num_warps=warps, num_stages=stages)
    return out
