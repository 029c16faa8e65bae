"""The GPU half of the performance targets: python -m workbench.bench gpu --json F

For each reference shape, with random weights (`random:smollm2-135m`, and `random:llama-1b`:
Llama-3.2-1B's layers with SmolLM2's vocabulary), in bf16, on one GPU:

- the GPU memory's copy bandwidth (a 1 GiB device-to-device copy, read + write), measured right
  before every decode run;
- batch-1 decode (a 32-token prompt of random ids, greedy), the engine eager and with CUDA graphs:
  decode tok/s, and the bandwidth it achieves, (weight bytes + KV bytes of the context) x tok/s,
  as a share of the copy bandwidth. Target: at least 60% for the 1B shape (with graphs);
- offline-mixed (64 requests, prompts and outputs 16-256 tokens, ignore_eos): the engine eager and
  with graphs against transformers' generate() in static batches of 8, same checkpoint and dtype.
  Target: at least 10x.

Without CUDA the same code runs on the CPU for a smoke check (`--device cpu --shapes tiny`):
no graphs there, and no targets are judged.
"""
from __future__ import annotations

import statistics

import torch

from workbench.llm import LLM
from workbench.models.loader import resolve_checkpoint
from workbench.bench.bandwidth import copy_bandwidth, decode_bytes_per_token
from workbench.bench.offline_mixed import engine_run, hf_static_run, make_requests
from workbench.bench.single_stream import engine_once
from workbench.bench.speed import format_targets

SHAPES = ("smollm2-135m", "llama-1b")
TARGET_SHARE, TARGET_OFFLINE = 0.60, 10.0   # GPU targets: bandwidth share, x transformers


def _engine(shape: str, device: str, graphs: bool, max_num_seqs: int) -> LLM:
    return LLM(model=f"random:{shape}", dtype="bfloat16", device=device, verbose=False,
               max_model_len=1024, max_num_seqs=max_num_seqs, max_num_batched_tokens=1024,
               cuda_graphs=graphs)


def decode_row(llm: LLM, prompt_ids: list[int], new_tokens: int, repeats: int,
               device: str) -> dict:
    """Batch-1 decode speed and its share of the copy bandwidth measured just before each run."""
    engine_once(llm, prompt_ids, 8)                  # warm-up: kernels compile, memory is touched
    e = llm.engine
    per_token = decode_bytes_per_token(e.model.weight_bytes(),
                                       e.model_args.kv_bytes_per_token(e.dtype),
                                       len(prompt_ids) + new_tokens // 2)
    runs, bandwidths = [], []
    for _ in range(repeats):
        bandwidths.append(copy_bandwidth(1024 if device == "cuda" else 256, device=device))
        first = len(llm.trace)
        runs.append(engine_once(llm, prompt_ids, new_tokens)["decode_tok_s"])
    # Where the last run's decode steps went, from the engine's own step records. On a GPU the
    # forward returns once its kernels are queued: the wait for them shows up in sampling, which
    # reads the tokens back.
    steps = [s for s in llm.trace[first:] if not s.num_prefill_tokens]
    parts = {f: statistics.mean(getattr(s, f) for s in steps) for f in
             ("schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s", "total_s")}
    shares = [per_token * r / 1e9 / bw for r, bw in zip(runs, bandwidths)]
    return {"decode_tok_s": statistics.median(runs), "decode_tok_s_per_run": runs,
            "step_parts_s": parts,
            "bytes_per_token": per_token, "copy_bandwidth_per_run_gbs": bandwidths,
            "achieved_gbs": per_token * statistics.median(runs) / 1e9,
            "fraction_of_copy_bandwidth": statistics.median(shares)}


def shape_results(shape: str, device: str, new_tokens: int, num_requests: int,
                  repeats: int) -> dict:
    from transformers import AutoModelForCausalLM
    graph_options = (False, True) if device == "cuda" else (False,)
    prompt_ids = list(range(100, 132))
    requests = make_requests(num_requests)
    out = {"decode": {}, "offline": {}}
    for graphs in graph_options:
        label = "engine + CUDA graphs" if graphs else "engine eager"
        llm = _engine(shape, device, graphs, max_num_seqs=64)
        if graphs:
            out["graph_capture_s"] = llm.engine.runner.forward_fn.capture_s
        out["weight_bytes"] = llm.engine.model.weight_bytes()
        out["decode"][label] = decode_row(llm, prompt_ids, new_tokens, repeats, device)
        engine_run(llm, requests[:4])                 # warm-up of the prefill kernels
        out["offline"][label] = engine_run(llm, requests)
        if graphs:
            out["offline"][label]["graph_replays"] = dict(llm.engine.runner.forward_fn.replays)
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_checkpoint(f"random:{shape}")),
                                              dtype=torch.bfloat16).to(device).eval()
    hf_static_run(hf, requests[:2], batch_size=2)     # warm-up
    out["offline"]["transformers static batches of 8"] = hf_static_run(hf, requests)
    del hf
    return out


def targets(r: dict) -> list[dict]:
    """The GPU targets, judged on the runs with CUDA graphs (None where none ran)."""
    rows = []
    for shape, s in r["shapes"].items():
        g = "engine + CUDA graphs"
        hf = s["offline"]["transformers static batches of 8"]["tok_s"]
        ratio = s["offline"][g]["tok_s"] / hf if g in s["offline"] else None
        rows.append({"target": f"{shape}: offline-mixed vs transformers", "measured": ratio,
                     "bar": TARGET_OFFLINE})
        if shape == "llama-1b":
            share = s["decode"][g]["fraction_of_copy_bandwidth"] if g in s["decode"] else None
            rows.append({"target": f"{shape}: batch-1 decode, share of copy bandwidth",
                         "measured": share, "bar": TARGET_SHARE})
    for t in rows:
        t["met"] = None if t["measured"] is None else t["measured"] >= t["bar"]
    return rows


def run(shapes=SHAPES, device: str = "cuda", new_tokens: int = 256, num_requests: int = 64,
        repeats: int = 3) -> dict:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m workbench.bench gpu needs CUDA; for a smoke check of the "
                         "code on this machine: --device cpu --shapes tiny")
    r = {"workload": "gpu", "device": device, "new_tokens": new_tokens,
         "num_requests": num_requests, "repeats": repeats,
         "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "shapes": {}}
    for shape in shapes:
        r["shapes"][shape] = shape_results(shape, device, new_tokens, num_requests, repeats)
    r["targets"] = targets(r)
    return r


def format_table(r: dict) -> str:
    lines = [f"GPU benchmark on {r['gpu'] or r['device']}: batch-1 decode ({r['new_tokens']} new "
             f"tokens, median of {r['repeats']}) and offline-mixed ({r['num_requests']} requests), "
             "bf16, random weights"]
    for shape, s in r["shapes"].items():
        lines += ["", f"{shape} ({s['weight_bytes'] / 2**20:.0f} MiB of weights)",
                  f"  {'row':<36}{'decode tok/s':>13}{'GB/s':>8}{'of copy BW':>12}"
                  f"{'offline tok/s':>15}"]
        for label, d in s["decode"].items():
            lines.append(f"  {label:<36}{d['decode_tok_s']:>13.1f}{d['achieved_gbs']:>8.1f}"
                         f"{d['fraction_of_copy_bandwidth']:>11.0%}"
                         f"{s['offline'][label]['tok_s']:>15.1f}")
        hf = s["offline"]["transformers static batches of 8"]
        lines.append(f"  {'transformers static batches of 8':<36}{'-':>13}{'-':>8}{'-':>12}"
                     f"{hf['tok_s']:>15.1f}")
        for label, d in s["decode"].items():
            lines.append(f"  a batch-1 step, {label}: " + ", ".join(
                f"{k.removesuffix('_s')} {v * 1e3:.3f}" for k, v in d["step_parts_s"].items())
                + " ms")
    return "\n".join(lines + format_targets(r["targets"]))


def main(argv=None) -> None:
    import argparse
    import datetime
    import json
    import platform
    ap = argparse.ArgumentParser(prog="python -m workbench.bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    result = run(args.shapes, args.device, args.new_tokens, args.num_requests, args.repeats)
    import transformers
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                          "transformers": transformers.__version__,
                          "python": platform.python_version()}
    try:
        import triton
        result["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
