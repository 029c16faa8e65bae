"""Dequantize-and-multiply: y = x @ dequant(W)^T with INT8 or INT4 weights, for CUDA.

At decode batch sizes a linear layer is a matrix-vector product bound by reading the weights, so
the win of 8 or 4 bits is bytes: the kernel loads the packed weight tile, expands it to the
activation dtype in registers (never in memory), and feeds the tensor cores.

- INT8, per output channel: tile of codes -> bf16 (exact for |q| <= 127), dot, and the per-column
  scale applied once to the accumulator at the end (scale[n] is constant along k).
- INT4, group-wise asymmetric: a tile of BLOCK_K // 2 bytes per row holds BLOCK_K codes (low nibble
  = even k, high nibble = odd k); each is expanded as q * scale[n, g] + minimum[n, g] where
  g = k // group_size. BLOCK_K divides group_size, so one tile sits in one group.
The references are in workbench/layers/formats.py (Int8Weight/Int4Weight.dequantize) + F.linear.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_attention import _dot, _precision


@triton.jit
def _int8_matmul(X, W, Scale, Out, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :],
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(W + offs_n[:, None] * stride_wn + k[None, :],
                    mask=(offs_n[:, None] < N) & (k[None, :] < K), other=0)
        # via fp32: exact for int8 codes, and Triton's CPU interpreter mis-converts int8 -> bf16
        acc += _dot(x, tl.trans(w.to(tl.float32).to(x.dtype)), PRECISION)
    scale = tl.load(Scale + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _int4_matmul(X, Packed, Scale, Minimum, Out, M, N, K, stride_xm, stride_pn, stride_sn,
                 stride_om, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_K // 2)              # bytes of one tile row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    n_ok = offs_n < N
    for k0 in range(0, K, BLOCK_K):                  # K is padded to whole groups
        byte = tl.load(Packed + offs_n[:, None] * stride_pn + k0 // 2 + offs_b[None, :],
                       mask=n_ok[:, None], other=0)
        low = (byte & 0xF).to(tl.float32)
        high = (byte >> 4).to(tl.float32)
        codes = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))   # k = 2b, 2b + 1 interleaved
        g = k0 // GROUP
        scale = tl.load(Scale + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        minimum = tl.load(Minimum + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        x = tl.load(X + offs_m[:, None] * stride_xm + k0 + tl.arange(0, BLOCK_K)[None, :],
                    mask=offs_m[:, None] < M, other=0.0)
        w = (codes * scale[:, None] + minimum[:, None]).to(x.dtype)
        acc += _dot(x, tl.trans(w), PRECISION)
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < M) & n_ok[None, :])


def _blocks(m: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). Decode has m of 1 to a few dozen: 16 rows (the
    smallest tensor-core tile) and 64-wide N tiles, so there are enough programs to read all the
    weights; larger m over 8 warps (4 would spill, python -m workbench.kernels.compile_check)."""
    if device.type != "cuda":
        return 16, 16, 32, 4
    return (16, 64, 64, 4) if m <= 16 else (64, 64, 64, 8)


def int8_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16/fp16/fp32, qweight (N, K) int8, scale (N,): x @ (qweight * scale)^T."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k:
        raise ValueError(f"x has {k} input features but the weight has {qweight.shape[1]}")
    x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm, bn, bk, warps = _blocks(m, x.device)
    _int8_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, qweight, scale, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x), num_warps=warps)
    return out


def int4_weight_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       minimum: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (M, K_padded), packed (N, K_padded // 2) uint8, scale/minimum (N, K_padded // group)."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k or k % group_size:
        raise ValueError(f"x has {k} input features; the packed weight holds "
                         f"{packed.shape[1] * 2} in groups of {group_size}")
    x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm, bn, bk, warps = _blocks(m, x.device)
    bk = min(bk, group_size)
    _int4_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, packed, scale, minimum, out, m, n, k, x.stride(0), packed.stride(0), scale.stride(0),
        out.stride(0), GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=_precision(x), num_warps=warps)
    return out
