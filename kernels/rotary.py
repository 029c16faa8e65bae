"""Rotary position embedding applied in place to queries and keys, one program per token.

Each pair (x_i, x_{i + D/2}) of every head is turned by angle position * inv_freq_i. The kernel
reads the token's cos/sin row once and applies it to all of its query and key heads, in place, so
q and k can stay views of the fused QKV projection's output (no copies).

The arithmetic is the model's (transformers' rotate-half form, in the tensor's dtype: tables cast
to it, each product rounded, then the sum), so switching to this kernel changes no bit in bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, row, stride_t, stride_h, num_heads, c, s, offs_h, offs_d, HALF: tl.constexpr):
    ptrs = X + row * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    ok = offs_h[:, None] < num_heads
    x1 = tl.load(ptrs, mask=ok, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=ok, other=0.0)
    dtype = X.dtype.element_ty
    a1 = (x1.to(tl.float32) * c).to(dtype)         # x * cos, rounded like the reference
    b1 = (-x2.to(tl.float32) * s).to(dtype)        # rotate_half(x) * sin, first half: -x2 * sin
    a2 = (x2.to(tl.float32) * c).to(dtype)
    b2 = (x1.to(tl.float32) * s).to(dtype)
    tl.store(ptrs, (a1.to(tl.float32) + b1.to(tl.float32)).to(dtype), mask=ok)
    tl.store(ptrs + HALF, (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _rotary(Q, K, positions, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
            num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.load(positions + row)
    offs_d = tl.arange(0, HALF)
    offs_h = tl.arange(0, BLOCK_H)
    dtype = Q.dtype.element_ty
    # The tables are fp32; the reference casts them to the model's dtype first.
    c = tl.load(Cos + pos * stride_c + offs_d).to(dtype).to(tl.float32)[None, :]
    s = tl.load(Sin + pos * stride_c + offs_d).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(Q, row, stride_qt, stride_qh, num_q_heads, c, s, offs_h, offs_d, HALF)
    _rotate_heads(K, row, stride_kt, stride_kh, num_k_heads, c, s, offs_h, offs_d, HALF)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, KVH, D) in place at `positions` (T,); cos/sin are fp32 tables
    (max_positions, D) with equal halves. q and k may be strided views (last dim contiguous)."""
    tokens, q_heads, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or positions.shape != (tokens,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions "
                         f"{tuple(positions.shape)} disagree on tokens or head_dim")
    if head_dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("head_dim must be even and the last dimension of q, k, cos contiguous")
    if tokens == 0:
        return q, k
    block_h = triton.next_power_of_2(max(q_heads, k.shape[1]))
    _rotary[(tokens,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                       k.stride(1), cos.stride(0), q_heads, k.shape[1],
                       HALF=head_dim // 2, BLOCK_H=block_h, num_warps=4)
    return q, k
