"""Mixed precision: each decoder projection gets its own format, chosen from measured
sensitivities to meet a bytes budget.

    calibration windows
      -> reference log-probs of the unquantized model
      -> sensitivity: each projection alone quantized to INT4 group 128, the mean KL(reference ||
         that model) it adds (one forward over the windows per projection)
      -> each projection's input second moments E[x_j^2] (forward hooks, one pass), and for every
         format f its output error proxy e_f = sum_j E[x_j^2] ||W[:, j] - Q_f(W)[:, j]||^2 and
         its bytes (the quantized layer's own buffers)
      -> predicted KL of projection p in format f: sensitivity_p * e_f / e_int4-g128 (the KL of a
         small perturbation grows with the output error's energy)
      -> the plan: every projection starts in its cheapest format; the upgrade with the largest
         predicted KL saved per extra byte is taken while the budget allows (greedy knapsack)
      -> every projection quantized by round-to-nearest in its planned format

The budget is bits per decoder-projection weight, scales included; by default the bytes uniform
INT4 at `group_size` takes, so mixed precision is compared with it at equal bytes. An explicit
`mixed_plan` ({projection name: format}) skips the search. Measured by
`python -m workbench.bench quant --methods int4 mixed` (results/README.md).
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.config.quant import MIXED_FORMATS
from workbench.layers.formats import quantize_int4, quantize_int8
from workbench.layers.linear import Int4Linear, Int8Linear
from workbench.models.llama import LlamaModel
from workbench.quant.forward import prefill_hidden, prefill_logprobs
from workbench.quant.metrics import kl_divergence
from workbench.quant.rtn import projections

FORMATS = MIXED_FORMATS       # name -> (method, group size), cheapest first
SENSITIVITY_FORMAT = "int4-g128"


def quantized(linear: nn.Module, fmt: str, dtype: torch.dtype) -> nn.Module:
    method, group = FORMATS[fmt]
    w = linear.weight.data
    if method == "int8":
        return Int8Linear(quantize_int8(w), dtype)
    return Int4Linear(quantize_int4(w, group), dtype)


def named_projections(model: LlamaModel) -> dict[str, tuple[nn.Module, str]]:
    """'layers.3.mlp.down_proj' -> (owner module, attribute)."""
    return {name: (owner, attr) for name, owner, attr, _ in projections(model)}


@torch.inference_mode()
def _logprobs(model: LlamaModel, windows) -> list[torch.Tensor]:
    return [prefill_logprobs(model, w) for w in windows]


@torch.inference_mode()
def sensitivities(model: LlamaModel, windows, fmt: str = SENSITIVITY_FORMAT) -> dict[str, float]:
    """Mean KL(unquantized || model with only projection p in `fmt`) per projection p."""
    dtype = model.embed_tokens.weight.dtype
    reference = _logprobs(model, windows)
    out = {}
    for name, (owner, attr) in named_projections(model).items():
        original = getattr(owner, attr)
        setattr(owner, attr, quantized(original, fmt, dtype))
        kl = [kl_divergence(r, c) for r, c in zip(reference, _logprobs(model, windows))]
        setattr(owner, attr, original)
        out[name] = torch.cat(kl).mean().item()
    return out


@torch.inference_mode()
def input_moments(model: LlamaModel, windows) -> dict[str, torch.Tensor]:
    """E[x_j^2] of every projection's input over the calibration tokens (float64)."""
    sums, count, hooks = {}, {"tokens": 0}, []
    for name, (owner, attr) in named_projections(model).items():
        def hook(module, args, _out, name=name):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
        hooks.append(getattr(owner, attr).register_forward_hook(hook))
    try:
        for w in windows:
            prefill_hidden(model, w)
            count["tokens"] += len(w)
    finally:
        for h in hooks:
            h.remove()
    return {name: s / count["tokens"] for name, s in sums.items()}


@torch.inference_mode()
def format_costs(model: LlamaModel, moments: dict, formats=tuple(FORMATS)) -> dict:
    """{projection: {format: (bytes, output error proxy)}}."""
    dtype = model.embed_tokens.weight.dtype
    costs = {}
    for name, (owner, attr) in named_projections(model).items():
        linear, row = getattr(owner, attr), {}
        w = linear.weight.data.float()
        for fmt in formats:
            q = quantized(linear, fmt, dtype)
            err = (w - q.dequantize(torch.float32)[:, :w.shape[1]]).pow(2).sum(0).double()
            row[fmt] = (q.weight_bytes(), float((err * moments[name]).sum()))
        costs[name] = row
    return costs


def plan(sens: dict[str, float], costs: dict, ref_err: dict[str, float],
         budget_bytes: float) -> dict[str, str]:
    """The greedy knapsack: cheapest format everywhere, then the best KL saved per extra byte.
    costs: {projection: {format: (bytes, error proxy)}}; ref_err: each projection's error proxy
    in the format its sensitivity was measured in."""
    def predicted(name, fmt):
        return sens[name] * costs[name][fmt][1] / ref_err[name] if ref_err[name] > 0 else 0.0

    choice = {n: min(costs[n], key=lambda f: costs[n][f][0]) for n in costs}
    spent = sum(costs[n][choice[n]][0] for n in costs)
    if spent > budget_bytes:
        raise ValueError(f"quantization_config['budget_bits'] is too small: the cheapest format of "
                         f"every projection already takes {spent} bytes, the budget is "
                         f"{int(budget_bytes)}")
    while True:
        best, best_gain = None, 0.0
        for n in costs:
            b0, kl0 = costs[n][choice[n]][0], predicted(n, choice[n])
            for fmt, (b, _) in costs[n].items():
                extra, saved = b - b0, kl0 - predicted(n, fmt)
                if extra > 0 and saved > 0 and spent + extra <= budget_bytes \
                        and saved / extra > best_gain:
                    best, best_gain = (n, fmt, extra), saved / extra
        if best is None:
            return choice
        choice[best[0]] = best[1]
        spent += best[2]


def projection_params(model: LlamaModel) -> int:
    return sum(getattr(o, a).weight.numel() for o, a in named_projections(model).values())


@torch.no_grad()
def quantize_mixed(model: LlamaModel, cfg, calibration) -> dict[str, str]:
    """Quantize every decoder projection in its planned format; returns the plan."""
    dtype = model.embed_tokens.weight.dtype
    names = named_projections(model)
    if cfg.mixed_plan:
        unknown = sorted(set(cfg.mixed_plan) - set(names))
        if unknown:
            raise ValueError(f"quantization_config['mixed_plan'] names unknown projection(s) "
                             f"{unknown[:3]}: names look like {next(iter(names))!r}")
        choice = {n: cfg.mixed_plan.get(n, SENSITIVITY_FORMAT) for n in names}
    else:
        if not calibration:
            raise ValueError("quantization='mixed' needs calibration windows")
        sens = sensitivities(model, calibration[:cfg.mixed_sensitivity_windows])
        costs = format_costs(model, input_moments(model, calibration),
                             dict.fromkeys((*cfg.mixed_formats, SENSITIVITY_FORMAT)))
        ref_err = {n: row[SENSITIVITY_FORMAT][1] for n, row in costs.items()}
        costs = {n: {f: c for f, c in row.items() if f in cfg.mixed_formats}
                 for n, row in costs.items()}
        if cfg.budget_bits is None:   # uniform INT4 at group_size
            fmt = f"int4-g{cfg.group_size}"
            budget = sum(quantized(getattr(o, a), fmt, dtype).weight_bytes() for o, a in names.values())
        else:
            budget = cfg.budget_bits * projection_params(model) / 8
        choice = plan(sens, costs, ref_err, budget)
    for name, (owner, attr) in names.items():
        setattr(owner, attr, quantized(getattr(owner, attr), choice[name], dtype))
    model.mixed_plan = choice
    return choice
