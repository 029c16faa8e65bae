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
from ..quant.gptq import (ORDER, LayerwiseRunner, damped_hessian, get_module, hessian_accumulator,
                          single_thread, upper_inverse_factor)

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
    k = weight.shape[1]
    if n_m is not None and k % n_m[1]:          # before the Hessian's factorization, not after
        raise ValueError(f"pattern '{n_m[0]}:{n_m[1]}' needs in_features divisible by "
                         f"{n_m[1]}; this layer has {k}")
    w = weight.detach().float().clone()
    h, _ = damped_hessian(w, hessian, percdamp)
    hinv = upper_inverse_factor(h)
    wt = w.t().contiguous()                 # (K, N): a column of W is a contiguous row here
    keep = torch.ones_like(wt, dtype=torch.bool)
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
                e = (w1[i] - q) / d[i]
                w1[i:].addr_(hinv1[i, i:], e, alpha=-1)  # compensate the block's columns
                w1[i] = q                                  # exact zeros where pruned
                err1[i] = e
            wt[b1:b2] = w1
            wt[b2:].addmm_(hinv[b1:b2, b2:].t(), err1, alpha=-1)   # ... and, lazily, the rest
    return wt.t().contiguous(), keep.t().contiguous()


# ----------------------------------------------------------------------------- the model
def _set(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight.data.copy_(weight.to(linear.weight.dtype))


@torch.no_grad()
def prune_model(model: LlamaModel, cfg: PruneConfig,
                calibration: list[list[int]] | None = None) -> None:
    """Prune every decoder projection of `model` in place by cfg.method (the LM head and the
    embedding are kept: the papers prune the decoder's linear layers); channels, layers and heads
    go to structured.py."""
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
    for index, layer in enumerate(model.layers):
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
                pruned, _ = sparsegpt_prune_weight(linear.weight, h, cfg.sparsity, n_m,
                                                   cfg.sparsegpt_block_size,
                                                   cfg.sparsegpt_percdamp)
                _set(linear, pruned)
        runner.run(index, advance=True)


# ----------------------------------------------------------------------------- what it saves
def sparsity_report(model: LlamaModel) -> dict[str, float]:
    """Fraction of exact zeros in each decoder projection ('layers.3.mlp.down_proj': 0.5)."""
    out = {}
    for i, layer in enumerate(model.layers):
        for path in ORDER:
            w = get_module(layer, path)[2].weight
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
        if k % m or int((weight != 0).reshape(rows, k // m, m).sum(-1).max()) > n:
            raise ValueError(f"this weight does not follow pattern {pattern!r}: some group of {m} "
                             f"holds more than {n} nonzeros (or {k} columns are not groups of {m})")
        kept = weight.numel() // m * n
        out["n_m"] = kept * elem + math.ceil(kept * math.ceil(math.log2(m)) / 8)
    return out
