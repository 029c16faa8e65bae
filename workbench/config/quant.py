"""QuantConfig: what `LLM(quantization=..., quantization_config={...})` asks for, checked once.
The methods themselves are in workbench/quant/."""
from __future__ import annotations

from dataclasses import dataclass

from workbench.config.checks import check_group_size

# mixed precision's formats, cheapest first on SmolLM2's shapes: name -> (method, group size)
MIXED_FORMATS = {"int4-g256": ("int4", 256), "int4-g128": ("int4", 128), "int4-g64": ("int4", 64),
                 "int4-g32": ("int4", 32), "int8": ("int8", 0)}
METHODS = ("int8", "int4", "gptq", "awq", "smoothquant", "mixed")
CALIBRATED = ("gptq", "awq", "smoothquant", "mixed")


@dataclass(frozen=True)
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
    default = QuantConfig.__dataclass_fields__[key].default
    bad = None
    if key == "budget_bits":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 2 < value <= 16:
            bad = "a number of bits per weight in (2, 16]"
    elif key in ("mixed_formats", "mixed_plan"):
        values = list(value.values()) if isinstance(value, dict) else value
        if isinstance(value, str) or not isinstance(value, (list, tuple, dict)) \
                or (key == "mixed_plan") != isinstance(value, dict) \
                or not values or not set(values) <= set(MIXED_FORMATS):
            bad = ("a non-empty list of formats" if key == "mixed_formats" else
                   "a dict of projection name -> format") + f", formats drawn from {list(MIXED_FORMATS)}"
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


def quant_config(quantization, quantization_config) -> QuantConfig | None:
    """The engine arguments' QuantConfig, or None without quantization."""
    if quantization is not None:
        return QuantConfig.from_args(quantization, quantization_config)
    if quantization_config:
        raise ValueError("quantization_config is set but quantization is None: choose a method")
    return None
