"""python -m workbench.bench.cpu_decode_step [bf16|int4|fp32 ...]: one fused decode step
(decode_step.cpp) against the unfused step on SmolLM2-135M, batch 1, fp32 activations, in
alternating pairs.

The model is built in fp32 with its projections' weights in the named format (bf16: the fp32
checkpoint's projections cast to bf16; int4: RTN INT4; fp32: as loaded), switched to the GEMV
layers (use_cpu_gemv) and run with the C++ attention backend, as an fp32 fused_decode engine
would. A 100-token prompt is prefilled, then each side runs STEPS decode steps of one token at
position 100 (the same slot rewritten); the side that runs first alternates. Printed: ms per step
of each side and the median over pairs of unfused / fused. WORKBENCH_ISA picks the build.

The unfused INT4 layers are made to take fp32 x on the kernel too (QuantLinear's fast path takes
bf16/fp16 only, so an fp32 Int4GemvLinear dequantizes its weight every call, which would time
the dequantization rather than the step),
so that both sides run the same GEMV and the ratio is what fusing gains.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from workbench import LLM
from workbench.kernels.cpu import available, best_isa
from workbench.models.cpu_gemv import use_cpu_gemv
from workbench.models.fused_decode import FusedDecodeForward

STEPS, PAIRS, PROMPT = 20, 7, 100


def build(weights: str):
    llm = LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
              attention_backend="cpu", max_model_len=256,
              quantization="int4" if weights == "int4" else None)
    model = llm.engine.model
    if weights == "bf16":
        for layer in model.layers:
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj):
                m.weight.data = m.weight.data.bfloat16()
    use_cpu_gemv(model)
    return llm, FusedDecodeForward(model, llm.engine.runner.forward_fn)


def run(weights: str) -> None:
    llm, fused = build(weights)
    runner = llm.engine.runner
    caches, backend = runner.cache.kv_caches, runner.backend
    table = [list(range(-(-(PROMPT + 1) // runner.cache.block_size)))]
    with torch.inference_mode():
        ids, pos, meta = runner.pack([(list(range(1000, 1000 + PROMPT)), 0)], table)
        fused.inner(ids, pos, caches, meta, backend)
        ids, pos, meta = runner.pack([([5], PROMPT)], table)
        assert fused.takes(meta, backend)

        def step_ms(forward) -> float:
            start = time.perf_counter()
            for _ in range(STEPS):
                forward(ids, pos, caches, meta, backend)
            return (time.perf_counter() - start) / STEPS * 1e3

        sides = {"fused": fused, "unfused": fused.inner}
        for f in sides.values():
            step_ms(f)                                   # warm up
        times = {name: [] for name in sides}
        for p in range(PAIRS):
            for name in (list(sides) if p % 2 == 0 else list(sides)[::-1]):
                times[name].append(step_ms(sides[name]))
    ratios = [u / f for u, f in zip(times["unfused"], times["fused"])]
    print(f"{best_isa()} {torch.get_num_threads()} threads, fp32 x, {weights} weights: fused "
          f"{statistics.median(times['fused']):.2f} ms, unfused "
          f"{statistics.median(times['unfused']):.2f} ms per step: unfused / fused "
          f"{statistics.median(ratios):.2f}x (pairs {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    ok, why = available()
    if not ok:
        sys.exit(f"kernels/cpu unavailable: {why}")
    parser = argparse.ArgumentParser()
    parser.add_argument("weights", nargs="*", help="bf16, int4, fp32 (default: bf16 int4)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for w in args.weights or ["bf16", "int4"]:
        run(w)
