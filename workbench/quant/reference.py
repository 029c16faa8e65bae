"""Reference quantizers and error measures on plain tensors, for lessons and labs.

    from workbench.quant.reference import fake_quantize, relative_error
    err = relative_error(w, fake_quantize(w, bits=4, group_size=128))

The engine's formats (formats.py) are fixed at 8 and 4 bits; these take any bit width, group size
and group offset (so that a slider can move them), list every value a format can hold, simulate
the W8A8 product of a layer, and measure errors.
"""
from __future__ import annotations

import torch

from workbench.layers.formats import quantize_int8
from workbench.layers.linear import quantize_activations_int8


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||approx - reference|| / ||reference|| (Frobenius norms, fp32)."""
    reference, approx = reference.float(), approx.float()
    return ((approx - reference).norm() / reference.norm().clamp(min=1e-30)).item()


def fake_quantize(w: torch.Tensor, bits: int = 4, group_size: int | None = 128,
                  offset: int = 0) -> torch.Tensor:
    """w (N, K) rounded to nearest on an asymmetric grid of 2**bits levels per group, back in fp32.

    Each group of `group_size` consecutive weights of a row gets its own grid from its minimum to
    its maximum (the engine's INT4 rule, formats.int4_params, at any bit width). `group_size=None`
    makes one group of the whole row. With `offset`, the first group holds only the first `offset`
    columns, so every later group starts `offset` columns later than with offset 0 (a grid that is
    misaligned with the blocks a weight came from). A ragged last group is as long as what is left.
    """
    w = w.float()
    n, k = w.shape
    g = k if group_size is None else group_size
    if bits < 1 or g < 1 or not 0 <= offset < g:
        raise ValueError(f"bits={bits}, group_size={group_size}, offset={offset} is invalid: "
                         "bits and group_size must be >= 1 and 0 <= offset < group_size")
    levels = 2 ** bits - 1
    out = torch.empty_like(w)
    starts = list(range(0, k, g)) if offset == 0 else [0] + list(range(offset, k, g))
    bounds = [(a, min(b, k)) for a, b in zip(starts, starts[1:] + [k])]
    # Groups of the same length are done together (all but the first and last, usually).
    by_len: dict[int, list[int]] = {}
    for a, b in bounds:
        by_len.setdefault(b - a, []).append(a)
    for length, firsts in by_len.items():
        idx = torch.tensor(firsts)[:, None] + torch.arange(length)[None, :]   # (groups, length)
        grp = w[:, idx]                                                      # (N, groups, length)
        lo, hi = grp.amin(-1, keepdim=True), grp.amax(-1, keepdim=True)
        scale = ((hi - lo) / levels).clamp(min=1e-12)
        q = torch.round((grp - lo) / scale).clamp(0, levels)
        out[:, idx] = q * scale + lo
    return out


def e4m3_values() -> torch.Tensor:
    """Every finite value of FP8 e4m3 (torch.float8_e4m3fn), sorted, fp32: 253 numbers, +-448."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    return torch.unique(vals[torch.isfinite(vals)])


def bf16_values(lo: float, hi: float) -> torch.Tensor:
    """Every bf16 value in [lo, hi], sorted, fp32 (bf16 has 65,536 bit patterns: all are tried)."""
    vals = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = vals.float()
    vals = vals[torch.isfinite(vals) & (vals >= lo) & (vals <= hi)]
    return torch.unique(vals)


def round_e4m3_per_row(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) stored as FP8 e4m3 with one fp32 scale per row (max |w| of the row -> 448)."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def w8a8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ w (N, K)^T as SmoothQuant's layer computes it: INT8 activations with a scale per
    token, INT8 weights with a scale per output channel, integer products (exact in fp32 here)."""
    xq, xs = quantize_activations_int8(x)
    wq = quantize_int8(w)
    return (xq.float() @ wq.qweight.float().t()) * xs * wq.scale[None, :]


def peak_ratio(magnitudes: torch.Tensor) -> float:
    """max / median of per-channel magnitudes: how far the largest channel stands out."""
    m = magnitudes.float()
    return (m.max() / m.median().clamp(min=1e-30)).item()


def column_error(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(K,) RMS over rows of q - w, per input column."""
    return (q.float() - w.float()).pow(2).mean(dim=0).sqrt()
