"""The compression table: every pruning variant against the dense model, quality, bytes and speed.

For each variant (dense; magnitude, Wanda and SparseGPT at 50% unstructured and at 2:4; MLP
channels, whole layers and attention heads removed at two ratios), built in one process from the same checkpoint
with the default dtype (`LLM()`'s):

- quality on held-out CPython documentation against the dense engine: perplexity, mean KL(dense ||
  variant), top-1 agreement (experiments/quality.py, the quantization table's harness);
- the decoder projections' bytes dense and in the best compressed form for their zeros (bitmask,
  or values plus indices for N:M; compress/pruning.py `storage_bytes`);
- decode speed at batch 1 (a ~32-token prompt, 128 new tokens) and batch 16 (16 prompts, 64 new
  tokens each), greedy, ignore_eos; variants run in turn, round after round, and a speedup is the
  median over rounds of the variant's tok/s over the dense engine's in the same round.

Mask pruning leaves dense tensors holding zeros, so its speed column shows what dense kernels make
of them: nothing. Structured pruning shrinks the matmuls. A variant `<pruned>+<loss>` (such as
`layers-0.3+kd`) is that pruned model saved, distilled from the dense engine with the loss
(compress/distill.py, `StudentDistillConfig`'s defaults) and loaded back: the table shows how much
of what pruning lost the training wins back. `int4` is uniform INT4 (group 128) and `mixed` the
per-projection plan of quant/mixed.py at the same bytes (`mixed-<bits>`: another budget);
`smoothquant` is W8A8 with per-token activation scales, `smoothquant-static` with one calibrated
scale per projection input. `gptq` is GPTQ INT4 alone, and `<mask variant>-gptq` that pruned
model quantized by GPTQ: one joint column loop for SparseGPT (its zeros stay), GPTQ after the
mask for the others (its compensation fills the zeros in). With `--device cuda`, `<method>-2:4-semi` runs the 2:4 weights as
semi-structured sparse tensors on sparse tensor cores (compress/semi_structured.py), the speed
column against dense bf16 on the same GPU; on a CPU those variants are refused.

    python -m workbench.bench compress [--variants wanda-2:4 layers-0.3 layers-0.3+kd] [--json out.json]
"""
from __future__ import annotations

import collections
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from workbench.bench.machine import machine_info, measured_commit
from workbench.bench.single_stream import PROMPT
from workbench.compress import structured
from workbench.compress.distill import StudentDistillConfig, distill_student
from workbench.compress.losses import LOSSES
from workbench.compress.pruning import MASKED as MASK_METHODS
from workbench.compress.pruning import follows_pattern, sparsity_report, storage_bytes
from workbench.compress.semi_structured import dense_weight
from workbench.experiments.quality import compare_many
from workbench.layers.linear import Int4Linear, QuantLinear
from workbench.llm import LLM
from workbench.quant.calibration import heldout_windows
from workbench.quant.gptq import ORDER, get_module
from workbench.sampling_params import SamplingParams

VARIANTS = ("dense", "magnitude-50%", "wanda-50%", "sparsegpt-50%", "magnitude-2:4", "wanda-2:4",
            "sparsegpt-2:4", "channels-0.15", "channels-0.3", "layers-0.15", "layers-0.3",
            "heads-0.25", "heads-0.5", "layers-0.3+kd", "layers-0.3+seqkd", "layers-0.3+reverse_kl",
            "layers-0.3+gkd", "channels-0.3+kd", "heads-0.25+kd", "int4", "mixed", "gptq",
            "sparsegpt-50%-gptq", "wanda-50%-gptq", "smoothquant", "smoothquant-static")
NUM_WINDOWS, WINDOW_LEN = 16, 256
BATCH, BATCH_TOKENS, SINGLE_TOKENS = 16, 64, 128


def parse_variant(spec: str) -> dict:
    """'wanda-2:4' -> pruning='wanda', pattern '2:4'; 'sparsegpt-50%' -> sparsity 0.5;
    'layers-0.3' -> ratio 0.3; 'layers-0.3+kd' -> that, then distilled with loss 'kd';
    'dense' -> no pruning."""
    if spec == "dense":
        return {}
    if spec in ("smoothquant", "smoothquant-static"):    # W8A8, per-token or static scales
        mode = "static" if spec.endswith("static") else "dynamic"
        return {"quantization": "smoothquant",
                "quantization_config": {"smoothquant_activations": mode}}
    if spec in ("int4", "mixed") or spec.startswith("mixed-"):
        method, _, bits = spec.partition("-")
        try:
            config = {"budget_bits": float(bits)} if bits else {}
        except ValueError:
            raise ValueError(f"variant={spec!r} is invalid: write 'mixed' (the bytes of uniform "
                             "INT4) or 'mixed-<bits per weight>'") from None
        return {"quantization": method, **({"quantization_config": config} if config else {})}
    if spec == "gptq":
        return {"quantization": "gptq"}
    if spec.endswith("-gptq"):         # pruned, then GPTQ; sparsegpt: both in one column loop
        base = parse_variant(spec.removesuffix("-gptq"))
        if base.get("pruning") not in MASK_METHODS or "distill" in base:
            raise ValueError(f"variant={spec!r} is invalid: '-gptq' follows a mask variant, such "
                             "as 'sparsegpt-50%-gptq'")
        return {**base, "quantization": "gptq"}
    if spec.endswith("-semi"):         # 2:4 on sparse tensor cores (CUDA, compute capability 8+)
        base = parse_variant(spec.removesuffix("-semi"))
        if base.get("pruning_config", {}).get("pattern") != "2:4":
            raise ValueError(f"variant={spec!r} is invalid: '-semi' (semi-structured sparse "
                             "kernels) applies to a 2:4 variant, such as 'wanda-2:4-semi'")
        base["pruning_config"]["semi_structured"] = True
        return base
    spec, _, loss = spec.partition("+")
    if loss:
        base = parse_variant(spec)
        if loss not in LOSSES or base.get("pruning") not in structured.STRUCTURED:
            raise ValueError(f"variant={spec + '+' + loss!r} is invalid: distil a structured "
                             f"variant ('<{'|'.join(structured.STRUCTURED)}>-<ratio>') with one of "
                             f"{', '.join(LOSSES)}")
        return {**base, "distill": loss}
    method, _, amount = spec.partition("-")
    if ":" in amount:
        options = {"pattern": amount}
    elif amount.endswith("%"):
        options = {"sparsity": float(amount[:-1]) / 100}
    else:
        try:
            options = {"ratio": float(amount)}
        except ValueError:
            raise ValueError(f"variant={spec!r} is invalid: write 'dense', '<method>-N:M', "
                             "'<method>-<percent>%' or '<channels|layers|heads>-<ratio>'") from None
    return {"pruning": method, "pruning_config": options}


def projection_bytes(llm: LLM, pattern: str) -> dict[str, int]:
    """Dense and compressed bytes of every decoder projection, summed (a quantized projection:
    its quantized format's bytes in both)."""
    total = {"dense": 0, "compressed": 0}
    for layer in llm.engine.model.layers:
        for path in ORDER:
            module = get_module(layer, path)[2]
            if isinstance(module, QuantLinear):
                total["dense"] += module.weight_bytes()
                total["compressed"] += module.weight_bytes()
                if isinstance(module, Int4Linear) and pattern != "unstructured" and \
                        follows_pattern(module.dequantize(torch.float32), pattern):
                    # N of every M codes kept, each with its position; scales and minimums as is
                    n, m = map(int, pattern.split(":"))
                    kept = module.out_features * module.in_features // m * n
                    codes = module.as_weight().packed.numel()
                    total["compressed"] -= codes - math.ceil(kept / 2) - math.ceil(
                        kept * math.ceil(math.log2(m)) / 8)
                continue
            sizes = storage_bytes(dense_weight(module.weight.detach()), pattern)
            total["dense"] += sizes["dense"]
            total["compressed"] += min(sizes.values())
    return total


def decode_tok_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / wall


def distilled(teacher: LLM, name: str, spec: dict, scratch: Path, args: dict, row: dict) -> LLM:
    """The structured variant `spec` pruned from the teacher's checkpoint (saved once per
    variant), distilled from the teacher with `spec["distill"]`'s loss, loaded as an engine."""
    base = name.partition("+")[0]
    pruned = scratch / base
    if not pruned.is_dir():
        LLM(teacher.engine.config.model, pruning=spec["pruning"],
            pruning_config=spec["pruning_config"], verbose=False).save_pruned(pruned)
    cfg = StudentDistillConfig(loss=spec["distill"])
    out = distill_student(pruned, teacher, scratch / name, cfg)
    row.update(distill_s=out.seconds, distill_steps=cfg.steps, distill_history=out.history)
    return LLM(str(out.path), **args)


def _progress(message: str) -> None:
    print(f"[bench compress] {message}", file=sys.stderr, flush=True)


def run(variants=VARIANTS, num_windows: int = NUM_WINDOWS, window_len: int = WINDOW_LEN,
        repeats: int = 3, model: str = "smollm2-135m", device: str = "cpu", **_) -> dict:
    specs = {v: parse_variant(v) for v in dict.fromkeys(("dense",) + tuple(variants))}
    engines, rows = {}, {}
    scratch = tempfile.TemporaryDirectory(prefix="workbench-compress-")
    args = dict(device=device, verbose=False, max_model_len=512, max_num_seqs=BATCH,
                max_num_batched_tokens=512)
    for name, extra in specs.items():
        t = time.perf_counter()
        row = rows[name] = {"variant": name}
        if "distill" in extra:
            engines[name] = distilled(engines["dense"], name, extra, Path(scratch.name), args, row)
        else:
            engines[name] = LLM(model, **args, **extra)
        row.update(build_s=time.perf_counter() - t,     # no temporary path in the results
                   describe=engines[name].describe().replace(scratch.name, "<scratch>"))
        _progress(f"built {name} in {row['build_s']:.1f} s")
    dense = engines["dense"]
    tok = dense.get_tokenizer()
    others = {n: e for n, e in engines.items() if n != "dense"}
    quality = compare_many(dense, others, heldout_windows(tok, num_windows, window_len)) \
        if others else {}
    for name, llm in engines.items():
        row = rows[name]
        q = quality.get(name)
        if q is not None:
            row.update(ppl=q.ppl_candidate, ppl_dense=q.ppl_reference, mean_kl=q.mean_kl,
                       top1=q.top1_agreement)
        else:   # the dense engine: its own perplexity, measured as every comparison's reference
            ref = next(iter(quality.values()), None)
            row.update(ppl=ref.ppl_reference if ref else None, mean_kl=0.0, top1=1.0)
        pattern = specs[name].get("pruning_config", {}).get("pattern", "unstructured")
        row.update(projection_bytes(llm, pattern))
        zeros = sparsity_report(llm.engine.model) if "pruning" in specs[name] else {"": 0.0}
        row["zero_fraction"] = statistics.mean(zeros.values())
        row["parameters"] = llm.engine.model.num_parameters()
        plan = getattr(llm.engine.model, "mixed_plan", None)
        if plan:        # how many projections took each format
            row["mixed_formats"] = dict(collections.Counter(plan.values()))
    _progress("timing decode")
    prompt = tok.encode(PROMPT)
    batch = [tok.encode(f"{PROMPT} ({i})") for i in range(BATCH)]
    speed = {n: {"b1": [], "b16": []} for n in engines}
    for r in range(repeats):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            speed[name]["b1"].append(decode_tok_s(engines[name], [prompt], SINGLE_TOKENS))
            speed[name]["b16"].append(decode_tok_s(engines[name], batch, BATCH_TOKENS))
    for name in engines:
        for key in ("b1", "b16"):
            rows[name][f"tok_s_{key}"] = statistics.median(speed[name][key])
            rows[name][f"speedup_{key}"] = statistics.median(
                v / d for v, d in zip(speed[name][key], speed["dense"][key]))
    return {"workload": "compress", "model": model, "device": device,
            "dtype": str(dense.engine.dtype),
            "num_windows": num_windows, "window_len": window_len, "repeats": repeats,
            "threads": torch.get_num_threads(), "rows": list(rows.values())}


def format_table(r: dict) -> str:
    lines = [f"compression on {r['model']} ({r['dtype']}), {r['num_windows']} x {r['window_len']} "
             f"held-out tokens, {r['threads']} threads, speed medians of {r['repeats']} rounds",
             f"{'variant':16} {'ppl':>7} {'mean KL':>8} {'top-1':>6} {'zeros':>6} "
             f"{'proj MB':>8} {'compr MB':>8} {'b1 x':>6} {'b16 x':>6}"]
    for row in r["rows"]:
        ppl = f"{row['ppl']:.1f}" if row.get("ppl") else "-"
        lines.append(f"{row['variant']:16} {ppl:>7} {row['mean_kl']:8.3f} {row['top1']:6.3f} "
                     f"{row['zero_fraction']:6.1%} {row['dense'] / 1e6:8.1f} "
                     f"{row['compressed'] / 1e6:8.1f} {row['speedup_b1']:6.2f} "
                     f"{row['speedup_b16']:6.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    import datetime
    import json

    ap = argparse.ArgumentParser(prog="python -m workbench.bench compress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--num-windows", type=int, default=NUM_WINDOWS)
    ap.add_argument("--window-len", type=int, default=WINDOW_LEN)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu",
                    help="cpu (default) or cuda, where '<method>-2:4-semi' variants run 2:4 "
                         "weights on sparse tensor cores")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    for v in args.variants:          # a typo fails now, not after minutes of calibration
        parse_variant(v)
    commit = measured_commit()
    result = run(args.variants, args.num_windows, args.window_len, args.repeats,
                 device=args.device)
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["machine"] = machine_info(commit)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
