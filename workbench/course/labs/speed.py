"""Lab 01 (the anatomy of speed): a profiler table turned into the buckets of a decode step, the
bandwidth a measured speed achieves, and the roofline of batched decode.

The references are the engine's own: `workbench.bench.anatomy` (its `categorize` of an operator
name and its overhead, the forward's wall time minus every operator's self time, never below 0),
`workbench.bench.decode_bytes_per_token` (the bytes a batch-1 decode step reads), which the speed
ladder multiplies by decode tok/s for its GB/s column, and the chapter's roofline: batched decode
reads the weights once per step for every sequence in the batch, and the K/V of each sequence.
"""
from __future__ import annotations

import math
import numbers
import random

from workbench.bench import decode_bytes_per_token
from workbench.bench.anatomy import ATTENTION_OPS, MATMUL_OPS, categorize
from workbench.course.labs.core import Mismatch, call, exercise

CHAPTER = "01_anatomy_of_speed"
BUCKETS = ("matmul", "attention", "other ops", "overhead")


def _number(got, what: str, unit: str) -> float:
    try:
        import torch
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
    except ImportError:     # pragma: no cover (torch is a dependency)
        pass
    if not isinstance(got, numbers.Real) or isinstance(got, bool):
        raise Mismatch(f"{what} returned {type(got).__name__} {got!r}: expected a number ({unit})")
    return float(got)


# ------------------------------------------------------------------------------------ attribute
def _reference_attribute(events, forward_s: float) -> dict[str, float]:
    """What workbench.bench.anatomy does with one step's operators (self times, seconds)."""
    buckets = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    for name, self_s in events:
        buckets[categorize(name)] += self_s
    buckets["overhead"] = max(forward_s - sum(buckets.values()), 0.0)
    return buckets


def _exact_attribute(events, forward_s: float) -> dict[str, float]:
    """A typical wrong version: whole names compared, not substrings."""
    buckets = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    for name, self_s in events:
        key = ("matmul" if name in MATMUL_OPS else "attention" if name in ATTENTION_OPS
               else "other ops")
        buckets[key] += self_s
    buckets["overhead"] = max(forward_s - sum(buckets.values()), 0.0)
    return buckets


def _eager_bf16_step(scale: float = 1.0):
    """A decode step of SmolLM2 (30 layers) as torch.profiler lists it, in seconds of self time:
    the shape of what chapter 01 measures for eager bf16, summed per operator name."""
    ms = 1e-3 * scale
    return [
        ("aten::mm", 25.1 * ms), ("aten::linear", 0.9 * ms), ("aten::t", 0.6 * ms),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", 1.1 * ms),
        ("aten::index_copy_", 0.35 * ms), ("aten::index_select", 0.4 * ms),
        ("aten::mul", 2.9 * ms), ("aten::add", 1.2 * ms), ("aten::rsqrt", 0.5 * ms),
        ("aten::mean", 0.8 * ms), ("aten::pow", 0.7 * ms), ("aten::silu", 0.4 * ms),
        ("aten::cat", 0.6 * ms), ("aten::to", 0.5 * ms), ("aten::_to_copy", 0.9 * ms),
        ("aten::view", 0.3 * ms), ("aten::embedding", 0.05 * ms), ("aten::slice", 0.4 * ms),
    ]


def _attribute_hint(got: dict, events, forward_s: float) -> str:
    ref = _reference_attribute(events, forward_s)
    ops_total = sum(s for _, s in events)
    near = lambda a, b: math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    if "overhead" in got and near(got["overhead"], forward_s - ops_total) and ops_total > forward_s:
        return ("the profiler adds a little to every operator's time, so the operators can sum to "
                "more than the forward's wall time: the overhead is never negative (max(..., 0)).")
    if "overhead" in got and near(got["overhead"], forward_s):
        return ("overhead is what the operators do not explain: the forward's wall time minus the "
                "self time of every operator (all three buckets), not the whole forward.")
    if "overhead" in got and near(got["overhead"], max(forward_s - ref["matmul"], 0.0)):
        return ("subtract every operator's time from the forward, not only the matmuls': the "
                "overhead is the time no operator accounts for.")
    exact = _exact_attribute(events, forward_s)
    if all(k in got and near(got[k], exact[k]) for k in BUCKETS):
        return ("profiler names carry prefixes and suffixes (aten::_scaled_dot_product_flash_"
                "attention_for_cpu, mkldnn::_linear_pointwise): a name belongs to a bucket when it "
                "*contains* one of the patterns (case-insensitive), not when it equals one.")
    if "matmul" in got and near(got["matmul"], ref["matmul"] + ref["attention"]):
        return "attention operators (SDPA, index_copy into the cache) are not matmuls."
    return ""


@exercise("speed.attribute", CHAPTER, "attribute",
          "split one decode step's profiler table into matmul, attention, other ops and overhead",
          hint="a name whose lowercase form contains a MATMUL_OPS pattern is matmul; else one that "
               "contains an ATTENTION_OPS pattern is attention; else other ops. Sum the self times "
               "per bucket; overhead = max(forward_s - all operator time, 0).")
def check_attribute(attribute) -> None:
    rng = random.Random(0)
    names = [n for n, _ in _eager_bf16_step()] + [
        "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
        "mkldnn::_linear_pointwise", "aten::bmm", "aten::_int_mm", "aten::copy_", "aten::neg",
        "aten::scaled_dot_product_attention", "aten::softmax", "aten::argmax"]
    cases = [
        (_eager_bf16_step(), 0.0462),                          # eager bf16: 9 ms left over
        (_eager_bf16_step(), 0.0390),                          # operators sum past the forward
        ([("aten::_weight_int4pack_mm_for_cpu", 0.0081), ("aten::mul", 0.0020),
          ("aten::index_copy_", 0.0004), ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                          0.0011)], 0.0150),   # INT4 eager
        ([("mkldnn::_linear_pointwise", 0.0300), ("aten::scaled_dot_product_attention", 0.0019),
          ("aten::copy_", 0.0010)], 0.0335),                   # compiled: few, fused operators
        ([], 0.002),                                           # no operator at all
    ]
    while len(cases) < 12:
        events = [(rng.choice(names), rng.uniform(1e-5, 3e-3)) for _ in range(rng.randint(3, 14))]
        total = sum(s for _, s in events)
        cases.append((events, total * rng.choice([0.9, 1.1, 1.5, 2.5])))
    for events, forward_s in cases:
        shown = ", ".join(f"({n!r}, {s:.4g})" for n, s in events[:6])
        more = f", ... {len(events) - 6} more" if len(events) > 6 else ""
        what = f"attribute(events=[{shown}{more}], forward_s={forward_s:.4g})"
        got = call(attribute, what, list(events), forward_s)
        if not isinstance(got, dict):
            raise Mismatch(f"{what} returned {type(got).__name__}: expected a dict with the keys "
                           f"{', '.join(repr(b) for b in BUCKETS)}")
        missing = [b for b in BUCKETS if b not in got]
        if missing:
            raise Mismatch(f"{what}: the result lacks {', '.join(repr(m) for m in missing)} "
                           f"(got keys {sorted(got)})",
                           "overhead: the forward's wall time minus the time of all operators."
                           if missing == ["overhead"] else "")
        expected = _reference_attribute(events, forward_s)
        values = {b: _number(got[b], f"{what}[{b!r}]", "seconds") for b in BUCKETS}
        if all(math.isclose(values[b], expected[b], rel_tol=1e-6, abs_tol=1e-12) for b in BUCKETS):
            continue
        lines = "\n".join(f"  {b:>10}: expected {expected[b] * 1e3:9.4f} ms, got "
                          f"{values[b] * 1e3:9.4f} ms" for b in BUCKETS)
        raise Mismatch(f"{what}:\n{lines}", _attribute_hint(values, events, forward_s))


# ---------------------------------------------------------------------------- achieved_bandwidth
def _bytes_per_step(weight_bytes: int, kv_bytes_per_token: int, context_len: int,
                    batch: int) -> int:
    """One decode step of `batch` sequences: the weights once, the K/V of every sequence's
    context (at batch 1, exactly workbench.bench.decode_bytes_per_token)."""
    return decode_bytes_per_token(weight_bytes, batch * kv_bytes_per_token, context_len)


@exercise("speed.achieved_bandwidth", CHAPTER, "achieved_bandwidth",
          "the memory bandwidth (GB/s) a measured decode speed implies",
          hint="a step of `batch` sequences reads the weights once plus batch x KV bytes per token "
               "x context; it makes `batch` tokens, so steps/s = tok_s / batch; GB/s = bytes per "
               "step x steps/s / 1e9.")
def check_achieved_bandwidth(achieved_bandwidth) -> None:
    smol_bf16, smol_fp32, kv_bf16 = 269_030_016, 538_060_032, 23_040
    cases = [  # (weight_bytes, kv_bytes_per_token, context_len, batch, tok_s)
        (smol_bf16, kv_bf16, 48, 1, 22.5),           # eager bf16, batch 1
        (smol_fp32, 2 * kv_bf16, 48, 1, 22.8),       # eager fp32
        (95_000_000, kv_bf16, 96, 1, 62.8),          # INT4
        (smol_bf16, kv_bf16, 0, 1, 20.0),            # no context yet
        (smol_bf16, kv_bf16, 48, 8, 150.0),          # eight sequences share each weight read
        (smol_bf16, kv_bf16, 2048, 32, 400.0),       # long contexts: KV grows with the batch
        (16_060_522_496, 131_072, 4096, 1, 104.9),   # about Llama-3-8B on a GPU
    ]
    for w, kv, ctx, b, tok_s in cases:
        what = (f"achieved_bandwidth(weight_bytes={w}, kv_bytes_per_token={kv}, context_len={ctx}, "
                f"batch={b}, tok_s={tok_s})")
        got = _number(call(achieved_bandwidth, what, w, kv, ctx, b, tok_s), what, "GB/s")
        nbytes = _bytes_per_step(w, kv, ctx, b)
        expected = nbytes * tok_s / b / 1e9
        if math.isclose(got, expected, rel_tol=1e-9):
            continue
        near = lambda v: v != 0 and math.isclose(got, v, rel_tol=1e-6)
        hint = ""
        if b > 1 and near(nbytes * tok_s / 1e9):
            hint = ("tok_s counts the tokens of all sequences: a step makes `batch` of them, so "
                    "the weights are read tok_s / batch times per second, not tok_s times.")
        elif b > 1 and near((w + kv * ctx) * tok_s / b / 1e9):
            hint = ("every sequence has its own context: a step reads batch x KV bytes per token x "
                    "context_len, and the weights once for all of them.")
        elif b > 1 and near((w + kv * ctx) * tok_s / 1e9):
            hint = ("the weights are read once per step, whatever the batch: that is what batching "
                    "buys. Only the K/V grows with the batch.")
        elif near(nbytes * tok_s / b / 2**30):
            hint = "GB/s counts 1e9 bytes per second (as copy_bandwidth reports it), not 2**30."
        elif ctx and near(w * tok_s / b / 1e9):
            hint = "a step reads the K/V of the context too: add kv_bytes_per_token x context_len."
        elif near(nbytes / tok_s / 1e9) or near(b * nbytes / tok_s / 1e9):
            hint = "bytes per second = bytes per step x steps per second (multiply by the speed)."
        raise Mismatch(f"{what}:\n  expected {expected:.6g} GB/s ({nbytes:,} bytes per step, "
                       f"{tok_s / b:g} steps/s)\n  got      {got!r}", hint)


# ----------------------------------------------------------------------------------- roofline
def _reference_roofline(w, kv, ctx, batch, flops_per_token, bandwidth_gbs, peak_gflops) -> float:
    memory = batch * bandwidth_gbs * 1e9 / _bytes_per_step(w, kv, ctx, batch)
    compute = peak_gflops * 1e9 / flops_per_token
    return min(memory, compute)


@exercise("speed.roofline_tok_s", CHAPTER, "roofline_tok_s",
          "the most tokens/s decode can reach at a batch size: the lower of two roofs",
          hint="memory roof: a step reads the weights once and every sequence's K/V, and makes "
               "`batch` tokens: batch x bandwidth / bytes per step. Compute roof: peak FLOP/s / "
               "FLOPs per token. The bound is the lower of the two.")
def check_roofline_tok_s(roofline_tok_s) -> None:
    smol = dict(w=269_030_016, kv=23_040, flops=2 * 134_515_008)
    cases = [  # (weight_bytes, kv, context, batch, flops_per_token, bandwidth_gbs, peak_gflops)
        (smol["w"], smol["kv"], 48, 1, smol["flops"], 19.7, 900.0),       # batch 1: memory-bound
        (smol["w"], smol["kv"], 48, 8, smol["flops"], 19.7, 900.0),       # batch 8: 8x the tokens
        (smol["w"], smol["kv"], 48, 64, smol["flops"], 19.7, 900.0),      # batch 64: compute-bound
        (smol["w"], smol["kv"], 2048, 64, smol["flops"], 19.7, 900.0),    # long contexts
        (smol["w"], smol["kv"], 0, 1, smol["flops"], 19.7, 900.0),
        (16_060_522_496, 131_072, 1024, 1, 2 * 8.03e9, 4800.0, 989_000.0),   # 8B, H200, batch 1
        (16_060_522_496, 131_072, 1024, 256, 2 * 8.03e9, 4800.0, 989_000.0), # ... batch 256
    ]
    for w, kv, ctx, b, f, bw, peak in cases:
        what = (f"roofline_tok_s(weight_bytes={w}, kv_bytes_per_token={kv}, context_len={ctx}, "
                f"batch={b}, flops_per_token={f:g}, bandwidth_gbs={bw}, peak_gflops={peak})")
        got = _number(call(roofline_tok_s, what, w, kv, ctx, b, f, bw, peak), what, "tokens/s")
        expected = _reference_roofline(w, kv, ctx, b, f, bw, peak)
        if math.isclose(got, expected, rel_tol=1e-9):
            continue
        memory = b * bw * 1e9 / _bytes_per_step(w, kv, ctx, b)
        compute = peak * 1e9 / f
        near = lambda v: v != 0 and math.isclose(got, v, rel_tol=1e-6)
        hint = ""
        if near(memory):
            hint = ("at this batch the arithmetic is the limit: tokens/s can also never exceed "
                    "peak_gflops x 1e9 / flops_per_token.")
        elif near(max(memory, compute)):
            hint = "the bound is the *lower* roof: min(memory bound, compute bound), not max."
        elif b > 1 and near(min(bw * 1e9 / (w + kv * ctx), compute)):
            hint = ("a step of `batch` sequences reads the weights once (not once per sequence) "
                    "and makes `batch` tokens: the memory roof grows (almost) with the batch.")
        elif b > 1 and near(min(b * bw * 1e9 / (w + kv * ctx), compute)):
            hint = "every sequence reads its own K/V: the KV bytes of a step grow with the batch."
        elif near(min(memory, peak / f)) or near(min(memory, compute * 1e3)):
            hint = "peak_gflops is in GFLOP/s: multiply by 1e9 for FLOP/s."
        raise Mismatch(f"{what}:\n  expected {expected:.6g} tokens/s (memory roof {memory:.6g}, "
                       f"compute roof {compute:.6g})\n  got      {got!r}", hint)
