"""Where the time of one decoded token goes: the anatomy of a decode step at batch 1.

The engine's own step records (engine.trace) already split every step into schedule, prepare,
forward, sample and postprocess. This module splits the forward further by running a few decode
steps under torch.profiler and summing each operator's *self* time into four buckets:

- matmul:     the linear layers and the LM head (mm, addmm, the packed INT8/INT4 kernels, ...);
- attention:  writing K/V into the cache, gathering it back, and SDPA itself (or the C++ paged
              decode kernel, which does all three);
- other ops:  everything else the forward runs (RMSNorm, rotary, SiLU, casts, copies, views...);
- fused C++ step: with fused_decode, the one operator that runs all of the above inside (its
              matmuls and attention are C++ calls the profiler does not see);
- overhead:   the forward's wall time (measured without the profiler) minus all operator time:
              Python, module calls and PyTorch's dispatcher, the cost of launching many small ops.

At batch 1 a 135M model's weights are read once per token; if the matmul bucket is small next to
the others, the step is bound by overhead, not by memory bandwidth, and the cure is fewer, fused
operations (torch.compile) rather than faster matmuls.
"""
from __future__ import annotations

import statistics

import torch

from workbench.sampling_params import SamplingParams

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm",
              "aten::_weight_int4pack_mm_for_cpu", "aten::_int_mm", "mkldnn", "onednn",
              "workbench_cpu::linear")     # kernels/cpu: the batch-1 GEMV loops
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "aten::index_copy", "aten::index_select",
                 "workbench_cpu::paged_decode")   # kernels/cpu's paged attention (+ its cache write)
PHASES = ("schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s")


FUSED_STEP_OPS = ("workbench_cpu::decode_step",)   # fused_decode: every layer in one C++ call


def categorize(op_name: str) -> str:
    name = op_name.lower()
    if any(f in name for f in FUSED_STEP_OPS):
        return "fused C++ step"
    if any(m in name for m in MATMUL_OPS):
        return "matmul"
    if any(a in name for a in ATTENTION_OPS):
        return "attention"
    return "other ops"


def _decode_records(llm, prompt_ids, new_tokens):
    """Generate, then return the step records of the decode steps (one token each, batch 1)."""
    start = len(llm.trace)
    llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=new_tokens,
                                              ignore_eos=True))
    return [r for r in llm.trace[start:] if r.num_prefill_tokens == 0]


def forward_op_times(llm, prompt_ids, steps: int = 8) -> dict[str, float]:
    """Mean seconds per decode step in each operator bucket, from the profiler's self times of
    the operators that ran inside the model's forward (ModelRunner.execute) of decode steps."""
    return _profiled_forward(llm, prompt_ids, steps)[0]


def _profiled_forward(llm, prompt_ids, steps: int) -> tuple[dict[str, float], float, float]:
    """The buckets, the forward's own wall time per step in the same profiled run, and how many
    operators the forward dispatched per step (nested calls included)."""
    runner = llm.engine.runner
    plain_execute = runner.execute
    decode_steps = 0

    def labelled(step, *a, **k):
        nonlocal decode_steps
        if any(len(tokens) != 1 for tokens, _ in step.rows):     # the prefill: not counted
            return plain_execute(step, *a, **k)
        decode_steps += 1
        with torch.profiler.record_function("workbench.forward"):
            return plain_execute(step, *a, **k)

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    runner.execute = labelled
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate([prompt_ids], params)
    finally:
        runner.execute = plain_execute
    buckets = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    wall, calls = 0.0, 0
    for event in prof.events():
        if event.name == "workbench.forward":
            wall += event.cpu_time_total / 1e6
        elif _inside(event, "workbench.forward"):
            kind = categorize(event.name)   # "fused C++ step" only appears where it runs
            buckets[kind] = buckets.get(kind, 0.0) + event.self_cpu_time_total / 1e6
            calls += 1
    n = max(decode_steps, 1)
    return {k: v / n for k, v in buckets.items()}, wall / n, calls / n


def _inside(event, label: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == label:
            return True
        parent = parent.cpu_parent
    return False


def anatomy(llm, prompt_ids, new_tokens: int = 64, profiled_steps: int = 8) -> dict:
    """Per decoded token, seconds in each phase of the step and each bucket of the forward."""
    records = _decode_records(llm, prompt_ids, new_tokens)[1:]    # the first decode warms up
    phases = {p: statistics.median(getattr(r, p) for r in records) for p in PHASES}
    step_s = statistics.median(r.total_s for r in records)
    ops, profiled_forward, calls = _profiled_forward(llm, prompt_ids, profiled_steps)
    parts = {"schedule + prepare": phases["schedule_s"] + phases["prepare_s"], **ops,
             "overhead": max(phases["forward_s"] - sum(ops.values()), 0.0),
             "sample": phases["sample_s"], "postprocess": phases["postprocess_s"]}
    # profiled_forward_s: the forward's wall time under the profiler, in the run the operator
    # times come from. The operators' self times add up to at most that (they are disjoint);
    # the unprofiled forward_s is another run's, so on a noisy machine the two can differ.
    # ops_per_step counts operator dispatches, the cause of the overhead: unlike a difference of
    # two timings it does not move with the machine's load.
    return {"step_s": step_s, "tok_s": 1.0 / step_s, "parts_s": parts,
            "forward_s": phases["forward_s"], "profiled_forward_s": profiled_forward,
            "ops_per_step": calls}
