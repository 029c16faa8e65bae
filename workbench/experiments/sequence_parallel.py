"""Tensor parallelism with and without sequence parallelism, measured on this machine: bytes each
rank sends per step (per collective, with the algorithm used and a ring's ideal), seconds per
step for a prefill-heavy step and a decode step, and each rank's residual-stream bytes.

    python -m workbench.experiments.sequence_parallel [--model smollm2-135m] [--tp 3] [--prefill 255]
                                          [--batch 8] [--repeats 3]

SmolLM2-135M splits over 3 ranks (9 query and 3 KV heads); `--model random:tiny --tp 2` runs the
tiny Llama on 2. On a CPU the workers share the cores and every gloo call costs about a
millisecond, so the times show the collectives' count more than their bytes.
"""
from __future__ import annotations

import argparse
import statistics

from workbench.llm import LLM
from workbench.sampling_params import SamplingParams


def _step_row(records) -> dict:
    """Median seconds per step and the (identical) bytes of the steps' first record."""
    r = records[0]
    return {"tokens": r.num_tokens, "step_s": statistics.median(x.forward_s for x in records),
            "sent": dict(r.comm_sent),
            "sent_bytes": sum(a for a, _ in r.comm_sent.values()),
            "ring_bytes": sum(b for _, b in r.comm_sent.values()),
            "residual_bytes": r.residual_bytes[0]}


def measure_layout(model: str, tp: int, sequence_parallel: bool, prefill: int, batch: int,
                   repeats: int) -> dict:
    with LLM(model=model, dtype="float32", device="cpu", verbose=False, max_model_len=prefill + 16,
             max_num_seqs=batch, max_num_batched_tokens=max(prefill, batch),
             tensor_parallel_size=tp, sequence_parallel=sequence_parallel) as llm:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([[5, 6, 7]], one)                                  # warm up
        start = len(llm.trace)
        for i in range(repeats):                  # one whole prompt per step: a pure prefill
            llm.generate([[(i * 997 + j) % 40000 + 3 for j in range(prefill)]], one)
        prefills = llm.trace[start:]
        start = len(llm.trace)
        prompts = [[i + 3, i + 4, i + 5] for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=repeats + 1,
                                             ignore_eos=True))
        decodes = [r for r in llm.trace[start:] if r.num_prefill_tokens == 0]
    return {"prefill": _step_row(prefills), "decode": _step_row(decodes)}


def measure(model: str = "smollm2-135m", tp: int = 3, prefill: int = 255, batch: int = 8,
            repeats: int = 3) -> dict:
    """{"tp": ..., "sp": ...}: each {"prefill": row, "decode": row}, a row holding tokens,
    step_s, sent (collective -> (algorithm bytes, ring bytes)), sent_bytes, ring_bytes and
    residual_bytes, all per rank."""
    return {name: measure_layout(model, tp, sp, prefill, batch, repeats)
            for name, sp in (("tp", False), ("sp", True))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.experiments.sequence_parallel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=255)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    result = measure(a.model, a.tp, a.prefill, a.batch, a.repeats)
    print(f"{a.model} fp32, tp={a.tp}, per rank and step (median of {a.repeats} steps)")
    print(f"{'layout':<6} {'step':<8} {'tokens':>6} {'ms':>8} {'sent KB':>8} {'ring KB':>8} "
          f"{'resid KB':>8}  collectives: sent bytes")
    for name, steps in result.items():
        for kind, r in steps.items():
            print(f"{name:<6} {kind:<8} {r['tokens']:6d} {1e3 * r['step_s']:8.1f} "
                  f"{r['sent_bytes'] / 1024:8.1f} {r['ring_bytes'] / 1024:8.1f} "
                  f"{r['residual_bytes'] / 1024:8.1f}  "
                  + ", ".join(f"{k} {v[0]}" for k, v in r["sent"].items()))


if __name__ == "__main__":
    main()
