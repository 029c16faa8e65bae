"""AWQ (Lin et al., 2023, arXiv 2306.00978): activation-aware INT4 weights by per-channel scaling.

Not all weights matter equally: a weight column that multiplies a large activation channel moves
the output more when rounded. AWQ protects those columns without mixed precision: it multiplies
column j of W by s_j > 1 before quantizing (its rounding error, relative to the column, shrinks)
and divides the activation channel by s_j, folded into the op before (smoothquant.py has the
folding rules, shared with SmoothQuant). The scales come from the mean activation magnitude s_x,
raised to a power alpha searched on a grid over [0, 1] (21 points) for each projection:

    s = s_x^alpha / sqrt(max * min)        minimizing  || X W^T - X (Q(W diag(s)) diag(s)^-1)^T ||^2

on the layer's captured calibration inputs X. alpha = 0 is round-to-nearest, so on calibration
data the search can only improve on it. Choices here:

- The loss is each projection's own output, the paper's formulation above, on at most 512
  calibration tokens (evenly spaced; s_x uses all of them), multiplied in the model's dtype. The
  reference code measures the whole attention block or MLP instead.
- q, k and v share input_layernorm, so they share one scale vector, searched on the fused qkv_proj.
- o_proj is scaled too: its input channel (query head h, dim d) is v channel (h // 3, d) on
  SmolLM2, so s is made equal across the query heads of each kv group (s_x averaged over them)
  and folded into the v rows. The reference implementations skip o_proj under GQA;
  `awq_o_proj=False` does the same (o_proj then plain RTN). On SmolLM2 the two
  give about the same mean KL (`python -m workbench.bench quant --methods awq` measures AWQ's).
- Weight clipping (the paper's second step) is on: after scaling, each (row, group) may shrink its
  range to [max(lo, -r m), min(hi, r m)] with m = max |w| and r in 1, 0.95, ..., 0.55, whichever
  gives the smallest output error of that group, e H_g e^T with H_g the group's block of the
  inputs' X^T X (exact, and cheaper than recomputing outputs). q and k rows are not clipped (as in
  the reference: their errors are amplified by the attention logits). It matters here: without it
  (`awq_clip=False`) mean KL was 0.21 instead of 0.15.
- Calibration runs layer by layer (gptq.LayerwiseRunner): layer i is fitted on the outputs of
  layers 0..i-1 already quantized, i.e. on the inputs it will see at run time (the reference feeds
  the next block with the scaled but unquantized block instead).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.models.llama import LlamaModel
from workbench.layers.formats import INT4_MAX, Int4Weight, int4_codes, pack_int4, pad_to_groups, quantize_int4
from workbench.quant.gptq import LayerwiseRunner, get_module
from workbench.layers.linear import Int4Linear
from workbench.quant.smoothquant import LayerWeights, fold_scales, gqa_shared

PATHS = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
         "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}
MAX_SEARCH_TOKENS = 512   # calibration tokens (evenly spaced) the alpha search measures on


def int4_residual(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w - dequantize(quantize_int4(w)) for w (N, K) fp32, without packing: the rounding error
    of round-to-nearest on the group-wise grid (formats.int4_params / int4_codes arithmetic).
    Returns (N, K padded to whole groups); padded columns hold the error of a zero weight."""
    n = w.shape[0]
    g = pad_to_groups(w, group_size).view(n, -1, group_size)
    # amin and amax, not aminmax, whose CPU kernel is far slower here (time both with
    # `python -m timeit -s "import torch; g = torch.randn(3072, 5, 128)" "g.aminmax(dim=-1)"`)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / INT4_MAX).clamp(min=1e-12)[..., None]
    t = g - lo[..., None]
    t -= torch.round(t / scale).clamp_(0, INT4_MAX).mul_(scale)
    return t.view(n, -1)


@dataclass
class ScaleSearch:
    """The outcome of AWQ's grid search for one projection."""

    scale: torch.Tensor      # (K,) the chosen s
    alpha: float
    alphas: list[float]
    errors: list[float]      # mean squared output error per output element, per alpha


def search_scale(weight: torch.Tensor, x: torch.Tensor, x_mag: torch.Tensor, group_size: int,
                 n_grid: int = 20, share=None, rows_per_chunk: int = 256) -> ScaleSearch:
    """AWQ's grid search: weight (N, K), x (T, K) calibration inputs, x_mag (K,) mean |x| per
    channel; `share`, if given, maps a scale vector to one that can be folded (GQA). The weights
    are scaled and quantized in fp32; the output error X (W - Q)^T is multiplied in x's dtype
    (the model's: bf16 matmuls are several times faster than fp32 ones on CPUs with AMX, as
    `python -m timeit -s "import torch; w = torch.randn(2048, 2048, dtype=torch.bfloat16)" "w @ w"`
    and the same with torch.float32 show, and the error is what the layer computes in that
    dtype)."""
    k = weight.shape[1]
    # Padded once to whole groups (zero weights, zero inputs, unit scales), so that the loop
    # below does not pad on every trial.
    w = pad_to_groups(weight.float(), group_size)
    x = pad_to_groups(x, group_size)
    pad = w.shape[1] - k
    base = x_mag.float().clamp(min=1e-4)
    if share is not None:
        base = share(base)
    alphas, errors = [], []
    best = (float("inf"), None, None)
    for i in range(n_grid + 1):
        alpha = i / n_grid
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        sp = torch.nn.functional.pad(s, (0, pad), value=1.0)
        # X (W - Q(W s) / s)^T = (X / s) (W s - Q(W s))^T: divide the (small) inputs, not W.
        xs = (x.float() / sp).to(x.dtype)
        err = 0.0
        for r0 in range(0, w.shape[0], rows_per_chunk):   # chunks of rows stay in cache
            e = int4_residual(w[r0:r0 + rows_per_chunk] * sp, group_size).to(x.dtype)
            err += torch.linalg.vector_norm(xs @ e.t(), dtype=torch.float32).item() ** 2
        err /= x.shape[0] * w.shape[0]
        alphas.append(alpha)
        errors.append(err)
        if err < best[0]:
            best = (err, alpha, s)
    return ScaleSearch(best[2], best[1], alphas, errors)


def clip_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int,
                  clip_rows: torch.Tensor | None = None, n_grid: int = 20,
                  max_shrink: float = 0.5, rows_per_chunk: int = 512) -> Int4Weight:
    """INT4 group-wise with a per-(row, group) clipped range, chosen to minimize that group's
    output error e H_g e^T (H_g: the group's diagonal block of X^T X). Rows where `clip_rows`
    is False keep the full range."""
    w = weight.float()
    n, k = w.shape
    wp = pad_to_groups(w, group_size).view(n, -1, group_size)      # (N, G, g)
    groups = wp.shape[1]
    hp = torch.zeros(groups * group_size, groups * group_size, dtype=torch.float32)
    hp[:k, :k] = hessian.float()
    hg = torch.stack([hp[g * group_size:(g + 1) * group_size, g * group_size:(g + 1) * group_size]
                      for g in range(groups)])                        # (G, g, g)
    lo0, hi0 = wp.amin(dim=-1), wp.amax(dim=-1)
    m = wp.abs().amax(dim=-1)
    best_lo, best_hi = lo0.clone(), hi0.clone()
    # Rows go in small chunks so that each chunk's trials stay in cache: the search is many
    # elementwise passes over the same weights, bound by memory bandwidth otherwise.
    for r0 in range(0, n, rows_per_chunk):
        rows = slice(r0, r0 + rows_per_chunk)
        wc, l0, h0, mc = wp[rows], lo0[rows], hi0[rows], m[rows]
        best_err = None
        for i in range(int(max_shrink * n_grid)):
            r = 1 - i / n_grid
            lo, hi = torch.maximum(l0, -r * mc), torch.minimum(h0, r * mc)
            scale = ((hi - lo) / INT4_MAX).clamp(min=1e-12)[..., None]
            t = wc - lo[..., None]
            e = t - torch.round(t / scale).clamp_(0, INT4_MAX).mul_(scale)   # w - dequant(w)
            eg = e.transpose(0, 1)                                            # (G, rows, g)
            err = (torch.bmm(eg, hg) * eg).sum(-1).t()                        # e H_g e^T
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            if clip_rows is not None:
                better &= clip_rows[rows, None]
            best_err = torch.where(better, err, best_err)
            best_lo[rows] = torch.where(better, lo, best_lo[rows])
            best_hi[rows] = torch.where(better, hi, best_hi[rows])
    scale = ((best_hi - best_lo) / INT4_MAX).clamp(min=1e-12)
    codes = int4_codes(w, scale, best_lo, group_size)
    return Int4Weight(pack_int4(codes), scale, best_lo, group_size, k)


def awq_layer(layer, inputs: dict[str, torch.Tensor], args, group_size: int, n_grid: int = 20,
              clip: bool = True, max_tokens: int = MAX_SEARCH_TOKENS,
              targets=tuple(PATHS)) -> tuple[dict[str, Int4Weight], dict[str, ScaleSearch]]:
    """AWQ on one decoder layer, given each projection's captured inputs (tokens, K): searches
    and folds the scales (the norms are written into `layer`; the projections are left alone)
    and returns the quantized weights by projection path, and each search's outcome."""
    step = max(1, next(iter(inputs.values())).shape[0] // max_tokens)
    w = LayerWeights.from_layer(layer)
    searches = {}
    for t in targets:
        x = inputs[t]
        share = (lambda s: gqa_shared(s, args, "mean")) if t == "o_proj" else None
        searches[t] = search_scale(getattr(w, t), x[::step], x.float().abs().mean(dim=0),
                                   group_size, n_grid, share)
        fold_scales(w, t, searches[t].scale, args)
    w.write_norms(layer)
    v_start = w.o_proj.shape[1] + args.num_key_value_heads * args.head_dim   # this layer's heads
    quantized = {}
    for t, path in PATHS.items():
        weight = getattr(w, t)
        if not clip:
            quantized[path] = quantize_int4(weight, group_size)
            continue
        x = inputs[t].float()
        if t in searches:
            x = x / searches[t].scale      # the input the scaled weight will see
        rows = torch.arange(weight.shape[0]) >= v_start if t == "qkv_proj" else None
        quantized[path] = clip_quantize(weight, x.t() @ x, group_size, rows)
    return quantized, searches


@torch.no_grad()
def quantize_awq(model: LlamaModel, cfg, calibration: list[list[int]]) -> None:
    """Replace every decoder projection of `model` by an Int4Linear fitted by AWQ on the
    calibration windows (see the module docstring). Options (QuantConfig): awq_grid, awq_clip,
    awq_max_tokens, awq_o_proj (False: o_proj is plain round-to-nearest)."""
    dtype = model.embed_tokens.weight.dtype
    targets = tuple(t for t in PATHS if t != "o_proj" or cfg.awq_o_proj)
    runner = LayerwiseRunner(model, calibration)
    for index, layer in enumerate(model.layers):
        captured: dict[str, list[torch.Tensor]] = {t: [] for t in PATHS}
        runner.run(index, {get_module(layer, path)[2]: captured[t].append
                           for t, path in PATHS.items()})
        quantized, _ = awq_layer(
            layer, {t: torch.cat(xs) for t, xs in captured.items()}, model.args, cfg.group_size,
            n_grid=cfg.awq_grid, clip=cfg.awq_clip, max_tokens=cfg.awq_max_tokens, targets=targets)
        for path, weight in quantized.items():   # the next layer's inputs come through the
            get_module(layer, path)[2].weight.copy_(weight.dequantize())   # quantized weights
        runner.run(index, advance=True)
        for path, weight in quantized.items():
            owner, attr, _ = get_module(layer, path)
            setattr(owner, attr, Int4Linear(weight, dtype))
