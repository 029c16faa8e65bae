"""SmoothQuant (Xiao et al., 2022, arXiv 2211.10438): W8A8 with the activations' outliers moved
into the weights.

Activations of LLMs have a few input channels (the same few in every token) whose values are tens
of times larger than the rest. Per-token INT8 then spends its 255 steps on those channels and
rounds everything else to a handful of levels. The weights have no such outliers. SmoothQuant
divides input channel j of X by s_j and multiplies column j of W by s_j, which leaves X W^T
unchanged, with

    s_j = max|X_j|^a / max|W_j|^(1 - a)        (a = cfg.smoothquant_alpha, 0.5 by default)

so that both sides end up with comparable ranges. The division costs nothing at run time: it is
folded into the op that produces X (the folding rules are shared with AWQ):

    qkv_proj      input = input_layernorm(h)           divide the norm's weight
    gate_up_proj  input = post_attention_layernorm(h)  divide the norm's weight
    down_proj     input = silu(gate) * up              divide the up rows of gate_up_proj
    o_proj        input = attention output             divide the v rows of qkv_proj: possible only
                                                       if s is the same for all query heads that
                                                       share a kv head (GQA), so s is computed per
                                                       kv channel from the max over those heads

All four are smoothed by default (`smoothquant_targets` picks a subset; the reference
implementation smooths only the two norm-fed projections of Llama). Every projection then becomes a
W8A8Linear: INT8 weights per output channel (quantize_int8) and INT8 activations per token (or
per tensor with a calibrated scale: static activation scales, below).
Statistics come from one pass of the unquantized model over the calibration windows.

On SmolLM2's held-out text, smoothing all four gives a lower mean KL than smoothing the two
norm-fed ones only, which beats no smoothing, and alpha 0.5 the lowest of 0.3 to 0.85
(`python -m workbench.bench quant --methods smoothquant` measures the default's KL, perplexity
and top-1; tests/test_quant_methods.py checks that smoothing beats none).

Static activation scales (`smoothquant_activations="static"`, the paper's O1-O3 settings and
TensorRT-LLM's): after folding, one more pass of the smoothed float model over the calibration
windows gives each projection the max |x| over every token and channel of its input, and its
W8A8Linear one fp32 `input_scale` = max / 127, used for every token (values beyond it saturate at
+-127). A step then skips the per-token max, but one scale must cover every token: on SmolLM2 the
maxima at down_proj of layers 11 and 28 (139 and 118; most projections' are 1-10) are
massive activations, which leave the other tokens few INT8 levels: static scales lose far more
quality than per-token ones for a small gain in decode speed. `python -m workbench.bench compress
--variants smoothquant smoothquant-static` measures both against the unquantized engine
(perplexity, mean KL, top-1, decode tok/s; results/README.md keeps the committed run).

Clipping at the 99.99th or 99.9th percentile of |x| instead of the max raises the mean KL further:
saturating the massive activations costs more than the resolution it buys the rest, so the
statistic is the max.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workbench.models.llama import LlamaArgs, LlamaModel
from workbench.quant.rtn import projections
from workbench.layers.formats import quantize_int8
from workbench.quant.forward import prefill_hidden
from workbench.layers.linear import W8A8Linear

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# ----------------------------------------------------------------------------- statistics
@torch.no_grad()
def collect_input_stats(model: LlamaModel, calibration: list[list[int]],
                        names: list[str] | None = None,
                        stat: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        ) -> dict[str, torch.Tensor]:
    """Per input channel, the max over calibration tokens of |x| at the input of each decoder
    projection (or of the projections in `names`, e.g. 'layers.3.mlp.down_proj'), from one
    prefill of the model per window. `stat(x)` replaces |x| (for example x.abs() summed)."""
    wanted = {name: linear for name, _, _, linear in projections(model)
              if names is None or name in names}
    if names is not None and len(wanted) != len(set(names)):
        known = [name for name, *_ in projections(model)][:4]
        missing = sorted(set(names) - set(wanted))
        raise ValueError(f"unknown projection name(s) {missing}: names look like {known}")
    stats: dict[str, torch.Tensor] = {}
    handles = []
    for name, linear in wanted.items():
        def hook(mod, inputs, name=name):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            value = x.abs().amax(dim=0) if stat is None else stat(x)
            stats[name] = value if name not in stats else torch.maximum(stats[name], value)
        handles.append(linear.register_forward_pre_hook(hook))
    try:
        for window in calibration:
            prefill_hidden(model, window)
    finally:
        for h in handles:
            h.remove()
    return stats


def input_channel_max(model: LlamaModel, calibration: list[list[int]], name: str) -> torch.Tensor:
    """max |x_j| over the calibration tokens, for every input channel j of one projection (`name`
    as 'layers.11.mlp.down_proj'): the outlier channels SmoothQuant and AWQ are about. On SmolLM2,
    down_proj inputs have the largest: layers.11's peaks at ~3300 against a median of ~0.6."""
    return collect_input_stats(model, calibration, [name])[name]


# ----------------------------------------------------------------------------- folding
@dataclass
class LayerWeights:
    """fp32 working copies of one decoder layer's projections and norms, so that scales are
    folded and weights quantized without rounding to the model's dtype in between."""

    qkv_proj: torch.Tensor
    o_proj: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor

    @classmethod
    def from_layer(cls, layer: nn.Module) -> "LayerWeights":
        a, m = layer.self_attn, layer.mlp
        return cls(*(t.detach().float().clone() for t in (
            a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight,
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight)))

    def write_norms(self, layer: nn.Module) -> None:
        """Copy the (divided) norm weights back into the layer, in its dtype."""
        with torch.no_grad():
            layer.input_layernorm.weight.copy_(self.input_layernorm)
            layer.post_attention_layernorm.weight.copy_(self.post_attention_layernorm)

    def write_float(self, layer: nn.Module) -> None:
        """Copy everything back, projections still unquantized (to check that folding keeps the
        layer's function)."""
        self.write_norms(layer)
        with torch.no_grad():
            for attr in TARGETS:
                owner = layer.self_attn if attr in ("qkv_proj", "o_proj") else layer.mlp
                getattr(owner, attr).weight.copy_(getattr(self, attr))


def gqa_shared(values: torch.Tensor, args: LlamaArgs, reduce: str = "max") -> torch.Tensor:
    """o_proj's per-input-channel `values` (num_heads * head_dim) made equal across the query heads
    that share a kv head, by their max or mean: the only scales that can be folded into v rows."""
    kvh, hd = args.num_key_value_heads, args.head_dim
    g = values.view(kvh, values.numel() // (kvh * hd), hd)   # this layer's heads (some pruned)
    shared = g.amax(dim=1, keepdim=True) if reduce == "max" else g.mean(dim=1, keepdim=True)
    return shared.expand_as(g).reshape(-1)


def fold_scales(w: LayerWeights, target: str, s: torch.Tensor, args: LlamaArgs) -> None:
    """Multiply input channel j of `target` by s[j] and divide the op that produces that input by
    s[j]: in exact arithmetic the layer computes the same function."""
    s = s.float()
    if target == "qkv_proj":
        w.input_layernorm /= s
        w.qkv_proj *= s
    elif target == "gate_up_proj":
        w.post_attention_layernorm /= s
        w.gate_up_proj *= s
    elif target == "down_proj":   # down's input silu(gate) * up is linear in up
        w.gate_up_proj[w.gate_up_proj.shape[0] // 2:] /= s[:, None]   # this layer's width
        w.down_proj *= s
    elif target == "o_proj":      # o's input channel (head h, dim d) is v channel (h // rep, d)
        kvh, hd = args.num_key_value_heads, args.head_dim
        heads = s.numel() // hd                   # this layer's query heads (some may be pruned)
        g = s.view(kvh, heads // kvh, hd)
        if not torch.equal(g, g[:, :1].expand_as(g)):
            raise ValueError("o_proj scales differ between query heads that share a kv head: "
                             "they cannot be folded into the v rows (make them with gqa_shared)")
        v_start = heads * hd + kvh * hd
        w.qkv_proj[v_start:] /= g[:, 0].reshape(-1)[:, None]
        w.o_proj *= s
    else:
        raise ValueError(f"target={target!r} is invalid: allowed are {', '.join(TARGETS)}")


def previous_op_weight_absmax(w: LayerWeights, target: str) -> torch.Tensor:
    """max over output rows of |W[:, j]| for each input channel j of `target`."""
    return getattr(w, target).abs().amax(dim=0)


def smoothing_scales(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float,
                     target: str, args: LlamaArgs) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), shared across GQA groups for o_proj."""
    if target == "o_proj":
        act_max, weight_max = gqa_shared(act_max, args), gqa_shared(weight_max, args)
    s = act_max.clamp(min=1e-5).pow(alpha) / weight_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


# ----------------------------------------------------------------------------- the model
def tensor_absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over every token and channel: a static per-tensor activation statistic."""
    return x.abs().amax()


def install_w8a8(layer: nn.Module, weights: dict, dtype: torch.dtype,
                 input_scales: dict | None = None) -> None:
    """Replace the layer's four projections by W8A8Linear layers (static input scales by target
    name, if given)."""
    for target in TARGETS:
        owner = layer.self_attn if target in ("qkv_proj", "o_proj") else layer.mlp
        scale = None if input_scales is None else input_scales[target]
        setattr(owner, target, W8A8Linear(weights[target], dtype, scale))


@torch.no_grad()
def quantize_smoothquant(model: LlamaModel, cfg, calibration: list[list[int]]) -> None:
    """Smooth the decoder projections of `model` by the calibration windows' activation maxima,
    then replace each by a W8A8Linear (see the module docstring)."""
    targets = tuple(cfg.smoothquant_targets)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"smoothquant_targets has unknown entries {unknown}: allowed are "
                         f"{', '.join(TARGETS)}")
    static = cfg.smoothquant_activations == "static"
    dtype = model.embed_tokens.weight.dtype
    stats = collect_input_stats(model, calibration)
    pending = []   # static: the quantized weights, installed once the scales are measured
    for i, layer in enumerate(model.layers):
        w = LayerWeights.from_layer(layer)
        # In this order every weight maximum is read before a fold divides those weights:
        # o_proj's scales go into v rows after qkv_proj's maxima, down_proj's into up rows after
        # gate_up_proj's (whose per-row INT8 scales then absorb the division exactly).
        for target in (t for t in TARGETS if t in targets):
            path = ("self_attn." if target in ("qkv_proj", "o_proj") else "mlp.") + target
            s = smoothing_scales(stats[f"layers.{i}.{path}"],
                                 previous_op_weight_absmax(w, target), cfg.smoothquant_alpha,
                                 target, model.args)
            fold_scales(w, target, s, model.args)
        weights = {target: quantize_int8(getattr(w, target)) for target in TARGETS}
        if static:
            # The smoothed float layer, in the model's dtype: the static scales are measured on
            # the smoothed inputs themselves (the divided norms' rounding included), not derived
            # from the raw maxima divided by s.
            w.write_float(layer)
            pending.append(weights)
        else:
            w.write_norms(layer)
            install_w8a8(layer, weights, dtype)
    if static:
        # One more pass, over the smoothed float model (as the reference implementation and
        # TensorRT-LLM calibrate): per projection, max |x| over every calibration token.
        amax = collect_input_stats(model, calibration, stat=tensor_absmax)
        for i, (layer, weights) in enumerate(zip(model.layers, pending)):
            scales = {}
            for target in TARGETS:
                path = ("self_attn." if target in ("qkv_proj", "o_proj") else "mlp.") + target
                scales[target] = (amax[f"layers.{i}.{path}"] / 127).clamp(min=1e-8)
            install_w8a8(layer, weights, dtype, scales)
