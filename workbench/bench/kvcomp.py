"""The KV compression table: per-layer formats, cross-layer sharing and low-rank keys against the
model-dtype cache, KV bytes per token and perplexity on held-out CPython documentation
(experiments/kv_compression.py).

    python -m workbench.bench kvcomp [--windows 2] [--window-len 128] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

from workbench.experiments.kv_compression import compression_table, format_table
from workbench.llm import LLM


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench kvcomp", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=2, help="held-out windows for perplexity")
    ap.add_argument("--window-len", type=int, default=128)
    ap.add_argument("--sensitivity-windows", type=int, default=1,
                    help="windows for the per-layer sensitivities (one forward per layer each)")
    ap.add_argument("--calibration-windows", type=int, default=4, help="for the key bases")
    ap.add_argument("--counts", type=int, nargs="+", default=[6, 12],
                    help="layers kept at INT8 in the per-layer plans (the rest INT4)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 48])
    ap.add_argument("--groups", type=int, nargs="+", default=[2], help="sharing group sizes")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    llm = LLM(model=args.model, verbose=False, max_model_len=max(256, args.window_len))
    start = time.perf_counter()
    rows = compression_table(llm, args.windows, args.window_len, args.sensitivity_windows,
                             args.calibration_windows, tuple(args.counts), tuple(args.ranks),
                             tuple(args.groups))
    print(format_table(rows))
    print(f"({time.perf_counter() - start:.0f} s, {args.windows} windows of {args.window_len} "
          f"tokens, model dtype {llm.engine.dtype})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
