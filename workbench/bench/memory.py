"""python -m workbench.bench memory [--quick] [--json results/cpu/memory-....json]

The memory hierarchy's three measurements on SmolLM2-135M, in one run and one process:

- weight offload: decode tokens/s against batch size, resident and with most layers streamed from
  the slow tier (disk on a CPU-only machine), alternating; with the cost model's predictions
  (pure roofline, and compute scaled to the measured resident step);
- KV tiers: time to first token of a conversation's next turn after its context was evicted,
  recomputed, loaded from the CPU tier and loaded from the disk tier, against context length;
- KV compression: perplexity against KV bytes per token for uniform formats, per-layer plans,
  cross-layer sharing (without retraining, and after a short distillation of the sharing layers)
  and low-rank keys, against the model's dtype.
Ratios are against the baselines measured in the same run (resident, recompute, model dtype).
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from workbench.bench.machine import machine_info, measured_commit
from workbench.experiments.cla_distill import distill_sharing
from workbench.experiments.kv_compression import compression_table, format_table, sharing_map
from workbench.experiments.kv_tiers import measure_tier_ttft
from workbench.experiments.offload_cost import format_rows, measure_offload_curve
from workbench.llm import LLM


def offload_section(model: str, batch_sizes: list[int], decode_tokens: int, seed: int) -> dict:
    probe = LLM(model=model, verbose=False, num_kv_blocks=1)
    # about three quarters of the layers, in whatever dtype the machine's default picks
    layer_bytes = sum(p.numel() * p.element_size() for p in probe.engine.model.layers[0].parameters())
    num_layers = len(probe.engine.model.layers)
    probe.close()
    offload_gb = (3 * num_layers // 4) * layer_bytes / 2**30

    def factory(offload: bool):
        extra = dict(cpu_offload_gb=offload_gb) if offload else dict(fused_decode=False)
        # one torch thread: the prefetch thread then has a core of its own on a 2-core machine
        return LLM(model=model, verbose=False, max_num_seqs=max(batch_sizes), max_model_len=64,
                   num_threads=1, **extra)

    rows = measure_offload_curve(factory, batch_sizes, prompt_len=16, decode_tokens=decode_tokens,
                                 seed=seed)
    print(format_rows(rows, f"offload: slow tier {rows[0]['slow_bandwidth'] / 1e9:.2f} GB/s, "
                            f"compute {rows[0]['flops'] / 1e9:.0f} GFLOP/s"))
    resident = {r["batch_size"]: r["measured_tokens_per_s"] for r in rows if r["weights"] == "resident"}
    for r in rows:
        r["ratio_to_resident"] = r["measured_tokens_per_s"] / resident[r["batch_size"]]
    return {"cpu_offload_gb": offload_gb, "rows": rows}


def tier_section(contexts: list[int], seed: int) -> dict:
    result = measure_tier_ttft(contexts, seed=seed)
    print(f"KV tiers: {result['kv_bytes_per_token']} bytes per token, page cache dropped: "
          f"{result['drop_page_cache']}")
    print("context  recompute ms  cpu ms  disk ms  recompute/cpu  recompute/disk")
    for r in result["rows"]:
        r["recompute_over_cpu"] = r["recompute_s"] / r["cpu_s"]
        r["recompute_over_disk"] = r["recompute_s"] / r["disk_s"]
        print(f"{r['context_tokens']:7d}  {1e3 * r['recompute_s']:12.1f}  {1e3 * r['cpu_s']:6.1f}  "
              f"{1e3 * r['disk_s']:7.1f}  {r['recompute_over_cpu']:13.1f}  "
              f"{r['recompute_over_disk']:14.1f}")
    return result


def distilled_sharing_row(llm, rows: list[dict], num_windows: int, window_len: int,
                          steps: int, seed: int) -> dict:
    """The deep-pair sharing row again after `steps` distillation steps of its sharing layers,
    scored on the same held-out windows as the table."""
    n = len(llm.engine.model.layers)
    setting = f"groups of 2, layers {n // 2}+"
    untrained = next(r for r in rows if r["method"] == "cross-layer sharing" and r["setting"] == setting)
    start = time.perf_counter()
    result = distill_sharing(llm, sharing_map(n, 2, n // 2), steps=steps, seq_len=window_len,
                             num_sequences=4 * steps, eval_windows=num_windows,
                             eval_len=window_len, seed=seed)
    base = rows[0]["perplexity"]
    return {"method": "cross-layer sharing", "setting": f"{setting}, distilled {steps} steps",
            "kv_bytes_per_token": untrained["kv_bytes_per_token"], "ratio": untrained["ratio"],
            "perplexity": result["after"], "delta": result["after"] - base,
            "perplexity_before": result["before"], "kl_before": result["kl_before"],
            "kl_after": result["kl_after"], "trained_params": result["trained_params"],
            "train_s": time.perf_counter() - start}


def compression_section(model: str, quick: bool, seed: int) -> dict:
    num_windows, window_len = (1, 64) if quick else (2, 128)
    with LLM(model=model, verbose=False) as llm:
        rows = compression_table(llm, num_windows=num_windows, window_len=window_len,
                                 calibration_windows_count=2 if quick else 4,
                                 counts=(12,) if quick else (6, 12),
                                 ranks=(16, 48) if quick else (16, 32, 48))
        rows.append(distilled_sharing_row(llm, rows, num_windows, window_len,
                                          4 if quick else 32, seed))
        dtype = str(llm.engine.dtype)
    print(format_table(rows))
    return {"dtype": dtype, "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a couple of minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    commit = measured_commit()
    batches = [1, 16] if args.quick else [1, 4, 16, 64]
    contexts = [64, 256] if args.quick else [128, 512, 1024]
    result = {"workload": "memory", "model": args.model, "quick": args.quick,
              "torch": torch.__version__,
              "offload": offload_section(args.model, batches, 6 if args.quick else 12, args.seed),
              "kv_tiers": tier_section(contexts, args.seed),
              "kv_compression": compression_section(args.model, args.quick, args.seed),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(commit)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
