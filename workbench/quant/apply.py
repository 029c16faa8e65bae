"""quantize_model: replace a loaded model's projections with quantized layers, by one method.

    model (bf16/fp32 nn.Linear weights)
      -> [calibration windows -> per-layer input statistics]      gptq, awq, smoothquant only
      -> per projection: a quantized weight (formats.py) by the method's rule
      -> Int8Linear / Int4Linear / W8A8Linear in place of nn.Linear (linear.py)

Every decoder projection is quantized (qkv_proj, o_proj, gate_up_proj, down_proj) and, unless
`quantize_lm_head=False`, the LM head too: at 49152 x 576 it is a fifth of SmolLM2's weights and
the largest single read of every decode step. The tied embedding table stays in the model's dtype
(a step reads one row of it). The LM head is INT8 (per channel, round-to-nearest) in every method:
on SmolLM2 an INT4 head adds clearly to the mean KL on held-out text while an INT8 head adds about
nothing over the bf16 one (`python -m workbench.bench quant --methods int4-g32 int4-g32-bf16head`
compares the INT8 head with the bf16 one), for half a byte more per head weight read per token
than INT4. GPTQ, AWQ and SmoothQuant treat the decoder layers, where their statistics come from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.llama import LlamaModel
from .formats import check_group_size, quantize_int4, quantize_int8
from .linear import Int4Linear, Int8Linear, QuantLinear

METHODS = ("int8", "int4", "gptq", "awq", "smoothquant", "mixed")
CALIBRATED = ("gptq", "awq", "smoothquant", "mixed")
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class QuantConfig:
    """Every option of every method; `quantization_config` sets any of them by name."""
    method: str
    group_size: int = 128              # int4, gptq, awq
    quantize_lm_head: bool = True
    num_calibration_windows: int = 32  # gptq, awq, smoothquant
    calibration_window_len: int = 256
    smoothquant_alpha: float = 0.5     # how much of the activations' range migrates to weights
    smoothquant_targets: tuple = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # "dynamic": a scale per token found at run time; "static": one calibrated fp32 scale per
    # projection input (max |x| of the smoothed input over the calibration windows / 127)
    smoothquant_activations: str = "dynamic"
    # GPTQ: act-order (columns by decreasing H_jj, groups fixed beforehand) costs nothing at run
    # time, since the stored groups stay contiguous, and gives a clearly lower mean KL than the
    # natural order on SmolLM2 at group 128 (`python -m workbench.bench quant --methods gptq`
    # measures the default); so it is the default here (AutoGPTQ's desc_act is off by default
    # because its groups then follow the permutation and need a g_idx at run time).
    gptq_act_order: bool = True
    gptq_percdamp: float = 0.01        # damping added to H's diagonal, times its mean
    gptq_block_size: int = 128         # columns compensated eagerly before the lazy batch update
    awq_grid: int = 20                 # alpha searched on grid points 0, 1/n, ..., 1
    awq_clip: bool = True              # the paper's weight-clipping search after scaling
    awq_o_proj: bool = True            # scale o_proj too (through the v rows, GQA-shared)
    awq_max_tokens: int = 512          # calibration tokens the alpha search measures on
    # mixed (quant/mixed.py): bits per projection weight, scales included (None: uniform INT4 at
    # group_size's bytes); the formats a projection may take; or an explicit plan by name
    budget_bits: float | None = None
    mixed_formats: tuple = ("int4-g256", "int4-g128", "int4-g64", "int4-g32", "int8")
    mixed_plan: dict | None = None
    mixed_sensitivity_windows: int = 2  # calibration windows the per-projection KLs run on

    @classmethod
    def from_args(cls, method: str, options: dict | None) -> "QuantConfig":
        if method not in METHODS:
            raise ValueError(f"quantization={method!r} is invalid: allowed are None, "
                             + ", ".join(repr(m) for m in METHODS))
        options = dict(options or {})
        known = set(cls.__dataclass_fields__) - {"method"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"quantization_config has unknown key(s) {unknown}: allowed are "
                             f"{sorted(known)}")
        for key, value in options.items():
            check_option(key, value)
        for key in ("smoothquant_targets", "mixed_formats"):
            if key in options:
                options[key] = tuple(options[key])
        cfg = cls(method=method, **options)
        check_group_size(cfg.group_size)
        return cfg


TARGET_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ACTIVATION_MODES = ("dynamic", "static")


def check_option(key: str, value) -> None:
    """Raise a ValueError naming the option, its value and what is allowed."""
    from .mixed import FORMATS
    default = QuantConfig.__dataclass_fields__[key].default
    bad = None
    if key == "budget_bits":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 2 < value <= 16:
            bad = "a number of bits per weight in (2, 16]"
    elif key in ("mixed_formats", "mixed_plan"):
        values = list(value.values()) if isinstance(value, dict) else value
        if isinstance(value, str) or not isinstance(value, (list, tuple, dict)) \
                or (key == "mixed_plan") != isinstance(value, dict) \
                or not values or not set(values) <= set(FORMATS):
            bad = ("a non-empty list of formats" if key == "mixed_formats" else
                   "a dict of projection name -> format") + f", formats drawn from {list(FORMATS)}"
    elif isinstance(default, bool):
        if not isinstance(value, bool):
            bad = "a bool"
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad = "a positive int"
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad = "a number"
        elif key == "smoothquant_alpha" and not 0.0 <= value <= 1.0:
            bad = "in [0, 1]"
        elif key == "gptq_percdamp" and not 0.0 < value < 1.0:
            bad = "in (0, 1)"
    elif key == "smoothquant_activations":
        if not isinstance(value, str) or value not in ACTIVATION_MODES:
            bad = "one of " + ", ".join(repr(m) for m in ACTIVATION_MODES)
    elif key == "smoothquant_targets":
        # Empty is allowed: W8A8 without smoothing, the baseline SmoothQuant improves on.
        if isinstance(value, str) or not set(value) <= set(TARGET_NAMES):
            bad = f"a list drawn from {list(TARGET_NAMES)}"
    if bad:
        raise ValueError(f"quantization_config[{key!r}]={value!r} is invalid: it must be {bad}")


def projections(model: LlamaModel):
    """(name, parent module, attribute, nn.Linear) of every decoder projection."""
    for i, layer in enumerate(model.layers):
        for path in PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            yield f"layers.{i}.{path}", owner, attr, getattr(owner, attr)


def rtn_layer(linear: nn.Linear, method: str, group_size: int, dtype: torch.dtype) -> QuantLinear:
    if method == "int8":
        return Int8Linear(quantize_int8(linear.weight.data), dtype)
    return Int4Linear(quantize_int4(linear.weight.data, group_size), dtype)


def quantize_lm_head(model: LlamaModel) -> None:
    model.lm_head = rtn_layer(model.lm_head, "int8", 0, model.lm_head.weight.dtype)


@torch.no_grad()
def quantize_model(model: LlamaModel, cfg: QuantConfig, calibration: list[list[int]] | None = None
                   ) -> LlamaModel:
    """Quantize `model` in place by `cfg.method`; calibrated methods need token windows."""
    dtype = model.embed_tokens.weight.dtype
    if cfg.method in ("int8", "int4"):
        # Only (owner, name) pairs are listed up front, so each full-precision layer is freed as
        # soon as its quantized replacement is in place, not all of them at the end.
        for owner, attr in [(owner, attr) for _, owner, attr, _ in projections(model)]:
            setattr(owner, attr, rtn_layer(getattr(owner, attr), cfg.method, cfg.group_size, dtype))
    elif cfg.method == "mixed":    # its own errors name a missing calibration
        from .mixed import quantize_mixed
        quantize_mixed(model, cfg, calibration)
    else:
        if not calibration:
            raise ValueError(f"quantization={cfg.method!r} needs calibration windows")
        if cfg.method == "gptq":
            from .gptq import quantize_gptq
            quantize_gptq(model, cfg, calibration)
        elif cfg.method == "awq":
            from .awq import quantize_awq
            quantize_awq(model, cfg, calibration)
        else:
            from .smoothquant import quantize_smoothquant
            quantize_smoothquant(model, cfg, calibration)
    if cfg.quantize_lm_head:
        quantize_lm_head(model)
    return model
