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
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..models.llama import LlamaModel
from ..quant.formats import INT4_MAX, Int4Weight, check_group_size, int4_codes, pack_int4
from ..quant.gptq import (ORDER, LayerwiseRunner, damped_hessian, get_module, hessian_accumulator,
                          single_thread, upper_inverse_factor)
from ..quant.linear import Int4Linear

METHODS = ("magnitude", "wanda", "sparsegpt", "channels", "layers", "heads")  # last 3: structured
CALIBRATED = ("wanda", "sparsegpt", "channels", "layers", "heads")
MASKED = ("magnitude", "wanda", "sparsegpt")


@dataclass
class PruneConfig:
    """Every option of every method; `pruning_config` sets any of them by name."""
    method: str
    sparsity: float = 0.5               # unstructured: the fraction zeroed; N:M: 1 - N/M
    pattern: str = "unstructured"       # or "N:M", such as "2:4"
    num_calibration_windows: int = 32   # wanda, sparsegpt
    calibration_window_len: int = 256
    sparsegpt_block_size: int = 128     # columns whose mask is chosen together
    sparsegpt_percdamp: float = 0.01    # damping added to H's diagonal, times its mean
    ratio: float = 0.25                 # channels, layers, heads: the fraction of them removed
    semi_structured: bool = False       # 2:4 only: run the projections on sparse tensor cores
                                        # (CUDA, compute capability >= 8.0; semi_structured.py)

    @property
    def n_m(self) -> tuple[int, int] | None:
        """(N, M) of an N:M pattern, None for unstructured."""
        if self.pattern == "unstructured":
            return None
        n, m = self.pattern.split(":")
        return int(n), int(m)

    @classmethod
    def from_args(cls, method, options: dict | None) -> "PruneConfig":
        if method not in METHODS:
            raise ValueError(f"pruning={method!r} is invalid: allowed are None, "
                             + ", ".join(repr(m) for m in METHODS))
        options = dict(options or {})
        known = set(cls.__dataclass_fields__) - {"method"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"pruning_config has unknown key(s) {unknown}: allowed are "
                             f"{sorted(known)}")
        wrong = sorted(set(options) & ({"sparsity", "pattern"} if method not in MASKED
                                       else {"ratio"}))
        if wrong:
            kind = "structured" if method not in MASKED else "mask"
            raise ValueError(f"pruning_config key(s) {wrong} do not apply to pruning={method!r}, "
                             f"a {kind} method: " + ("use 'ratio'" if kind == "structured" else
                                                     "use 'sparsity' and 'pattern'"))
        ratio = options.get("ratio", 0.25)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(f"pruning_config['ratio']={ratio!r} is invalid: it must be a number "
                             "in [0, 1), the fraction of layers, channels or query heads removed")
        pattern = options.get("pattern", "unstructured")
        match = re.fullmatch(r"(\d+):(\d+)", pattern) if isinstance(pattern, str) else None
        if pattern != "unstructured" and not (match and 0 < int(match[1]) < int(match[2]) <= 64):
            raise ValueError(f"pruning_config['pattern']={pattern!r} is invalid: allowed are "
                             "'unstructured' or 'N:M' with 0 < N < M <= 64, such as '2:4'")
        sparsity = options.get("sparsity", None)
        if sparsity is not None and (isinstance(sparsity, bool)
                                     or not isinstance(sparsity, (int, float))
                                     or not 0 <= sparsity < 1):
            raise ValueError(f"pruning_config['sparsity']={sparsity!r} is invalid: it must be a "
                             "number in [0, 1), the fraction of weights zeroed")
        if match:
            implied = 1 - int(match[1]) / int(match[2])
            if sparsity is not None and not math.isclose(sparsity, implied):
                raise ValueError(f"pruning_config['sparsity']={sparsity!r} contradicts pattern "
                                 f"{pattern!r}, which zeroes {implied:g}: leave sparsity out")
            options["sparsity"] = implied
        for key in ("num_calibration_windows", "calibration_window_len", "sparsegpt_block_size"):
            value = options.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"pruning_config[{key!r}]={value!r} is invalid: it must be a "
                                 "positive integer")
        damp = options.get("sparsegpt_percdamp", 0.01)
        if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp <= 1:
            raise ValueError(f"pruning_config['sparsegpt_percdamp']={damp!r} is invalid: it must "
                             "be a number in (0, 1]")
        semi = options.get("semi_structured", False)
        if not isinstance(semi, bool):
            raise ValueError(f"pruning_config['semi_structured']={semi!r} is invalid: it must be "
                             "True or False")
        if semi and (method not in MASKED or pattern != "2:4"):
            raise ValueError("pruning_config['semi_structured']=True is invalid with "
                             f"pruning={method!r} and pattern {pattern!r}: sparse tensor cores "
                             "read only the 2:4 pattern of a mask method ('pattern': '2:4')")
        cfg = cls(method=method, **options)
        if cfg.n_m is not None and cfg.sparsegpt_block_size % cfg.n_m[1]:
            raise ValueError(f"pruning_config['sparsegpt_block_size']={cfg.sparsegpt_block_size} "
                             f"is invalid with pattern {pattern!r}: it must be a multiple of "
                             f"{cfg.n_m[1]}")
        return cfg

    def describe(self) -> str:
        if self.method not in MASKED:
            return f"{self.method} {self.ratio:.0%}"
        amount = self.pattern if self.n_m else f"{self.sparsity:.0%} unstructured"
        return f"{self.method} {amount}"


# ----------------------------------------------------------------------------- masks
def keep_mask(score: torch.Tensor, sparsity: float, n_m: tuple[int, int] | None) -> torch.Tensor:
    """The (N, K) bool mask of weights kept: per row, the round(sparsity * K) lowest scores
    dropped (unstructured), or the N highest of every M consecutive scores kept (N:M)."""
    rows, k = score.shape
    if n_m is None:
        mask = torch.ones_like(score, dtype=torch.bool)
        drop = round(sparsity * k)
        if drop:
            mask.scatter_(1, score.topk(drop, dim=1, largest=False).indices, False)
        return mask
    n, m = n_m
    if k % m:
        raise ValueError(f"pattern '{n}:{m}' needs in_features divisible by {m}; this layer has "
                         f"{k}")
    groups = score.reshape(rows, k // m, m)
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(2, groups.topk(n, dim=2).indices, True)
    return mask.reshape(rows, k)


def wanda_score(weight: torch.Tensor, input_sq_sums: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2, from the per-column sums of squared inputs (K,)."""
    return weight.detach().float().abs() * input_sq_sums.float().sqrt()


def squared_sums_accumulator(k: int):
    """(sums, add): add(x) accumulates the column sums of x^2 of (tokens, K) inputs (float64)."""
    sums = torch.zeros(k, dtype=torch.float64)

    def add(x: torch.Tensor) -> None:
        sums.add_(x.float().pow(2).sum(0).double())
    return sums, add


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
        from .structured import prune_structured
        prune_structured(model, cfg.method, cfg.ratio, calibration)
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
    from .semi_structured import dense_weight      # it imports this module
    out = {}
    for i, layer in enumerate(model.layers):
        for path in ORDER:
            m = get_module(layer, path)[2]
            w = m.dequantize(torch.float32) if hasattr(m, "dequantize") else dense_weight(m.weight)
            out[f"layers.{i}.{path}"] = (w == 0).float().mean().item()
    return out


def follows_pattern(weight: torch.Tensor, pattern: str) -> bool:
    """Whether every group of M consecutive weights of every row of `weight` holds at most N
    nonzeros, for pattern 'N:M' (GPTQ after a mask, for one, fills the zeros in)."""
    n, m = map(int, pattern.split(":"))
    rows, k = weight.shape
    return k % m == 0 and int((weight != 0).reshape(rows, k // m, m).sum(-1).max()) <= n


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
