"""Speculative decoding against plain decoding, side by side in one process.

1. single-stream (the ~32-token prompt, 128 new tokens, greedy, batch 1) for every drafter: each
   variant and the plain engine run in turn, round after round; the speedup is the median over
   rounds of plain wall time / variant wall time from the same round. Printed next to it:
   acceptance rate, mean accepted length (tokens per verification step), the draft's share of the
   step time, and whether the tokens equal the plain engine's.
2. batch sweep: the best drafter of part 1 against plain decoding under continuous batching, for
   growing batches of different prompts (64 new tokens each): where speculation stops paying.
   (vLLM measured the same turn: up to 1.5x-2.8x at low load, 1.4x-1.8x *slower* at high load;
   vLLM blog, 2024-10-17, "How Speculative Decoding Boosts vLLM Performance by up to 2.8x".)

    python -m workbench.bench spec [--drafters ngram layer_skip ...] [--k 4] [--draft FOLDER]
                                   [--batches 1 4 16] [--repeats 3] [--json out.json]

The draft model for "draft_model" is --draft, or one distilled from the target once and kept in
the cache (compress/draft.py; a few minutes the first time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from workbench.bench.single_stream import NEW_TOKENS, PROMPT
from workbench.compress.draft import DistillConfig, distill_draft
from workbench.llm import LLM
from workbench.models.registry import cache_dir
from workbench.quant.calibration import part_tokens
from workbench.sampling_params import SamplingParams

DRAFTERS = {
    "ngram": lambda k, draft: {"method": "ngram", "num_speculative_tokens": k},
    "quantized_self": lambda k, draft: {"method": "quantized_self", "num_speculative_tokens": k,
                                        "draft_quantization": "int4"},
    "quantized_self_g32": lambda k, draft: {
        "method": "quantized_self", "num_speculative_tokens": k, "draft_quantization": "int4",
        "draft_quantization_config": {"group_size": 32}},
    "layer_skip": lambda k, draft: {"method": "layer_skip", "num_speculative_tokens": k},
    "draft_model": lambda k, draft: {"method": "draft_model", "num_speculative_tokens": k,
                                     "model": draft},
}


def build(dtype: str, spec: dict | None, max_num_seqs: int = 1) -> LLM:
    return LLM(model="smollm2-135m", dtype=dtype, device="cpu", verbose=False,
               max_num_seqs=max_num_seqs, speculative_config=spec)


def timed(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    before = len(llm.trace)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    steps = llm.trace[before:]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    spec_steps = sum(o.metrics.num_spec_steps for o in outs)
    return {"wall_s": wall, "tok_s": len(prompts) * new_tokens / wall,
            "tokens": [o.outputs[0].token_ids for o in outs],
            "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_length": (accepted + spec_steps) / spec_steps if spec_steps else None,
            "draft_share": sum(r.draft_s for r in steps) / max(sum(r.total_s for r in steps), 1e-9),
            "steps": len(steps)}


def default_draft(dtype: str) -> str:
    """A draft distilled from the target, made once and cached."""
    folder = cache_dir() / "drafts" / "smollm2-135m-distilled"
    if not (folder / "config.json").is_file():
        print("[bench spec] distilling a draft model from the target (once; a few minutes)")
        distill_draft(build(dtype, None, max_num_seqs=64), folder, DistillConfig())
    return str(folder)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share. Greedy speculation is exact in exact
    arithmetic; in bf16, scoring k + 1 tokens in one pass rounds differently from scoring them
    one at a time, and a near-tie between two tokens can flip (fp32 tests show identity)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def single_stream(drafters, k, dtype, repeats, new_tokens, draft) -> dict:
    plain = build(dtype, None)
    prompt = [plain.get_tokenizer().encode(PROMPT)]
    variants = {name: build(dtype, DRAFTERS[name](k, draft)) for name in drafters}
    for llm in [plain, *variants.values()]:
        timed(llm, prompt, 8)                                   # warm-up
    runs = {name: [] for name in ["plain", *variants]}
    for r in range(repeats):
        order = ["plain", *variants]
        order = order[r % len(order):] + order[:r % len(order)]   # rotate who goes first
        for name in order:
            runs[name].append(timed(plain if name == "plain" else variants[name], prompt,
                                    new_tokens))
    out = {}
    for name, rs in runs.items():
        speedups = [p["wall_s"] / v["wall_s"] for p, v in zip(runs["plain"], rs)]
        out[name] = {
            "tok_s": statistics.median(x["tok_s"] for x in rs),
            "speedup": statistics.median(speedups), "speedups": speedups,
            "acceptance": rs[0]["acceptance"], "mean_accepted_length": rs[0]["mean_accepted_length"],
            "draft_share": statistics.median(x["draft_share"] for x in rs),
            "same_prefix": min(common_prefix(x["tokens"][0], runs["plain"][0]["tokens"][0])
                               for x in rs)}
    return out


def batch_sweep(drafter, k, dtype, batches, new_tokens, draft) -> list[dict]:
    tok = build(dtype, None).get_tokenizer()
    text = part_tokens(tok, "heldout")
    prompts = [text[i * 97:i * 97 + 32] for i in range(max(batches))]     # distinct 32-token prompts
    rows = []
    for b in batches:
        plain = build(dtype, None, max_num_seqs=b)
        spec = build(dtype, DRAFTERS[drafter](k, draft), max_num_seqs=b)
        timed(plain, prompts[:b], 4)
        timed(spec, prompts[:b], 4)
        p, s = timed(plain, prompts[:b], new_tokens), timed(spec, prompts[:b], new_tokens)
        rows.append({"batch": b, "plain_tok_s": p["tok_s"], "spec_tok_s": s["tok_s"],
                     "speedup": s["tok_s"] / p["tok_s"], "acceptance": s["acceptance"],
                     "mean_accepted_length": s["mean_accepted_length"]})
        print(f"[bench spec] batch {b}: {rows[-1]['speedup']:.2f}x", flush=True)
        del plain, spec
    return rows


def format_table(r: dict) -> str:
    lines = [f"single-stream, {r['dtype']}, k = {r['k']}, {r['new_tokens']} new tokens, greedy, "
             f"batch 1, {r['repeats']} rounds, {r['threads']} threads", "",
             f"{'drafter':<20}{'tok/s':>7}{'speedup':>9}{'acceptance':>12}{'tokens/step':>13}"
             f"{'draft time':>12}{'same as plain':>15}"]
    for name, d in r["single_stream"].items():
        acc = "-" if d["acceptance"] is None else f"{d['acceptance']:.0%}"
        mal = "-" if d["mean_accepted_length"] is None else f"{d['mean_accepted_length']:.2f}"
        lines.append(f"{name:<20}{d['tok_s']:>7.1f}{d['speedup']:>8.2f}x{acc:>12}{mal:>13}"
                     f"{d['draft_share']:>11.0%}{d['same_prefix']:>9}/{r['new_tokens']}")
    if r.get("batch_sweep"):
        lines += ["", f"continuous batching, {r['sweep_drafter']} vs plain, {r['sweep_new_tokens']} "
                  "new tokens per request:",
                  f"{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'acceptance':>12}"]
        for row in r["batch_sweep"]:
            acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
            lines.append(f"{row['batch']:>6}{row['plain_tok_s']:>13.1f}{row['spec_tok_s']:>12.1f}"
                         f"{row['speedup']:>8.2f}x{acc:>12}")
    lines += ["", "speedup = median over rounds of plain wall time / variant wall time (same round); "
              "tokens/step = accepted drafts + 1 per verification; draft time = share of step time "
              "spent drafting; same as plain = leading tokens equal to plain decoding's (bf16 "
              "rounds differently when k + 1 tokens are scored at once)"]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="*", default=["ngram", "quantized_self_g32", "layer_skip",
                                                      "draft_model"], choices=sorted(DRAFTERS))
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--draft", help="draft model folder for draft_model (default: distil one)")
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--sweep-new-tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    draft = args.draft
    if "draft_model" in args.drafters and draft is None:
        draft = default_draft(args.dtype)
    result = {"dtype": args.dtype, "k": args.k, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "threads": torch.get_num_threads()}
    result["single_stream"] = single_stream(args.drafters, args.k, args.dtype, args.repeats,
                                            args.new_tokens, draft)
    ranked = sorted(args.drafters, key=lambda n: -result["single_stream"][n]["speedup"])
    if args.batches and ranked:
        result["sweep_drafter"], result["sweep_new_tokens"] = ranked[0], args.sweep_new_tokens
        result["batch_sweep"] = batch_sweep(ranked[0], args.k, args.dtype, args.batches,
                                            args.sweep_new_tokens, draft)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
