"""Lab 02 (quantization): the engine's two integer weight formats, written by hand.

The references are the engine's own quantizers and dequantizer (`workbench/layers/formats.py`):
`quantize_int8` (symmetric, one scale per output row), `int4_params` and `int4_codes` (asymmetric,
a scale and a minimum per group of consecutive weights, the input padded with zeros to whole
groups) and `Int4Weight.dequantize` (two codes per byte, element 2j in the low nibble), which is
what `Int4Linear`'s reference path multiplies by.
"""
from __future__ import annotations

import torch

from workbench.layers.formats import (INT4_MAX, Int4Weight, int4_codes, int4_params, pad_to_groups,
                             quantize_int4, quantize_int8)
from workbench.course.labs.core import Mismatch, call, exercise

CHAPTER = "02_quantization"


def _weights(rows: int, cols: int, seed: int, outliers: int = 2) -> torch.Tensor:
    """Weight-like values: small and centred, with a few large ones (as real layers have)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    for _ in range(outliers):
        r = int(torch.randint(rows, (1,), generator=gen))
        c = int(torch.randint(cols, (1,), generator=gen))
        w[r, c] = float(torch.randn(1, generator=gen)) * 0.3
    return w


def _describe(w: torch.Tensor) -> str:
    if w.numel() <= 16:
        rows = ", ".join("[" + ", ".join(f"{v:.4g}" for v in row) + "]" for row in w.tolist())
        return f"w=[{rows}] ({str(w.dtype)[6:]})"
    return f"w of shape {tuple(w.shape)} ({str(w.dtype)[6:]}, max |w| {w.abs().max().item():.3g})"


def _tensor(got, what: str, name: str, shape: tuple, dtypes: tuple, dtype_hint: str = ""):
    """The learner's tensor, or a Mismatch saying what is wrong with its type, dtype or shape."""
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: {name} should be a torch.Tensor, got {type(got).__name__}")
    if got.dtype not in dtypes:
        raise Mismatch(f"{what}: {name} should be {' or '.join(map(str, dtypes))}, got {got.dtype}",
                       dtype_hint)
    if tuple(got.shape) != tuple(shape):
        raise Mismatch(f"{what}: {name} should have shape {tuple(shape)}, got {tuple(got.shape)}")
    return got.detach().cpu()


def _unpack(got, what: str, names: tuple[str, ...]):
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        kind = f"{type(got).__name__}" + (f" of length {len(got)}" if isinstance(got, (tuple, list))
                                          else "")
        raise Mismatch(f"{what} returned {kind}: expected a tuple ({', '.join(names)})")
    return got


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-9) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol))


def _codes_agree(got: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> bool:
    """Codes equal, except off by one where the exact value (before rounding) is within 1e-3 of a
    half: there an equally correct computation of the scale may round the other way."""
    diff = (got.long() - expected.long()).abs()
    near_half = ((exact - exact.floor()) - 0.5).abs() < 1e-3
    return bool(((diff == 0) | ((diff == 1) & near_half)).all())


def _first_difference(got: torch.Tensor, expected: torch.Tensor, label: str) -> str:
    bad = (got.double() - expected.double()).abs() > 0
    idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else None
    if idx is None:
        return ""
    where = ", ".join(map(str, idx))
    return (f"\n  {label}[{where}]: expected {expected[idx].item():.6g}, got {got[idx].item():.6g}"
            f" ({int(bad.sum())} of {bad.numel()} entries differ)")


# ------------------------------------------------------------------------------------- INT8
@exercise("quant.quantize_int8", CHAPTER, "quantize_int8",
          "symmetric INT8 with one scale per output row",
          hint="scale[n] = max |w[n, :]| / 127 (clamped away from 0); q = round(w / "
               "scale[:, None]) clamped to [-127, 127], as torch.int8. Compute in float32.")
def check_quantize_int8(quantize_int8_fn) -> None:
    cases = [
        torch.tensor([[0.5, -0.2, 0.1], [-1.0, 0.3, 0.6]]),           # the worked example's rows
        torch.tensor([[0.1, -0.9, 0.2, 0.45]]),                        # max |w| from a negative
        torch.tensor([[0.0, 0.0, 0.0], [0.2, -0.1, 0.05]]),            # an all-zero row
        torch.tensor([[3.0]]),                                         # one weight
        _weights(8, 64, 0),
        _weights(32, 96, 1, outliers=5),
        _weights(6, 40, 2).to(torch.bfloat16),                         # bf16 in, float32 out
        _weights(64, 128, 3) * 40,                                     # larger weights
    ]
    for w in cases:
        what = f"quantize_int8({_describe(w)})"
        got = _unpack(call(quantize_int8_fn, what, w.clone()), what, ("q", "scale"))
        ref = quantize_int8(w)                    # the engine's quantizer
        n, k = w.shape
        scale = got[1]
        if isinstance(scale, torch.Tensor) and tuple(scale.shape) == (k,) and k != n:
            raise Mismatch(f"{what}: scale has shape {(k,)}, one per column",
                           "one scale per output channel: reduce over the inputs, dim 1 "
                           "(w.abs().amax(dim=1)), giving shape (N,).")
        if isinstance(scale, torch.Tensor) and tuple(scale.shape) == (n, 1):
            raise Mismatch(f"{what}: scale has shape {(n, 1)}; the format keeps it as shape {(n,)}",
                           "squeeze the kept dimension: amax(dim=1) without keepdim.")
        scale = _tensor(scale, what, "scale", (n,), (torch.float32, torch.float64),
                        "compute the scale in float32: w.float() first (bf16 has 8 bits of "
                        "precision, far too few for a scale).")
        q = _tensor(got[0], what, "q", (n, k), (torch.int8,),
                    "round, clamp to [-127, 127], then .to(torch.int8): the codes are 8-bit "
                    "integers.")
        w32 = w.float()
        absmax = w32.abs().amax(dim=1)
        if torch.isnan(scale).any() or torch.isinf(scale).any():
            raise Mismatch(f"{what}: scale = {scale.tolist()} holds NaN or inf",
                           "an all-zero row has max |w| = 0: clamp the scale away from 0 (the "
                           "engine uses clamp(min=1e-12)) so w / scale never divides by zero.")
        if not _close(scale, ref.scale, rtol=1e-5, atol=1e-8):
            hint = ""
            if _close(scale, (w32.abs().max() / 127).expand(n)) and n > 1:
                hint = ("one scale per output row (channel), not one for the whole tensor: a row "
                        "of small weights would otherwise get only a few of the 255 levels.")
            elif any(_close(scale, absmax / d) for d in (128, 255, 256, 127.5)):
                hint = ("divide by 127: the codes run from -127 to 127 (-128 is left out, so that "
                        "+max and -max are both exactly reachable).")
            elif _close(scale, w32.amax(dim=1) / 127):
                hint = ("the scale comes from the largest *magnitude*, max |w|: a row whose "
                        "extreme weight is negative must reach it too.")
            elif w.dtype != torch.float32 and _close(scale, ref.scale, rtol=1e-2):
                hint = "compute in float32 (w.float()): bf16 rounds the scale to 3 digits."
            raise Mismatch(f"{what}: wrong scale\n  expected {_short(ref.scale)}\n  got      "
                           f"{_short(scale)}", hint)
        exact = w32 / ref.scale[:, None]
        if not _codes_agree(q, ref.qweight, exact):
            hint = ""
            if torch.equal(q.long(), torch.trunc(exact).clamp(-127, 127).long()):
                hint = ("round to the nearest code (torch.round); .to(torch.int8) alone truncates "
                        "towards zero.")
            raise Mismatch(f"{what}: wrong codes" + _first_difference(q, ref.qweight, "q"), hint)


def _short(t: torch.Tensor, n: int = 6) -> str:
    vals = t.flatten().tolist()
    text = ", ".join(f"{v:.6g}" for v in vals[:n])
    return f"[{text}{', ...' if len(vals) > n else ''}]"


# ------------------------------------------------------------------------------------- INT4
@exercise("quant.quantize_int4", CHAPTER, "quantize_int4",
          "group-wise asymmetric INT4: a scale and a minimum per group, codes 0..15",
          hint="pad the columns with zeros to a whole number of groups; per (row, group): "
               "minimum = min, scale = (max - min) / 15 (clamped away from 0); codes = round((w - "
               "minimum) / scale) clamped to [0, 15], as torch.uint8, shape (N, groups * "
               "group_size).")
def check_quantize_int4(quantize_int4_fn) -> None:
    cases = [
        (torch.tensor([[0.13, -0.2, 0.4, 0.0, 1.0, 0.5, 0.7, 0.25]]), 4),   # the worked example
        (_weights(4, 64, 10), 32),
        (_weights(3, 576, 11), 128),                      # SmolLM2's width: last group half padding
        (torch.linspace(0.1, 0.9, 48).repeat(2, 1), 32),  # all positive: padding widens the range
        (torch.tensor([[0.5] * 8, [0.0] * 8]), 4),        # constant groups: max == min
        (_weights(2, 20, 12), 32),                        # fewer columns than one group
        (_weights(16, 256, 13, outliers=6), 64),
        (_weights(5, 96, 14).to(torch.bfloat16), 32),
    ]
    for w, gs in cases:
        what = f"quantize_int4({_describe(w)}, group_size={gs})"
        n, k = w.shape
        try:
            got = call(quantize_int4_fn, what, w.clone(), gs)
        except Mismatch as m:
            if k % gs and not m.hint:     # the case whose columns do not fill whole groups
                raise Mismatch(m.message, f"{k} columns are not a whole number of groups of {gs}: "
                               "pad the columns with zeros first (torch.nn.functional.pad(w, "
                               "(0, -k % group_size))), then view the rows as groups.") from None
            raise
        got = _unpack(got, what, ("codes", "scale", "minimum"))
        groups = -(-k // gs)
        ref_scale, ref_min = int4_params(w, gs)                      # the engine's grid
        ref_codes = int4_codes(w, ref_scale, ref_min, gs)            # and its codes
        codes = got[0]
        if isinstance(codes, torch.Tensor) and tuple(codes.shape) == (n, k) and k % gs:
            raise Mismatch(f"{what}: codes have shape {(n, k)}; with {k} columns in groups of {gs} "
                           f"the format stores {(n, groups * gs)}",
                           "pad the columns with zeros to a whole number of groups first "
                           "(torch.nn.functional.pad); the padding gets codes too.")
        dtypes = (torch.float32, torch.float64)
        float_hint = "compute in float32 (w.float() first)."
        scale = _tensor(got[1], what, "scale", (n, groups), dtypes, float_hint)
        minimum = _tensor(got[2], what, "minimum", (n, groups), dtypes, float_hint)
        codes = _tensor(codes, what, "codes", (n, groups * gs), (torch.uint8,),
                        "round, clamp to [0, 15], then .to(torch.uint8).")
        g = pad_to_groups(w.float(), gs).view(n, groups, gs)
        lo, hi = g.amin(-1), g.amax(-1)
        if torch.isnan(scale).any() or torch.isinf(scale).any():
            raise Mismatch(f"{what}: scale holds NaN or inf", _constant_hint())
        params_ok = (_close(scale, ref_scale, rtol=1e-5, atol=1e-9)
                     and _close(minimum, ref_min, rtol=1e-5, atol=1e-9))
        if not params_ok:
            raise Mismatch(f"{what}: wrong grid\n  expected scale {_short(ref_scale)}, minimum "
                           f"{_short(ref_min)}\n  got      scale {_short(scale)}, minimum "
                           f"{_short(minimum)}", _int4_params_hint(w, gs, scale, minimum, ref_scale,
                                                                  ref_min))
        exact = (g - ref_min[..., None]) / ref_scale[..., None]
        if not _codes_agree(codes, ref_codes, exact.view(n, -1)):
            hint = ""
            if torch.equal(codes.long(), exact.floor().clamp(0, INT4_MAX).view(n, -1).long()):
                hint = "round to the nearest code (torch.round), do not truncate."
            elif (hi == lo).any():
                hint = _constant_hint()
            raise Mismatch(f"{what}: wrong codes" + _first_difference(codes, ref_codes, "codes"),
                           hint)


def _constant_hint() -> str:
    return ("a group whose weights are all equal has max == min, so (max - min) / 15 is 0: clamp "
            "the scale away from 0 (the engine uses clamp(min=1e-12)); every code is then 0 and "
            "the minimum alone gives the weight back.")


def _int4_params_hint(w, gs, scale, minimum, ref_scale, ref_min) -> str:
    n, k = w.shape
    w32 = w.float()
    groups = -(-k // gs)
    g = pad_to_groups(w32, gs).view(n, groups, gs)
    lo, hi = g.amin(-1), g.amax(-1)
    if _close(scale, ref_min) and _close(minimum, ref_scale):
        return "return (codes, scale, minimum) in that order."
    absmax = g.abs().amax(-1)
    if any(_close(scale, absmax / d) for d in (7, 7.5, 8)) or _close(minimum, -absmax):
        return ("the engine's INT4 is asymmetric: the 16 codes span [min, max] of the group, with "
                "minimum = min and scale = (max - min) / 15, not a symmetric range around zero.")
    if _close(scale, (hi - lo) / 16) or _close(scale, (hi - lo) / 16, atol=1e-6):
        return "16 codes have 15 steps between them: scale = (max - min) / 15."
    if _close(scale, (hi - lo).clamp(min=1e-12) / 15) and not _close(minimum, lo):
        return "minimum is the group's smallest weight (min, not max or 0)."
    # groups made of every groups-th column instead of consecutive columns
    strided = pad_to_groups(w32, gs).view(n, gs, groups)
    if _close(minimum, strided.amin(1)):
        return ("a group is group_size *consecutive* weights of a row: view the padded row as "
                "(groups, group_size), not (group_size, groups).")
    if k % gs:
        real = [w32[:, j * gs:min((j + 1) * gs, k)] for j in range(groups)]
        lo_real = torch.stack([r.amin(1) for r in real], 1)
        if _close(minimum, lo_real):
            return ("pad first, then take min and max: the zero padding is part of the last "
                    "group's range (the engine's format; a zero input column multiplies it away).")
    return ""


# ------------------------------------------------------------------------------- dequantize
@exercise("quant.dequantize_int4", CHAPTER, "dequantize_int4",
          "unpack two codes per byte and rebuild the weights from scale and minimum",
          hint="codes: byte j holds element 2j in its low nibble (b & 0xF) and 2j + 1 in its high "
               "nibble (b >> 4); w = code * scale + minimum of the code's group, then drop the "
               "padding columns beyond in_features.")
def check_dequantize_int4(dequantize_int4) -> None:
    example = (torch.tensor([[0x10, 0x32, 0xF0, 0x08]], dtype=torch.uint8),
               torch.tensor([[1.0, 0.5]]), torch.tensor([[0.0, -1.0]]), 4, 8)
    cases = [example]
    for rows, cols, gs, seed in [(4, 64, 32, 20), (3, 576, 128, 21), (2, 40, 16, 22),
                                 (8, 256, 64, 23), (1, 6, 4, 24)]:
        q = quantize_int4(_weights(rows, cols, seed), gs)             # the engine's format
        cases.append((q.packed, q.scale, q.minimum, gs, cols))
    for packed, scale, minimum, gs, k in cases:
        # what Int4Linear's reference path multiplies by
        ref = Int4Weight(packed, scale, minimum, gs, k).dequantize()
        n = packed.shape[0]
        if packed.numel() <= 8:
            what = (f"dequantize_int4(packed={[hex(b) for b in packed[0].tolist()]}, "
                    f"scale={scale.tolist()}, minimum={minimum.tolist()}, group_size={gs}, "
                    f"in_features={k})")
        else:
            what = (f"dequantize_int4(packed of shape {tuple(packed.shape)}, scale and minimum of "
                    f"shape {tuple(scale.shape)}, group_size={gs}, in_features={k})")
        got = call(dequantize_int4, what, packed.clone(), scale.clone(), minimum.clone(), gs, k)
        if isinstance(got, torch.Tensor) and tuple(got.shape) == (n, packed.shape[1] * 2) \
                and packed.shape[1] * 2 != k:
            raise Mismatch(f"{what}: shape {tuple(got.shape)}: the padding columns are still there",
                           f"keep the first in_features columns: [:, :{k}].")
        got = _tensor(got, what, "the result", (n, k), (torch.float32, torch.float64),
                      "codes are uint8: convert them to float (.float()) before multiplying.")
        if _close(got, ref, rtol=1e-6, atol=1e-7):
            continue
        raise Mismatch(f"{what}: wrong weights" + _first_difference(got, ref, "w"),
                       _dequant_hint(got, packed, scale, minimum, gs, k))


def _dequant_from(codes: torch.Tensor, scale, minimum, gs, k, tile_scales=False) -> torch.Tensor:
    """Weights from unpacked codes (N, K_padded); tile_scales repeats the per-group vectors
    instead of expanding each over its group (a wrong answer, only for recognising it)."""
    if tile_scales:
        s, m = scale.repeat(1, gs), minimum.repeat(1, gs)
    else:
        s, m = scale.repeat_interleave(gs, 1), minimum.repeat_interleave(gs, 1)
    return (codes.float() * s + m)[:, :k]


def _dequant_hint(got, packed, scale, minimum, gs, k) -> str:
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    n = packed.shape[0]
    interleaved = torch.stack([low, high], -1).view(n, -1)
    variants = {
        "swapped": torch.stack([high, low], -1).view(n, -1),
        "concatenated": torch.cat([low, high], 1),
    }
    close = lambda v: _close(got, v, rtol=1e-5, atol=1e-6)
    if close(_dequant_from(variants["swapped"], scale, minimum, gs, k)):
        return ("nibble order: element 2j is the *low* nibble (b & 0xF), element 2j + 1 the high "
                "one.")
    if close(_dequant_from(variants["concatenated"], scale, minimum, gs, k)):
        return ("interleave the nibbles: low and high nibble of byte j are elements 2j and "
                "2j + 1, neighbours (torch.stack([low, high], dim=-1) then view), not two halves "
                "of the row.")
    if close(_dequant_from(interleaved, scale, torch.zeros_like(minimum), gs, k)):
        return "add each group's minimum: w = code * scale + minimum (code 0 is the minimum)."
    if close(_dequant_from(interleaved - 8, scale, minimum, gs, k)) or \
            close(_dequant_from(interleaved - 8, scale, torch.zeros_like(minimum), gs, k)):
        return "the codes are unsigned, 0..15, offset by the minimum: do not subtract 8."
    if close(_dequant_from(interleaved, scale, minimum, gs, k, tile_scales=True)):
        return ("each scale covers group_size consecutive columns: expand with "
                "repeat_interleave(group_size, dim=1), not repeat (which tiles the whole vector).")
    return ""
