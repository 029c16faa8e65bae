"""Pruning: zero a fraction of every decoder projection's weights, chosen by a score, in a pattern
(the structured methods, which remove layers, MLP channels or query heads, are in structured.py).

    model (nn.Linear projections, dense)
      -> [calibration windows -> each layer's inputs, layer by layer]      wanda, sparsegpt
      -> per projection: a keep-mask from the method's score, in the pattern
      -> the weight times the mask (sparsegpt also updates the weights it keeps)

Methods:
- magnitude: score |W_ij|, compared within each output row.
- wanda (Sun et al., 2023, arXiv 2306.11695): score |W_ij| * ||X_j||_2, the weight times the norm
  of its input column over the calibration tokens, compared within each output row; no update.
  A few input channels of an LLM carry much larger activations than the rest, and their weights
  matter accordingly even when small.
- sparsegpt (Frantar & Alistarh, 2023, arXiv 2301.00774): GPTQ's column loop with "round to the
  grid" replaced by "zero it": columns are visited in order, each pruned weight's error pushed onto
  the columns not yet visited through the inverse Hessian H = 2 X^T X / tokens (the machinery is
  quant/gptq.py's). The mask is chosen block by block of 128 columns from w^2 / [H^-1]_jj^2 (the
  OBS error of removing w), over the whole block at once (unstructured) or per group of M columns
  and row (N:M), from the weights as updated so far.

Patterns: "unstructured" (a `sparsity` fraction of each row's weights; SparseGPT's of each block),
or "N:M" (N kept in every M consecutive weights of a row: "2:4" is what NVIDIA's sparse tensor cores
read since Ampere, "4:8" a looser variant; both 50%).

Calibration is GPTQ's: the same windows of the calibration text, run through the decoder one layer
at a time with the layers before already pruned, and within a layer each projection captured after
the ones before it were pruned. The weights stay dense tensors holding zeros: `sparsity_report`
counts them and `storage_bytes` gives what a compressed form would take.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from workbench.config.pruning import CALIBRATED, MASKED, METHODS, PruneConfig  # noqa: F401 (the methods' names)
from workbench.models.llama import LlamaModel
from workbench.layers.formats import INT4_MAX, Int4Weight, check_group_size, int4_codes, pack_int4
from workbench.quant.gptq import (ORDER, LayerwiseRunner, damped_hessian, get_module, hessian_accumulator,
                          single_thread, upper_inverse_factor)
from workbench.layers.linear import Int4Linear
from workbench.compress.masks import follows_pattern, keep_mask, squared_sums_accumulator, wanda_score
from workbench.compress import semi_structured, structured

@torch.no_grad()
def sparsegpt_prune_weight(weight: torch.Tensor, hessian: torch.Tensor, sparsity: float,
                           n_m: tuple[int, int] | None = None, block_size: int = 128,
                           percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(pruned fp32 weight, keep mask) of one (N, K) weight by SparseGPT, given the Hessian
    2 X^T X / tokens (K, K) of its inputs (see the module docstring)."""
    w, keep, _ = _sparsegpt(weight, hessian, sparsity, n_m, block_size, percdamp, None)
    return w, keep


@torch.no_grad()
def sparsegpt_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, sparsity: float,
                              n_m: tuple[int, int] | None = None, group_size: int = 128,
                              block_size: int = 128, percdamp: float = 0.01,
                              dtype: torch.dtype = torch.float32
                              ) -> tuple[Int4Weight, torch.Tensor]:
    """(INT4 group-wise weight, keep mask): SparseGPT pruning and GPTQ quantization in the same
    column loop (the paper's joint 50% + 4-bit mode, its Section 3.5): each column is masked, its
    kept weights rounded to the group's grid, and the whole error (pruning plus rounding) pushed
    onto the columns not yet visited. Each group's grid holds 0 exactly (zero_point_grid) with
    its scale and minimum stored in `dtype` (the engine's), so a pruned weight is stored as the
    group's zero code and dequantizes to exactly 0."""
    check_group_size(group_size)
    block_size = max(block_size, group_size)
    if block_size % group_size:
        raise ValueError(f"sparsegpt_block_size={block_size} is invalid with group_size="
                         f"{group_size}: it must be a multiple of it (a group's grid is read "
                         "from the weights as updated when its block starts)")
    w, keep, (scale, minimum) = _sparsegpt(weight, hessian, sparsity, n_m, block_size, percdamp,
                                           group_size, dtype)
    codes = int4_codes(w, scale, minimum, group_size)   # w is on the grid: its own codes
    return Int4Weight(pack_int4(codes), scale, minimum, group_size, w.shape[1]), keep


ZERO_POINTS = torch.tensor([0.0, 1.0, 2.0, 4.0, 8.0])   # z * scale is exact in any float format


def zero_point_grid(span: torch.Tensor, dtype: torch.dtype = torch.float32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minimum) per column of `span` (group, N): an INT4 grid covering [min(lo, 0),
    max(hi, 0)] on which 0 is code z exactly, once scale and minimum are stored in `dtype`: z is
    0 or a power of two (z * scale then rounds nowhere), the one needing the smallest step to
    reach both ends, the step is rounded up to a `dtype` value, and minimum = -z * scale. A
    symmetric group takes z = 8 and a step 15/14 of the free grid's."""
    lo, hi = span.amin(dim=0).clamp(max=0), span.amax(dim=0).clamp(min=0)
    # the step each zero point needs to reach both ends (z = 0 only when nothing is negative)
    need = torch.maximum(-lo[:, None] / ZERO_POINTS.clamp(min=1),
                         hi[:, None] / (INT4_MAX - ZERO_POINTS))
    need[:, 0] = torch.where(lo < 0, torch.inf, need[:, 0])
    scale, pick = need.min(dim=1)
    z = ZERO_POINTS[pick]
    scale = scale.clamp(min=1e-12)
    stored = scale.to(dtype).float()
    scale = torch.where(stored < scale, torch.nextafter(stored.to(dtype), torch.tensor(
        float("inf"), dtype=dtype)).float(), stored)
    return scale, -z * scale


def _sparsegpt(weight, hessian, sparsity, n_m, block_size, percdamp, group_size,
               dtype=torch.float32):
    """The column loop of SparseGPT, and with a group size also GPTQ's rounding (see above):
    (weight, keep mask, (scale, minimum) per (row, group) or None)."""
    k = weight.shape[1]
    if n_m is not None and k % n_m[1]:          # before the Hessian's factorization, not after
        raise ValueError(f"pattern '{n_m[0]}:{n_m[1]}' needs in_features divisible by "
                         f"{n_m[1]}; this layer has {k}")
    w = weight.detach().float().clone()
    h, _ = damped_hessian(w, hessian, percdamp)
    hinv = upper_inverse_factor(h)
    wt = w.t().contiguous()                 # (K, N): a column of W is a contiguous row here
    keep = torch.ones_like(wt, dtype=torch.bool)
    grid = None
    if group_size:                          # groups start inside blocks: read updated weights
        groups = -(-k // group_size)
        grid = (torch.zeros(w.shape[0], groups), torch.zeros(w.shape[0], groups))
    with single_thread():
        for b1 in range(0, k, block_size):
            b2 = min(b1 + block_size, k)
            w1, hinv1 = wt[b1:b2].clone(), hinv[b1:b2, b1:b2]
            d = torch.diagonal(hinv1)
            keep1 = keep[b1:b2]
            if n_m is None:                  # the block's lowest OBS errors, all rows together
                score = w1.pow(2) / d[:, None].pow(2)
                drop = round(sparsity * score.numel())
                if drop:
                    keep1.view(-1)[score.view(-1).topk(drop, largest=False).indices] = False
            err1 = torch.zeros_like(w1)
            for i in range(b2 - b1):
                if n_m is not None and i % n_m[1] == 0:   # this group's mask, per row
                    n, m = n_m
                    score = w1[i:i + m].pow(2) / d[i:i + m, None].pow(2)
                    keep1[i:i + m].scatter_(0, score.topk(m - n, dim=0, largest=False).indices,
                                            False)
                q = w1[i] * keep1[i]
                if grid is not None:
                    col = b1 + i
                    if col % group_size == 0:
                        g = col // group_size
                        grid[0][:, g], grid[1][:, g] = zero_point_grid(w1[i:i + group_size], dtype)
                    s, lo = grid[0][:, col // group_size], grid[1][:, col // group_size]
                    q = torch.round((q - lo) / s).clamp_(0, INT4_MAX).mul_(s).add_(lo) * keep1[i]
                e = (w1[i] - q) / d[i]
                w1[i:].addr_(hinv1[i, i:], e, alpha=-1)  # compensate the block's columns
                w1[i] = q                                  # exact zeros where pruned
                err1[i] = e
            wt[b1:b2] = w1
            wt[b2:].addmm_(hinv[b1:b2, b2:].t(), err1, alpha=-1)   # ... and, lazily, the rest
    return wt.t().contiguous(), keep.t().contiguous(), grid


# ----------------------------------------------------------------------------- the model
def _set(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight.data.copy_(weight.to(linear.weight.dtype))


@torch.no_grad()
def prune_model(model: LlamaModel, cfg: PruneConfig,
                calibration: list[list[int]] | None = None,
                int4_group_size: int | None = None) -> None:
    """Prune every decoder projection of `model` in place by cfg.method (the LM head and the
    embedding are kept: the papers prune the decoder's linear layers); channels, layers and heads
    go to structured.py. With `int4_group_size` (sparsegpt only), prune and quantize to INT4 in
    one pass (sparsegpt_quantize_weight): the projections become Int4Linear layers."""
    if int4_group_size is not None and cfg.method != "sparsegpt":
        raise ValueError(f"pruning={cfg.method!r} does not quantize while pruning: only "
                         "'sparsegpt' walks the columns as GPTQ does")
    if cfg.method not in MASKED:
        structured.prune_structured(model, cfg.method, cfg.ratio, calibration)
        return
    n_m = cfg.n_m
    if cfg.method == "magnitude":
        for layer in model.layers:
            for path in ORDER:
                linear = get_module(layer, path)[2]
                w = linear.weight.float()
                _set(linear, w * keep_mask(w.abs(), cfg.sparsity, n_m))
        return
    if not calibration:
        raise ValueError(f"pruning={cfg.method!r} calibrates on text: pass calibration windows")
    runner = LayerwiseRunner(model, calibration)
    dtype = model.embed_tokens.weight.dtype
    for index, layer in enumerate(model.layers):
        quantized = {}
        for path in ORDER:
            linear = get_module(layer, path)[2]
            if cfg.method == "wanda":
                sums, add = squared_sums_accumulator(linear.in_features)
                runner.run(index, {linear: add}, stop_after=linear)
                w = linear.weight.float()
                _set(linear, w * keep_mask(wanda_score(w, sums), cfg.sparsity, n_m))
            else:
                h, add = hessian_accumulator(linear.in_features)
                runner.run(index, {linear: add}, stop_after=linear)
                h.mul_(2 / runner.num_tokens)
                if int4_group_size is None:
                    pruned, _ = sparsegpt_prune_weight(linear.weight, h, cfg.sparsity, n_m,
                                                       cfg.sparsegpt_block_size,
                                                       cfg.sparsegpt_percdamp)
                else:      # the later passes see the quantized layer's arithmetic, as in GPTQ
                    quantized[path], _ = sparsegpt_quantize_weight(
                        linear.weight, h, cfg.sparsity, n_m, int4_group_size,
                        cfg.sparsegpt_block_size, cfg.sparsegpt_percdamp, dtype)
                    pruned = quantized[path].dequantize()
                _set(linear, pruned)
        runner.run(index, advance=True)
        for path, weight in quantized.items():
            owner, attr, _ = get_module(layer, path)
            setattr(owner, attr, Int4Linear(weight, dtype))


# ----------------------------------------------------------------------------- what it saves
def sparsity_report(model: LlamaModel) -> dict[str, float]:
    """Fraction of exact zeros in each decoder projection ('layers.3.mlp.down_proj': 0.5),
    quantized ones as they dequantize."""
    out = {}
    for i, layer in enumerate(model.layers):
        for path in ORDER:
            m = get_module(layer, path)[2]
            w = m.dequantize(torch.float32) if hasattr(m, "dequantize") else semi_structured.dense_weight(m.weight)
            out[f"layers.{i}.{path}"] = (w == 0).float().mean().item()
    return out


def storage_bytes(weight: torch.Tensor, pattern: str = "unstructured") -> dict[str, int]:
    """Bytes of one weight matrix stored dense and in compressed forms, for its actual zeros:
    - 'bitmask': the nonzero values plus one bit per weight;
    - 'csr': the nonzero values, a 4-byte column index each and a 4-byte offset per row + 1;
    - for pattern 'N:M' also 'n_m': N values per group of M plus ceil(log2 M) bits of position each
      (2:4: the values and 2-bit indices NVIDIA's sparse tensor cores read; a group with more than
      N nonzeros cannot be stored so, and raises)."""
    rows, k = weight.shape
    elem = weight.element_size()
    nnz = int((weight != 0).sum())
    out = {"dense": weight.numel() * elem, "bitmask": nnz * elem + math.ceil(weight.numel() / 8),
           "csr": nnz * (elem + 4) + 4 * (rows + 1)}
    if pattern != "unstructured":
        n, m = map(int, pattern.split(":"))
        if not follows_pattern(weight, pattern):
            raise ValueError(f"this weight does not follow pattern {pattern!r}: some group of {m} "
                             f"holds more than {n} nonzeros (or {k} columns are not groups of {m})")
        kept = weight.numel() // m * n
        out["n_m"] = kept * elem + math.ceil(kept * math.ceil(math.log2(m)) / 8)
    return out
