"""python -m workbench.bench [single-stream|offline-mixed|kernels] [--dtypes ...] [--repeats N] [--json F]

single-stream: batch 1 decode speed and achieved bandwidth vs transformers' generate().
offline-mixed: throughput on 64 mixed-length requests vs transformers in static batches of 8,
               and the KV capacity of paging vs contiguous reservation.
kernels:       (CUDA only) FlashAttention forward TFLOP/s vs SDPA, paged decode GB/s vs copy.
quant:         every quantization method and KV dtype vs bf16: KL, perplexity, top-1, bytes,
               decode tok/s and GB/s (its own options: python -m workbench.bench quant --help).
compress:      every pruning method and pattern vs the dense model: KL, perplexity, top-1, bytes
               dense and compressed, decode speedup at batch 1 and 16 (--help for options).
parallel:      tensor/pipeline/expert-parallel layouts vs one process: tok/s, the share of time
               in collectives, bytes per step (python -m workbench.bench parallel --help).
spec:          speculative decoding: every drafter vs plain decoding on single-stream, and the
               speedup against batch size (python -m workbench.bench spec --help).
speed:         the speed ladder (eager, compiled, bf16, INT8, INT4, transformers, llama.cpp),
               where a decode step's time goes, offline-mixed against both peers, and the
               performance targets met or not (python -m workbench.bench speed --help).
kvcomp:        KV cache compression: per-layer formats, cross-layer sharing, low-rank keys;
               bytes per token against perplexity (python -m workbench.bench kvcomp --help).
floor:         offline-mixed's matmul floor: its FLOPs over this CPU's bf16 GEMM rate on the
               model's shapes, aten's and prepacked (python -m workbench.bench floor --help).
table:         results/README.md from the committed results/**/*.json: every speed run with its
               machine, versions, commit and targets, newest first (--check: exit 1 if stale).
soak:          a SmolLM2 server under 128 concurrent clients mixing good requests with abuse:
               every request completed, rejected, disconnected or lost; KV and RSS per round
               (python -m workbench.bench soak --help).
memory:        the memory hierarchy on SmolLM2: offloaded weights' tokens/s against batch,
               the next turn's TTFT recomputed or loaded from the CPU and disk KV tiers, and
               KV compression's perplexity against bytes (python -m workbench.bench memory --help).
gpu:           (CUDA) batch-1 decode and offline-mixed, eager and with CUDA graphs, on random
               weights in SmolLM2-135M's and a 1B Llama's shapes, against transformers; the
               GPU targets met or not (python -m workbench.bench gpu --help).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch

from workbench.bench import (
    compress,
    gemm_floor,
    gpu,
    kernels,
    kvcomp,
    memory,
    offline_mixed,
    parallel,
    quant,
    single_stream,
    soak,
    spec,
    speed,
    table,
)

WORKLOADS = {"single-stream": single_stream, "offline-mixed": offline_mixed, "kernels": kernels}


def main(argv=None) -> None:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["quant"]:
        return quant.main(argv[1:])
    if argv[:1] == ["parallel"]:
        return parallel.main(argv[1:])
    if argv[:1] == ["spec"]:
        return spec.main(argv[1:])
    if argv[:1] == ["compress"]:
        return compress.main(argv[1:])
    if argv[:1] == ["kvcomp"]:
        return kvcomp.main(argv[1:])
    if argv[:1] == ["floor"]:
        return gemm_floor.main(argv[1:])
    if argv[:1] == ["gpu"]:
        return gpu.main(argv[1:])
    if argv[:1] == ["speed"]:
        return speed.main(argv[1:])
    if argv[:1] == ["memory"]:
        return memory.main(argv[1:])
    if argv[:1] == ["soak"]:
        return soak.main(argv[1:])
    if argv[:1] == ["table"]:
        return table.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m workbench.bench", description=__doc__)
    ap.add_argument("workload", nargs="?", default="single-stream", choices=sorted(WORKLOADS))
    ap.add_argument("--dtypes", nargs="+", default=None,
                    help="default: float32 and bfloat16 (single-stream), bfloat16 (offline-mixed)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="alternating pairs; default 3 (single-stream), 1 (offline-mixed)")
    ap.add_argument("--num-requests", type=int, default=64, help="offline-mixed only")
    ap.add_argument("--new-tokens", type=int, default=single_stream.NEW_TOKENS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.workload == "kernels":
        result = kernels.run()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    module = WORKLOADS[args.workload]
    kwargs = {"model": args.model, "new_tokens": args.new_tokens}
    if args.workload == "offline-mixed":
        kwargs["num_requests"] = args.num_requests
    if args.dtypes:
        kwargs["dtypes"] = args.dtypes
    if args.repeats:
        kwargs["repeats"] = args.repeats
    result = module.run(**kwargs)
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["machine"] = {"processor": platform.processor() or platform.machine(),
                         "torch": torch.__version__, "python": platform.python_version()}
    print(module.format_table(result))
    if args.json:
        for d in result["dtypes"].values():
            d.pop("tokens", None)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
