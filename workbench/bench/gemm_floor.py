"""The matmul floor of offline-mixed: python -m workbench.bench floor

How fast could the engine serve offline-mixed on this CPU if everything but the matmuls were free?
Count the workload's matmul FLOPs (the projections for every prompt token and every generated token
fed back, the LM head once per generated token), measure this CPU's GEMM rate (bf16 where native,
else fp32) on the model's
shapes at the batch sizes the run has (decode steps at its mean batch, prefill chunks at the token
budget), and divide. Two GEMM paths are measured: aten's `F.linear` over the plain weight, and
oneDNN's linear over a weight prepacked once (what `freeze_weights=True` compiles to).

The floor in tok/s against transformers' measured rate says whether the offline-mixed target
(8x transformers' static batches) is reachable by cutting overhead at all, or only by faster
matmuls.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from workbench.bench.machine import machine_info, measured_commit
from workbench.bench.offline_mixed import make_requests
from workbench.config import cpu_has_native_bf16
from workbench.models.registry import RANDOM_COMMON, RANDOM_PRESETS


def projection_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused projections: qkv, o, gate_up, down."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, \
        cfg["intermediate_size"]
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]


def workload_flops(cfg: dict, requests) -> dict:
    """Matmul FLOPs of serving `requests` [(prompt ids, output length)] with this model."""
    proj = cfg["num_hidden_layers"] * sum(n * k for n, k in projection_shapes(cfg))
    head = cfg["vocab_size"] * cfg["hidden_size"]
    prompt = sum(len(p) for p, _ in requests)
    fed_back = sum(out - 1 for _, out in requests)      # the last token is never fed back
    generated = sum(out for _, out in requests)
    return {"prefill_flop": 2 * proj * prompt,
            "decode_flop": 2 * proj * fed_back + 2 * head * generated,
            "prompt_tokens": prompt, "output_tokens": generated}


def gemm_rate(cfg: dict, rows: int, packed: bool, repeats: int = 5,
              dtype: torch.dtype | None = None) -> float:
    """GFLOP/s of one pass over every layer's projections and the LM head at `rows` rows, in
    `dtype` (default: bf16 where the CPU has it natively, where oneDNN also prepacks it; else fp32)."""
    dtype = dtype or (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    torch.manual_seed(0)
    shapes = projection_shapes(cfg) * cfg["num_hidden_layers"]
    shapes.append((cfg["vocab_size"], cfg["hidden_size"]))
    weights = [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in shapes]
    xs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for _, k in shapes}}
    if packed:
        prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]

        def one_pass():
            for w, p in zip(weights, prepacked):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
    else:
        def one_pass():
            for w in weights:
                F.linear(xs[w.shape[1]], w)
    with torch.inference_mode():
        one_pass()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - t)
    return 2 * rows * sum(n * k for n, k in shapes) / statistics.median(times) / 1e9


def run(model: str = "smollm2-135m", num_requests: int = 64, decode_rows: int = 36,
        prefill_rows: int = 1024, repeats: int = 5) -> dict:
    cfg = {**RANDOM_COMMON, **RANDOM_PRESETS[model]}
    flops = workload_flops(cfg, make_requests(num_requests))
    out = {"model": model, "num_requests": num_requests, "decode_rows": decode_rows,
           "prefill_rows": prefill_rows, "threads": torch.get_num_threads(), **flops, "paths": {}}
    for name, packed in (("aten linear", False), ("prepacked (oneDNN)", True)):
        dec = gemm_rate(cfg, decode_rows, packed, repeats)
        pre = gemm_rate(cfg, prefill_rows, packed, repeats)
        seconds = flops["decode_flop"] / (dec * 1e9) + flops["prefill_flop"] / (pre * 1e9)
        out["paths"][name] = {"decode_gflops": dec, "prefill_gflops": pre,
                              "matmul_seconds": seconds,
                              "floor_tok_s": flops["output_tokens"] / seconds}
    return out


def format_table(r: dict) -> str:
    total = (r["prefill_flop"] + r["decode_flop"]) / 1e12
    lines = [f"offline-mixed ({r['num_requests']} requests, {r['prompt_tokens']:,} prompt and "
             f"{r['output_tokens']:,} output tokens) on {r['model']}: {total:.2f} TFLOP of matmuls; "
             f"GEMM rates at {r['decode_rows']} rows (decode) and {r['prefill_rows']} "
             f"(prefill), {r['threads']} threads", "",
             f"{'path':<22}{'decode GFLOP/s':>16}{'prefill GFLOP/s':>17}{'matmuls alone':>15}"
             f"{'floor tok/s':>13}"]
    for name, p in r["paths"].items():
        lines.append(f"{name:<22}{p['decode_gflops']:>16.0f}{p['prefill_gflops']:>17.0f}"
                     f"{p['matmul_seconds']:>14.1f}s{p['floor_tok_s']:>13.0f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="python -m workbench.bench floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-rows", type=int, default=36, help="offline-mixed's mean batch")
    ap.add_argument("--prefill-rows", type=int, default=1024, help="its max_num_batched_tokens")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    import datetime
    commit = measured_commit()
    result = run(decode_rows=args.decode_rows, prefill_rows=args.prefill_rows)
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["machine"] = machine_info(commit)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
