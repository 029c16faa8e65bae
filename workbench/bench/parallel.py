"""Parallel layouts against the single-process engine, in one run on one machine.

For each layout (tensor, pipeline, expert parallel), the same greedy workload: B prompts of the
offline set decoded together, N new tokens each, fp32 so that the tokens must equal the single
process's. Printed per layout: decode tokens/s and its ratio to one process, the share of the
workers' busy time spent inside collectives, bytes moved per step, and token equality.
The expert-parallel rows compare against the single-process MoE model (moe_config), not dense.

    python -m workbench.bench parallel [--layouts tp3 pp2 pp3 tp3xpp1 ep2] [--batch 8]
                                       [--new-tokens 32] [--repeats 2] [--json out.json]

On a CPU, workers share its cores and every gloo all-reduce costs a round trip between processes
(this run's share of time in collectives says how much): expect ratios below 1. The point of the
run is the split between compute and communication, not a speedup.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time

from workbench.llm import LLM
from workbench.models.loader import load_tokenizer, resolve_checkpoint
from workbench.quant.calibration import part_tokens
from workbench.sampling_params import SamplingParams

MOE = {"num_experts": 8, "top_k": 2}


def parse_layout(name: str) -> dict:
    """'tp3' -> tensor_parallel_size=3; 'tp2xpp2'; 'ep2' (with the MoE model); 'single'."""
    kw = {}
    for part in name.split("x"):
        m = re.fullmatch(r"(tp|pp|ep)(\d+)", part)
        if name == "single" or name == "moe":
            break
        if not m:
            raise ValueError(f"layout {part!r} is invalid: use tpN, ppN, epN joined by 'x'")
        kw[{"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size",
            "ep": "expert_parallel_size"}[m[1]]] = int(m[2])
    if name == "moe" or kw.get("expert_parallel_size", 1) > 1:
        kw["moe_config"] = MOE
    return kw


def measure(layout: str, prompts, params, repeats: int, model: str) -> dict:
    kw = parse_layout(layout)
    with LLM(model=model, dtype="float32", device="cpu", verbose=False,
             max_num_seqs=len(prompts), max_model_len=512, **kw) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))   # warm up
        walls, out = [], None
        for _ in range(repeats):
            start_step = len(llm.trace)
            t = time.perf_counter()
            out = llm.generate(prompts, params)
            walls.append(time.perf_counter() - t)
        steps = llm.trace[start_step:]
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    comm_s = sum(r.comm_s for r in steps)
    busy_s = sum(sum(r.stage_busy_s) for r in steps)
    return {"layout": layout, "wall_s": statistics.median(walls), "tok_s": tokens /
            statistics.median(walls), "steps": len(steps),
            "comm_share": comm_s / busy_s if busy_s else 0.0,
            "comm_bytes_per_step": sum(r.comm_bytes for r in steps) / len(steps),
            "collectives_per_step": sum(c for r in steps for c, _, _ in r.comm.values())
            / len(steps),
            "tokens": [o.outputs[0].token_ids for o in out]}


def run(layouts, batch: int, new_tokens: int, repeats: int, model: str) -> dict:
    tok = load_tokenizer(resolve_checkpoint(model))
    ids = part_tokens(tok, "heldout")
    prompts = [ids[i * 64:i * 64 + 24 + 4 * i] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rows = {name: measure(name, prompts, params, repeats, model)
            for name in ["single", "moe"] + list(layouts)}
    print(f"\nparallel decode, {model} fp32, batch {batch}, {new_tokens} new tokens, median of "
          f"{repeats} (CPU: workers share the cores)")
    print(f"{'layout':<10} {'tok/s':>7} {'vs 1 proc':>9} {'comm share':>10} {'KB/step':>8} "
          f"{'colls/step':>10}  tokens")
    for name, r in rows.items():
        base = rows["moe" if "moe_config" in parse_layout(name) else "single"]
        r["ratio"] = r["tok_s"] / base["tok_s"]
        r["same_tokens"] = r["tokens"] == base["tokens"]
        print(f"{name:<10} {r['tok_s']:7.1f} {r['ratio']:8.2f}x {100 * r['comm_share']:9.0f}% "
              f"{r['comm_bytes_per_step'] / 1024:8.1f} {r['collectives_per_step']:10.1f}  "
              f"{'identical' if r['same_tokens'] else 'DIFFERENT'}")
    return {"model": model, "batch": batch, "new_tokens": new_tokens, "repeats": repeats,
            "rows": {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in rows.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench parallel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=["tp3", "pp2", "pp3", "ep2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = run(args.layouts, args.batch, args.new_tokens, args.repeats, args.model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
