"""The speed ladder: one row per optimization on the single-stream workload, and the targets.

Rows (batch 1, the single-stream prompt, greedy, `new_tokens` tokens), run round-robin in one
process so that every row sees the same machine noise, `repeats` rounds, medians reported:

    transformers generate()       fp32 and bf16: what a user has without an inference engine
    engine, eager                 fp32, bf16 (torch's matmuls), bf16 + the AVX-512 GEMV kernels
    engine, compiled              bf16 + GEMV, then + the C++ paged decode attention, INT8 weights,
                                  INT4 weights (compile=True: models/compile.py; quantized layers
                                  run the INT8/INT4 loops of kernels/cpu and decode attention the
                                  C++ paged kernel, where they build)
    engine, fused step            bf16 + GEMV + paged attention with every decode step one C++
                                  call (fused_decode=True: models/fused_decode.py), not compiled
    llama.cpp                     Q4_1 GGUF through llama-cpp-python, if installed

Each row reports end-to-end tok/s (prefill included), decode tok/s, and the bandwidth it achieves:
(weight bytes + KV bytes of the context) x decode tok/s, against the measured copy bandwidth.

Then the offline-mixed workload: the engine (compiled bf16 with frozen, prepacked weights,
continuous batching, decode attention in the C++ paged kernel of kernels/cpu where it builds:
attention_backend="cpu") against
transformers' generate() in static padded batches of 8 (two alternating pairs, the median of
their ratios) and llama.cpp serving the requests one after another. Last, the issue's targets,
each with what was measured and whether it was met.
"""
from __future__ import annotations

import statistics

import torch

from . import llamacpp
from .anatomy import anatomy
from .bandwidth import copy_bandwidth, decode_bytes_per_token
from .offline_mixed import alternating_pairs, engine_run, make_requests
from .single_stream import PROMPT, engine_once, hf_once

ENGINE_ROWS = {   # label -> LLM keyword arguments; each row adds one optimization to the last
    "engine eager fp32": dict(dtype="float32"),
    "engine eager bf16": dict(dtype="bfloat16", cpu_gemv=False),
    "engine eager bf16 + GEMV": dict(dtype="bfloat16", cpu_gemv=True),
    "engine compiled bf16 + GEMV": dict(dtype="bfloat16", compile=True, cpu_gemv=True),
    "engine compiled bf16 + GEMV + paged attn": dict(dtype="bfloat16", compile=True,
                                                     cpu_gemv=True, attention_backend="cpu"),
    # The whole decode step as one C++ call (fused_decode); prefill eager: no compile at all.
    "engine fused step bf16 + GEMV + paged attn": dict(dtype="bfloat16", cpu_gemv=True,
                                                       attention_backend="cpu",
                                                       fused_decode=True),
    # The quantized rows keep the C++ paged attention and the INT8/INT4 loops (cpu_gemv) where
    # they build; elsewhere attention "auto" and aten's INT8/INT4 kernels.
    "engine compiled INT8": dict(dtype="bfloat16", compile=True, quantization="int8",
                                 attention_backend="cpu", cpu_gemv=True),
    "engine compiled INT4": dict(dtype="bfloat16", compile=True, quantization="int4",
                                 attention_backend="cpu", cpu_gemv=True),
    # The fused step over the INT8 / INT4 GEMV loops (the same C++ step, other weights).
    "engine fused step INT8 + paged attn": dict(dtype="bfloat16", quantization="int8",
                                                attention_backend="cpu", cpu_gemv=True,
                                                fused_decode=True),
    "engine fused step INT4 + paged attn": dict(dtype="bfloat16", quantization="int4",
                                                attention_backend="cpu", cpu_gemv=True,
                                                fused_decode=True),
}
HF_ROWS = {"transformers fp32": torch.float32, "transformers bf16": torch.bfloat16}
LLAMA_ROW = "llama.cpp Q4_1"


def _build(rows: dict, model: str, threads: int, llama_cpp: bool = True):
    from transformers import AutoModelForCausalLM

    from kernels.cpu import available

    from ..llm import LLM
    runners = {}
    gemv, why_not = available()
    for label, kwargs in rows.items():
        if kwargs.get("fused_decode") and not gemv:
            print(f"[speed] skipping row {label!r}: the CPU kernels cannot run here ({why_not})")
            continue
        if kwargs.get("quantization") and not gemv:     # aten's kernels and "auto" attention
            kwargs = {**kwargs, "attention_backend": "auto", "cpu_gemv": False}
        if kwargs.get("cpu_gemv") and not gemv:
            print(f"[speed] skipping row {label!r}: the CPU kernels cannot run here ({why_not})")
            continue
        if kwargs.get("attention_backend") == "cpu" and not gemv:
            kwargs = {**kwargs, "attention_backend": "auto"}
        llm = LLM(model=model, device="cpu", verbose=False, max_model_len=1024, **kwargs)
        runners[label] = ("engine", llm)
    checkpoint = llm.engine.checkpoint
    for label, dtype in HF_ROWS.items():
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).eval()
        runners[label] = ("hf", hf)
    llama = llamacpp.load(threads) if llama_cpp else None
    if llama is not None:
        runners[LLAMA_ROW] = ("llama", llama)
    return runners


def _once(kind, runner, prompt_ids, new_tokens):
    if kind == "engine":
        return engine_once(runner, prompt_ids, new_tokens)
    if kind == "hf":
        return hf_once(runner, prompt_ids, new_tokens)
    return llamacpp.generate(runner, prompt_ids, new_tokens)


def ladder(model: str = "smollm2-135m", new_tokens: int = 128, repeats: int = 3,
           rows: dict | None = None, llama_cpp: bool = True) -> dict:
    threads = torch.get_num_threads()
    runners = _build(rows or ENGINE_ROWS, model, threads, llama_cpp)
    first = next(r for k, r in runners.values() if k == "engine")
    prompt_ids = first.get_tokenizer().encode(PROMPT)
    for kind, runner in runners.values():           # warm up: compile, allocate, pick kernels
        _once(kind, runner, prompt_ids, 8)
    runs = {label: [] for label in runners}
    # The copy bandwidth is measured right before every engine row's run, and each run's achieved
    # bandwidth is compared with its own: a shared VM's memory bandwidth moves within seconds (30
    # to 56 GB/s seen on the AMD VM within one round of this ladder), so one measurement per round
    # could be from the other mode than the row it is compared with.
    bandwidths = {label: [] for label, (kind, _) in runners.items() if kind == "engine"}
    for _ in range(repeats):
        for label, (kind, runner) in runners.items():
            if kind == "engine":
                bandwidths[label].append(copy_bandwidth())
            runs[label].append(_once(kind, runner, prompt_ids, new_tokens))
    every = [bw for bws in bandwidths.values() for bw in bws]
    bandwidth = statistics.median(every)
    context = len(prompt_ids) + new_tokens // 2
    out = {"threads": threads, "new_tokens": new_tokens, "repeats": repeats,
           "prompt_tokens": len(prompt_ids), "copy_bandwidth_gbs": bandwidth,
           "copy_bandwidth_range_gbs": [min(every), max(every)], "rows": {}}
    for label, rs in runs.items():
        row = {"tok_s": statistics.median(r["tok_s"] for r in rs),
               "decode_tok_s": statistics.median(r.get("decode_tok_s", float("nan")) for r in rs)
               if "decode_tok_s" in rs[0] else None}
        kind, llm = runners[label]
        if kind == "engine":          # bytes read per token are known only for our own engine
            row["attention_backend"] = llm.engine.runner.backend.name
            per_token = decode_bytes_per_token(
                llm.engine.model.weight_bytes(),
                llm.engine.model_args.kv_bytes_per_token(llm.engine.dtype), context)
            row["achieved_gbs"] = per_token * row["decode_tok_s"] / 1e9
            # each run's decode speed against the bandwidth measured just before it
            row["fraction_of_copy_bandwidth"] = statistics.median(
                per_token * r["decode_tok_s"] / 1e9 / bw for r, bw in zip(rs, bandwidths[label]))
            row["decode_tok_s_per_round"] = [r["decode_tok_s"] for r in rs]
            row["copy_bandwidth_per_round_gbs"] = bandwidths[label]
        out["rows"][label] = row
    # Ratios from the same rounds (round i of one row against round i of the other).
    def ratio(a, b):
        if a not in runs or b not in runs:
            return None
        return statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(runs[a], runs[b]))
    int4 = _fastest(out["rows"], "INT4")
    out["int4_vs_llamacpp"] = ratio(int4, LLAMA_ROW) if int4 else None
    out["gemv_vs_torch_bf16"] = ratio("engine eager bf16 + GEMV", "engine eager bf16")
    out["best_bf16_row"] = _fastest(out["rows"], "bf16")
    out["anatomy"] = {label: anatomy(runners[label][1], prompt_ids, 48)
                      for label in ("engine eager bf16", out["best_bf16_row"]) if label in runs}
    return out


def _fastest(rows: dict, kind: str) -> str | None:
    """The engine row of this kind ("bf16", "INT4") with the highest decode speed."""
    mine = [k for k in rows if k.startswith("engine") and kind in k]
    return max(mine, key=lambda k: rows[k]["decode_tok_s"]) if mine else None


def offline(model: str = "smollm2-135m", num_requests: int = 64, compile: bool = True,
            pairs: int = 2) -> dict:
    """offline-mixed: the engine (bf16, continuous batching, the CPU paged decode kernel where it
    builds) against transformers in static batches of 8 and llama.cpp one request after another,
    all on this process's threads.

    The engine and transformers run in `pairs` alternating pairs (engine first, then transformers
    first, ...) and the ratio is the median of the pairs' ratios: this class of VM changes speed
    by up to 20% from one minute to the next (run 13's copy bandwidth read 27-54 GB/s), and two
    runs minutes apart would measure that, not the engine. "engine" and "transformers" keep the
    first pair's run records, with tok_s the median over pairs and every run's tok_s listed."""
    from transformers import AutoModelForCausalLM

    from kernels.cpu import available
    from ..llm import LLM
    from ..models.loader import resolve_checkpoint
    requests = make_requests(num_requests)
    backend = "cpu" if available()[0] else "torch"
    llm = LLM(model=model, dtype="bfloat16", device="cpu", verbose=False, max_model_len=512,
              max_num_seqs=64, max_num_batched_tokens=1024, compile=compile,
              freeze_weights=compile, attention_backend=backend)
    engine_run(llm, requests[:4])                            # warm-up (and compile)
    hf = AutoModelForCausalLM.from_pretrained(
        str(resolve_checkpoint(model)),
        dtype=torch.bfloat16).eval()
    pair_runs = alternating_pairs(llm, hf, requests, pairs)
    runs = {"engine": [e for e, _ in pair_runs], "transformers": [h for _, h in pair_runs]}
    del llm, hf
    out = {"num_requests": num_requests, "pairs": pairs,
           "ratio_pairs": [e["tok_s"] / h["tok_s"]
                           for e, h in zip(runs["engine"], runs["transformers"])]}
    out["ratio_vs_transformers"] = statistics.median(out["ratio_pairs"])
    for name, rs in runs.items():
        out[name] = dict(rs[0], tok_s=statistics.median(r["tok_s"] for r in rs),
                         runs_tok_s=[r["tok_s"] for r in rs])
    out["engine"]["attention_backend"] = backend
    out["engine"]["freeze_weights"] = compile
    llama = llamacpp.load(torch.get_num_threads())
    out["llama.cpp"] = llamacpp.run_sequential(llama, requests) if llama is not None else None
    return out


TARGETS = [   # (name, how to read it from the results, the bar)
    ("single-stream INT4 tok/s vs llama.cpp", lambda r: r["ladder"]["int4_vs_llamacpp"], 1.0),
    ("single-stream bf16 decode, share of copy bandwidth",
     lambda r: r["ladder"]["rows"][r["ladder"]["best_bf16_row"]]["fraction_of_copy_bandwidth"],
     0.70),
    ("offline-mixed vs transformers static batches (pairs)",
     lambda r: r["offline"]["ratio_vs_transformers"], 8.0),
    ("offline-mixed vs llama.cpp one by one",
     lambda r: (r["offline"]["engine"]["tok_s"] / r["offline"]["llama.cpp"]["tok_s"]
                if r["offline"]["llama.cpp"] else None), 3.0),
]


def run(model: str = "smollm2-135m", new_tokens: int = 128, repeats: int = 3,
        num_requests: int = 64, skip_offline: bool = False, **_) -> dict:
    result = {"workload": "speed", "ladder": ladder(model, new_tokens, repeats)}
    if not skip_offline:
        result["offline"] = offline(model, num_requests)
    result["targets"] = []
    for name, read, bar in TARGETS:
        try:
            value = read(result)
        except (KeyError, TypeError):
            value = None
        result["targets"].append({"target": name, "measured": value, "bar": bar,
                                  "met": None if value is None else value >= bar})
    return result


def format_table(r: dict) -> str:
    lad = r["ladder"]
    lines = [f"speed ladder: single-stream ({lad['prompt_tokens']}-token prompt, "
             f"{lad['new_tokens']} new tokens, greedy, batch 1), {lad['threads']} threads, "
             f"{lad['repeats']} rounds round-robin; copy bandwidth (read + write) measured "
             f"before every engine run: median {lad['copy_bandwidth_gbs']:.1f} GB/s, range "
             + "-".join(f"{b:.1f}" for b in lad.get("copy_bandwidth_range_gbs", [])) + " GB/s; "
             "'of copy BW': median over rounds of each run against its own measurement", "",
             f"{'row':<42}{'tok/s':>8}{'decode tok/s':>14}{'GB/s':>7}{'of copy BW':>12}"]
    for label, row in lad["rows"].items():
        dec = row.get("decode_tok_s")
        gbs = row.get("achieved_gbs")
        lines.append(f"{label:<42}{row['tok_s']:>8.1f}"
                     + (f"{dec:>14.1f}" if dec else f"{'-':>14}")
                     + (f"{gbs:>7.1f}{row['fraction_of_copy_bandwidth']:>11.0%}" if gbs
                        else f"{'-':>7}{'-':>12}"))
    for label, a in lad.get("anatomy", {}).items():
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in a["parts_s"].items())
        lines.append(f"\nwhere a decode step goes, {label} ({a['step_s'] * 1e3:.1f} ms): {parts} ms")
    if "offline" in r:
        o = r["offline"]
        lines += ["", f"offline-mixed ({o['num_requests']} requests): engine "
                  f"{o['engine']['tok_s']:.1f} tok/s (mean batch {o['engine']['mean_batch']:.1f}, "
                  f"attention_backend={o['engine'].get('attention_backend', 'torch')!r}), "
                  f"transformers static batches of 8 {o['transformers']['tok_s']:.1f} tok/s "
                  f"(medians of {o.get('pairs', 1)} alternating pairs; ratio per pair "
                  + ", ".join(f"{x:.2f}x" for x in o.get("ratio_pairs", [])) + "), "
                  "llama.cpp one by one "
                  + (f"{o['llama.cpp']['tok_s']:.1f} tok/s" if o["llama.cpp"] else "skipped "
                     "(pip install llama-cpp-python)")]
    return "\n".join(lines + format_targets(r["targets"]))


def format_targets(targets: list[dict]) -> list[str]:
    """The targets table: measured against the bar, met, not met, or skipped (None)."""
    lines = ["", f"{'target':<52}{'measured':>10}{'bar':>8}  met"]
    for t in targets:
        m = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        met = "skipped" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"{t['target']:<52}{m:>10}{t['bar']:>8.2f}  {met}")
    return lines


def main(argv=None) -> None:
    import argparse
    import datetime
    import json
    import os
    import platform
    ap = argparse.ArgumentParser(prog="python -m workbench.bench speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the ladder (default 3)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=64, help="offline-mixed requests")
    ap.add_argument("--skip-offline", action="store_true", help="only the single-stream ladder")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    result = run(args.model, args.new_tokens, args.repeats, args.num_requests, args.skip_offline)
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["machine"] = {"processor": platform.processor() or platform.machine(),
                         "cores": os.cpu_count(), "torch": torch.__version__,
                         "python": platform.python_version()}
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
