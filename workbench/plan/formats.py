"""Bytes per element of each dtype, and bytes of a linear layer's matrix in each weight format.

Weight formats (group-wise ones cut each row's input dimension into groups of 128 weights):
- int8: one byte per weight and one fp32 scale per output row (the workbench's INT8 layout).
- fp8:  one byte per weight and one fp32 scale per matrix.
- int4: half a byte per weight, an fp32 scale and an fp32 minimum per group (the workbench's INT4
        layout): 4.5 bits per weight.
- awq4: half a byte per weight, an fp16 scale and an fp16 zero point per group (AWQ / GPTQ
        checkpoints): 4.25 bits per weight.
"""
from __future__ import annotations

import math

# The engine's dtype names (workbench/config.py DTYPES, LLM(dtype=...)) and the short name each
# stands for here; memory_plan accepts every one and reports the short name.
DTYPE_NAMES = {"float32": "fp32", "fp32": "fp32", "float": "fp32",
               "bfloat16": "bf16", "bf16": "bf16",
               "float16": "fp16", "fp16": "fp16", "half": "fp16"}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# FP8 and INT8 KV caches with one scale per tensor (vLLM's kv_cache_dtype="fp8"): one byte each.
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1}
WEIGHT_FORMATS = (None, "int8", "fp8", "int4", "awq4")
GROUP_SIZE = 128


def linear_bytes(out_features: int, in_features: int, weight_format: str | None,
                 dtype_bytes: int) -> int:
    """Bytes of one (out_features, in_features) matrix stored in `weight_format`."""
    if weight_format is None:
        return out_features * in_features * dtype_bytes
    if weight_format == "int8":
        return out_features * in_features + out_features * 4
    if weight_format == "fp8":
        return out_features * in_features + 4
    groups = math.ceil(in_features / GROUP_SIZE)
    if weight_format == "int4":
        # Rows are padded to whole groups, as the workbench's packed layout stores them.
        return out_features * groups * GROUP_SIZE // 2 + out_features * groups * 8
    if weight_format == "awq4":
        return math.ceil(out_features * in_features / 2) + out_features * groups * 4
    raise ValueError(f"weight_format={weight_format!r} is invalid: allowed are "
                     + ", ".join(repr(f) for f in WEIGHT_FORMATS))
