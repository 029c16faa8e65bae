"""Fused residual add + RMSNorm: one read of x and the residual, one write of each result.

Unfused, a decoder layer does `h = x + residual` (read 2, write 1) and then RMSNorm (read 1, square,
mean, read again to scale, write 1): at batch 1 these are pure memory traffic between the matmuls.
Fused, each row is loaded once into registers, summed, normalized and stored.

Arithmetic follows the model's reference (kernels/reference.py): the sum is rounded to the tensor's
dtype (it is the residual stream the next layer adds to), the norm is computed in fp32 on that
rounded sum, cast back, then multiplied by the weight in the tensor's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(X, Residual, W, Out, stride_x, stride_r, stride_o, n_cols, eps,
              BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Residual + row * stride_r + cols, x, mask=ok)   # the new residual stream
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * inv_rms).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension of x (rows, hidden). With `residual` (same shape), computes
    x + residual first, writes that sum into `residual` in place, and returns (normed, residual)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight has {weight.shape[0]} elements but x's last dimension is "
                         f"{x.shape[-1]}")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError(f"residual must be contiguous with x's shape {tuple(x.shape)}, got "
                             f"{tuple(residual.shape)}")
        res_rows = residual.view(-1, x.shape[-1])
    else:
        res_rows = rows
    block = triton.next_power_of_2(rows.shape[1])
    _rms_norm[(rows.shape[0],)](
        rows, res_rows, weight, out, rows.stride(0), res_rows.stride(0), out.stride(0),
        rows.shape[1], eps, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)))
    out = out.view(x.shape)
    return out if residual is None else (out, residual)
