"""Per-layer KV cache formats: which row format (layers/kv_formats.py) each layer's K and V are stored in.

`kv_cache_dtype` is one format for every layer ("auto", "fp8", "int8", "int4") or a plan:

- a list of names, one per layer: ["auto", "auto", "int8", ..., "int4"];
- a compact string of inclusive layer ranges: "auto:0-5,int8:6-23,int4:24-29" ("int8:7" is one
  layer); every layer must be covered exactly once.

Shallow layers tend to be the sensitive ones (their errors pass through every later layer), so a
plan keeps them at higher precision and compresses deeper ones ("exiting quantization").
A plan is read once without the model (names, range syntax, overlaps) and again once the layer
count is known (`layer_kv_dtypes`), which returns one name per layer.
"""
from __future__ import annotations

FORMATS = ("auto", "fp8", "int8", "int4")
ALLOWED = ("one of 'auto', 'fp8', 'int8', 'int4'; a list of those names, one per layer; or "
           "ranges such as 'auto:0-5,int8:6-23,int4:24-29' covering every layer exactly once")


def _invalid(value, why: str) -> ValueError:
    return ValueError(f"kv_cache_dtype={value!r} is invalid: {why}; allowed: {ALLOWED}")


def _parse_ranges(value: str) -> list[str | None]:
    """'int8:0-3,auto:4' -> ['int8', 'int8', 'int8', 'int8', 'auto'] (None where no range)."""
    layers: list[str | None] = []
    for part in value.split(","):
        name, sep, span = part.strip().partition(":")
        if not sep or name not in FORMATS:
            raise _invalid(value, f"{part.strip()!r} is not FORMAT:FIRST-LAST with a known format")
        lo, _, hi = span.partition("-")
        if not lo.strip().isdigit() or not (hi or lo).strip().isdigit():
            raise _invalid(value, f"{span!r} is not a layer range FIRST-LAST of integers >= 0")
        lo_i, hi_i = int(lo), int(hi or lo)
        if hi_i < lo_i:
            raise _invalid(value, f"range {span!r} ends before it starts")
        layers.extend([None] * (hi_i + 1 - len(layers)))
        for i in range(lo_i, hi_i + 1):
            if layers[i] is not None:
                raise _invalid(value, f"layer {i} is given twice")
            layers[i] = name
    return layers


def layer_kv_dtypes(value, num_layers: int | None = None) -> tuple[str, ...] | None:
    """One format name per layer; None for a single format name (every layer alike, any count).
    Without num_layers only what does not depend on the model is checked."""
    if isinstance(value, str) and ":" not in value:
        if value not in FORMATS:
            raise _invalid(value, "unknown format")
        return None
    if isinstance(value, str):
        layers = _parse_ranges(value)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        layers = list(value)
        unknown = sorted({v for v in layers if v not in FORMATS})
        if unknown:
            raise _invalid(value, f"unknown format(s) {unknown}")
    else:
        raise _invalid(value, "it must be a format name, a list of them or a range string")
    missing = [i for i, v in enumerate(layers) if v is None]
    if missing:
        raise _invalid(value, f"layer(s) {missing} are not covered")
    if num_layers is not None and len(layers) != num_layers:
        raise _invalid(value, f"it covers {len(layers)} layers and the model has {num_layers}")
    return tuple(layers)


def resolve(value, num_layers: int) -> str | tuple[str, ...]:
    """What the cache and attention carry: a single name when every layer has the same format
    (so a uniform plan runs exactly as that single format does), else the per-layer tuple."""
    layers = layer_kv_dtypes(value, num_layers)
    if layers is None:
        return value
    return layers[0] if len(set(layers)) == 1 else layers


def is_mixed(value) -> bool:
    """Whether a value can give different layers different formats (any plan, before resolving)."""
    return layer_kv_dtypes(value) is not None and len(set(layer_kv_dtypes(value))) > 1


def plan_formats(value) -> set[str]:
    """Every format a value uses."""
    layers = layer_kv_dtypes(value)
    return {value} if layers is None else set(layers)
