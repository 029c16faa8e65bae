"""The quantization table: every method against the bf16 model, quality and decode speed together.

For each variant (bf16 weights, int8, int4, gptq, awq, smoothquant; and, with bf16 weights, the KV
cache in fp8 or int8), all built in one process from the same checkpoint:

- quality on held-out CPython documentation (quant/calibration.py) against the bf16 engine:
  perplexity, mean KL(bf16 || variant) of the next-token distributions, top-1 agreement
  (experiments/quality.py);
- sizes: weight bytes stored, bytes a decode step reads, KV bytes per token;
- the single-stream workload (a ~32-token prompt, 128 new tokens, greedy, ignore_eos, batch 1):
  decode tok/s (1 / time per output token), achieved GB/s = (weights read + KV of the mean context)
  x decode tok/s, and the speedup over bf16. The variants run in turn, round after round, so that
  machine noise hits all alike; a speedup is the median over rounds of variant / bf16 from the
  same round. Also: for how many of the 128 greedy tokens the variant agrees with bf16.

    python -m workbench.bench.quant [--methods int8 int4] [--kv-dtypes fp8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from workbench.llm import LLM
from workbench.quant.calibration import heldout_windows
from workbench.experiments.quality import compare_many, decode_read_bytes, kv_bytes_per_token, model_bytes
from workbench.bench.bandwidth import copy_bandwidth, decode_bytes_per_token
from workbench.bench.single_stream import NEW_TOKENS, PROMPT, engine_once

# None is the reference weights. "int4-g32" sets group_size=32, aligned with the Q4_1 blocks the
# embedded weights come from; "-bf16head" keeps the LM head unquantized (quantize_lm_head=False).
METHODS = (None, "int8", "int4", "int4-g32", "int4-g32-bf16head", "gptq", "awq", "smoothquant")
KV_DTYPES = ("auto", "fp8", "int8")
NUM_WINDOWS, WINDOW_LEN = 16, 256


def variants(methods, kv_dtypes) -> list[tuple[str | None, str]]:
    """(method, kv_cache_dtype) pairs, the reference (None, "auto") first. KV variants use the
    reference weights only, to keep the table short."""
    out = [(None, "auto")]
    out += [(m, "auto") for m in methods if m is not None]
    out += [(None, kv) for kv in kv_dtypes if kv != "auto"]
    return list(dict.fromkeys(out))


def parse_method(spec: str) -> tuple[str, dict]:
    """'int4-g32-bf16head' -> ('int4', {'group_size': 32, 'quantize_lm_head': False})."""
    method, *options = spec.split("-")
    config = {}
    for opt in options:
        if opt == "bf16head":
            config["quantize_lm_head"] = False
        elif opt.startswith("g") and opt[1:].isdigit():
            config["group_size"] = int(opt[1:])
        else:
            raise ValueError(f"method={spec!r} is invalid: after the method name come options "
                             "'-g<group size>' and '-bf16head', e.g. 'int4-g32-bf16head'")
    return method, config


def label(method: str | None, kv: str, dtype: str) -> str:
    name = method or dtype
    return name if kv == "auto" else f"{name} kv={kv}"


def build(method: str | None, kv: str, model: str, dtype: str, max_model_len: int) -> LLM:
    """One engine; the quantization arguments are passed only when they differ from the default,
    so the reference builds on an engine without quantization support too."""
    extra = {}
    if method is not None:
        extra["quantization"], config = parse_method(method)
        if config:
            extra["quantization_config"] = config
    if kv != "auto":
        extra["kv_cache_dtype"] = kv
    # One sequence at a time (batch-1 decode) and a whole window per step (evaluation).
    return LLM(model, dtype=dtype, device="cpu", verbose=False, max_num_seqs=1,
               max_model_len=max_model_len, max_num_batched_tokens=max_model_len, **extra)


def _progress(message: str) -> None:
    """The table takes minutes (GPTQ and AWQ calibrate while their engines are built): say where."""
    print(f"[bench quant] {message}", file=sys.stderr, flush=True)


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(methods=METHODS, kv_dtypes=KV_DTYPES, num_windows: int = NUM_WINDOWS,
        window_len: int = WINDOW_LEN, repeats: int = 3, new_tokens: int = NEW_TOKENS,
        model: str = "smollm2-135m", dtype: str = "bfloat16", threads: int | None = None,
        **_) -> dict:
    for m in methods:   # a typo fails now, not as an "unavailable" row minutes later
        if m is not None:
            parse_method(m)
    pairs = variants(methods, kv_dtypes)
    if threads is not None:
        # On a shared, oversubscribed machine every parallel region waits for a descheduled
        # thread; one thread can then decode several times faster than two.
        torch.set_num_threads(threads)
    result = {"workload": "quant", "model": model, "dtype": dtype, "num_windows": num_windows,
              "window_len": window_len, "new_tokens": new_tokens, "repeats": repeats,
              "threads": torch.get_num_threads(), "python": sys.version.split()[0],
              "copy_bandwidth_gbs": copy_bandwidth(), "rows": []}
    engines, rows = {}, {}
    for method, kv in pairs:
        name = label(method, kv, dtype)
        row = {"label": name, "method": method, "kv_cache_dtype": kv, "error": None}
        t = time.perf_counter()
        try:
            engines[name] = build(method, kv, model, dtype, max(512, window_len + 1))
        except (TypeError, ValueError, NotImplementedError, ImportError) as e:
            if method is None and kv == "auto":
                raise   # without the reference there is nothing to compare against
            row["error"] = f"{type(e).__name__}: {e}"   # a method not (yet) available here
        row["build_s"] = time.perf_counter() - t
        rows[name] = row
        _progress(f"built {name} in {row['build_s']:.1f} s" + (f" ({row['error']:.80})"
                                                              if row["error"] else ""))
    ref_name = label(None, "auto", dtype)
    reference = engines[ref_name]
    tok = reference.get_tokenizer()
    prompt_ids = tok.encode(PROMPT) if tok is not None else list(range(1, 33))
    result["prompt_tokens"] = len(prompt_ids)

    # Quality: the reference runs once per window, each variant against it (num_windows=0: skip).
    others = {n: e for n, e in engines.items() if n != ref_name}
    quality = {}
    if num_windows and others:
        _progress(f"evaluating {len(others)} variants on {num_windows} x {window_len} tokens")
        quality = compare_many(reference, others, heldout_windows(tok, num_windows, window_len))
    for name, llm in engines.items():
        row, m = rows[name], llm.engine.model
        row.update(weight_bytes=model_bytes(m), decode_read_bytes=decode_read_bytes(m),
                   kv_bytes_per_token=kv_bytes_per_token(llm))
        if name in quality:
            q = quality[name]
            row.update(ppl=q.ppl_candidate, mean_kl=q.mean_kl, max_kl=q.max_kl,
                       top1_agreement=q.top1_agreement)
    first = next(iter(quality.values()), None)
    if first is not None:
        rows[ref_name].update(mean_kl=0.0, max_kl=0.0, top1_agreement=1.0,
                              ppl=first.ppl_reference)

    # Speed: round-robin over the variants, `repeats` rounds, after one warm-up each.
    _progress(f"decoding: {repeats} rounds of {len(engines)} variants x {new_tokens} tokens")
    for llm in engines.values():
        engine_once(llm, prompt_ids, 8)
    rounds = []
    for _ in range(repeats):
        rounds.append({name: engine_once(llm, prompt_ids, new_tokens)
                       for name, llm in engines.items()})
    context = len(prompt_ids) + new_tokens // 2   # mean context length while decoding
    for name in engines:
        row = rows[name]
        decode = statistics.median(r[name]["decode_tok_s"] for r in rounds)
        speedups = [r[name]["decode_tok_s"] / r[ref_name]["decode_tok_s"] for r in rounds]
        per_token = decode_bytes_per_token(row["decode_read_bytes"], row["kv_bytes_per_token"],
                                           context)
        row.update(decode_tok_s=decode, speedup=statistics.median(speedups), speedups=speedups,
                   bytes_per_token=per_token, achieved_gbs=per_token * decode / 1e9,
                   same_greedy_tokens=_agreeing_prefix(rounds[-1][name]["tokens"],
                                                       rounds[-1][ref_name]["tokens"]))
    result["rows"] = [rows[label(m, kv, dtype)] for m, kv in pairs]
    return result


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(r: dict) -> str:
    lines = [f"quantization: {r['model']}, {r['num_windows']} held-out windows x "
             f"{r['window_len']} tokens of CPython {r['python']} docs; single-stream decode "
             f"({r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, batch 1, "
             f"{r['threads']} threads, {r['repeats']} rounds)",
             f"measured copy bandwidth: {r['copy_bandwidth_gbs']:.1f} GB/s (read + write)", "",
             f"{'variant':<18}{'ppl':>8}{'mean KL':>10}{'top-1':>8}{'stored MB':>11}"
             f"{'read MB':>9}{'KV B/tok':>10}{'decode tok/s':>14}{'speedup':>9}{'GB/s':>7}"
             f"{'greedy =':>10}"]
    for row in r["rows"]:
        if row.get("error"):
            lines.append(f"{row['label']:<18}unavailable: {row['error']:.80}")
            continue
        lines.append(
            f"{row['label']:<18}{_fmt(row.get('ppl'), '.3f'):>8}"
            f"{_fmt(row.get('mean_kl'), '.5f'):>10}{_fmt(row.get('top1_agreement'), '.2%'):>8}"
            f"{row['weight_bytes'] / 1e6:>11.1f}{row['decode_read_bytes'] / 1e6:>9.1f}"
            f"{row['kv_bytes_per_token']:>10.0f}"
            f"{row['decode_tok_s']:>14.1f}{row['speedup']:>8.2f}x{row['achieved_gbs']:>7.2f}"
            f"{row['same_greedy_tokens']:>6}/{r['new_tokens']}")
    lines += ["",
              "mean KL: over held-out positions, KL(bf16 || variant) in nats; top-1: share of "
              "positions whose argmax agrees with bf16",
              "stored MB: every weight tensor held (a quantized LM head is a copy beside the tied "
              "embedding); read MB: weights one decode step reads",
              "speedup: median over rounds of decode tok/s / bf16's in the same round; GB/s: "
              "(read + KV of the mean context) bytes x decode tok/s",
              "greedy =: greedy tokens equal to bf16's before the first difference"]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench.quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="*", default=[m for m in METHODS if m],
                    help="quantization methods besides the bf16 reference, with options: "
                         "int4-g32, int4-g32-bf16head")
    ap.add_argument("--kv-dtypes", nargs="*", default=list(KV_DTYPES))
    ap.add_argument("--windows", type=int, default=NUM_WINDOWS,
                    help="held-out windows for the quality columns; 0 measures speed only")
    ap.add_argument("--window-len", type=int, default=WINDOW_LEN)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    result = run(methods=args.methods, kv_dtypes=args.kv_dtypes, num_windows=args.windows,
                 window_len=args.window_len, repeats=args.repeats, new_tokens=args.new_tokens,
                 threads=args.threads)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
