"""PruneConfig: what `LLM(pruning=..., pruning_config={...})` asks for, checked once. The methods
themselves are in workbench/compress/."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

METHODS = ("magnitude", "wanda", "sparsegpt", "channels", "layers", "heads")  # last 3: structured
CALIBRATED = ("wanda", "sparsegpt", "channels", "layers", "heads")
MASKED = ("magnitude", "wanda", "sparsegpt")


@dataclass(frozen=True)
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


def prune_config(pruning, pruning_config) -> PruneConfig | None:
    """The engine arguments' PruneConfig, or None without pruning."""
    if pruning is not None:
        return PruneConfig.from_args(pruning, pruning_config)
    if pruning_config:
        raise ValueError("pruning_config is set but pruning is None: choose a method")
    return None
