"""python -m workbench distill --student DIR --teacher smollm2-135m --loss kd \
        --steps N --out DIR [--resume]
trains the student (a pruned checkpoint folder) toward the teacher, then evaluates the student
before and after against the teacher on held-out text with the quantization harness, and prints
greedy generations of all three side by side.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from workbench.compress.distill import StudentDistillConfig, distill_student
from workbench.compress.losses import LOSSES
from workbench.experiments.quality import compare_many
from workbench.llm import LLM
from workbench.quant.calibration import heldout_windows
from workbench.sampling_params import SamplingParams

EVAL_PROMPTS = ("The capital of France is", "def fibonacci(n):", "To make a cup of tea,")


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--student", required=True, help="the student's folder (e.g. LLM.save_pruned's)")
    d.add_argument("--teacher", default="smollm2-135m")
    d.add_argument("--out", required=True, help="folder for the distilled student and its state")
    d.add_argument("--resume", action="store_true", help="continue from --out's training state")
    d.add_argument("--final-windows", type=int, default=16,
                   help="held-out windows of 256 tokens for the final evaluation (0: none)")
    defaults = StudentDistillConfig()
    for f in fields(StudentDistillConfig):
        kind = str if f.name == "loss" else (int if f.type == "int" else float)
        d.add_argument("--" + f.name.replace("_", "-"), type=kind, default=getattr(defaults, f.name),
                       choices=LOSSES if f.name == "loss" else None)


def main(args) -> int:
    try:
        cfg = StudentDistillConfig(**{f.name: getattr(args, f.name)
                                      for f in fields(StudentDistillConfig)})
    except ValueError as err:
        print(f"python -m workbench distill: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    teacher = LLM(model=args.teacher, verbose=False, max_num_seqs=32)
    run = distill_student(args.student, teacher, args.out, cfg, resume=args.resume, progress=True)
    print(f"[distill] saved {run.path} in {run.seconds:.0f} s")
    if args.final_windows:
        evaluate(teacher, args.student, str(run.path), args.final_windows)
    return 0


def evaluate(teacher, before: str, after: str, num_windows: int) -> None:
    """Perplexity, mean KL and top-1 agreement against the teacher, and greedy generations."""
    students = {"student": LLM(model=before, verbose=False), "distilled": LLM(model=after, verbose=False)}
    windows = heldout_windows(teacher.get_tokenizer(), num_windows, 256)
    results = compare_many(teacher, students, windows)
    print(f"held-out text, {num_windows} windows of 256 tokens: teacher perplexity "
          f"{next(iter(results.values())).ppl_reference:.2f}")
    for name, r in results.items():
        print(f"  {name:<10} perplexity {r.ppl_candidate:7.2f}, mean KL {r.mean_kl:.3f}, "
              f"top-1 {r.top1_agreement:.1%}, {r.weight_bytes / 1e6:.0f} MB")
    params = SamplingParams(temperature=0, max_tokens=24)
    for prompt in EVAL_PROMPTS:
        print(f"\n{prompt!r}")
        for name, llm in {"teacher": teacher, **students}.items():
            print(f"  {name:<10} {llm.generate([prompt], params)[0].outputs[0].text!r}")

