"""python -m workbench.bench.cpu_gemv [--rows 1,2] [--x fp32,bf16] [--formats bf16,fp32,int8,int4,w8a8]
[--shapes q/o,...] [--pairs 7] [--threads N] [--vs torch|widened]: the operators of gemv.cpp
against torch on SmolLM2-135M's shapes, in alternating pairs (the order flips every pair), on the
build this process loads (WORKBENCH_ISA; ATEN_CPU_CAPABILITY sets torch's own kernels). Prints the
median time of each and theirs/ours.

--vs torch (default): torch's equivalent. fp32 x: F.linear with the weight already in fp32
(bf16, fp32 weights), aten's _weight_int8pack_mm and _weight_int4pack_mm_for_cpu with fp32 x;
bf16 x: F.linear in bf16 and the same aten kernels with bf16 x. w8a8 (fp32 x only): SmoothQuant's
integer product, INT8 activations held as fp32 integers through the INT8 loop with unit scales
(ours, exact), against torch._int_mm on the int8 activations.
--vs widened (fp32 x): what gemv.cpp runs above its fp32 row limits, the weight widened to fp32
for every call and torch.mm; raise the kMaxRowsFp32* limits in gemv.cpp to time the loops there.
--vs ref --against DIR: the same operator built from DIR's kernels/cpu sources (another
checkout's, e.g. from `git archive`), an A/B of two versions of the loops in one process.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from workbench.bench.cpu_attention import load_reference
from workbench.kernels.cpu import available, best_isa
from workbench.layers.formats import quantize_int4
from workbench.layers.linear import Int4Linear

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def per_call(fn, budget_s: float = 0.05) -> float:
    """Seconds per call of fn, from as many calls as fit in about budget_s."""
    fn()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def alternating_pairs(ours, theirs, pairs: int) -> tuple[float, float]:
    """Median seconds per call of each, timed in pairs whose order flips every pair."""
    a, b = [], []
    for i in range(pairs):
        if i % 2:
            b.append(per_call(theirs)); a.append(per_call(ours))
        else:
            a.append(per_call(ours)); b.append(per_call(theirs))
    return statistics.median(a), statistics.median(b)


def cases(fmt: str, x: torch.Tensor, n: int, k: int, widened: bool = False, ops=None):
    """(weight bytes, ours, theirs) for one format and shape; ours runs `ops` (default: this
    build's operators). The weights depend only on the shape."""
    ops, aten = ops or torch.ops.workbench_cpu, torch.ops.aten
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt in ("bf16", "fp32"):
        wt = w.bfloat16() if fmt == "bf16" else w
        ref = w if x.dtype == torch.float32 else w.bfloat16()        # torch's F.linear operand
        theirs = (lambda: torch.mm(x, wt.float().t())) if widened else \
            (lambda: torch.nn.functional.linear(x, ref))
        return wt.numel() * wt.element_size(), lambda: ops.linear_bf16(x, wt), theirs
    if fmt == "w8a8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        xq = torch.randint(-127, 128, x.shape, generator=g, dtype=torch.int8)
        xf, ones = xq.float(), torch.ones(n)
        return q.numel(), lambda: ops.linear_int8(xf, q, ones), lambda: torch._int_mm(xq, q.t())
    if fmt == "int8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = (torch.rand(n, generator=g) * 0.01).to(x.dtype)
        theirs = (lambda: torch.mm(x, (q.float() * s.float()[:, None]).t())) if widened else \
            (lambda: aten._weight_int8pack_mm(x, q, s))
        return q.numel(), lambda: ops.linear_int8(x, q, s), theirs
    layer = Int4Linear(quantize_int4(w, 128), x.dtype)
    xp = layer._pad(x).contiguous()
    p, gs, sz = layer._aten_pack(x.dtype)
    theirs = (lambda: torch.mm(x, layer.dequantize(torch.float32).t())) if widened else \
        (lambda: aten._weight_int4pack_mm_for_cpu(xp, p, gs, sz))
    return (layer.packed.numel() + 2 * layer.scale.numel() * layer.scale.element_size(),
            lambda: ops.linear_int4(xp, layer.packed, layer.scale, layer.minimum, gs, p, sz), theirs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1")
    ap.add_argument("--x", default="fp32,bf16")
    ap.add_argument("--formats", default="bf16,fp32,int8,int4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--vs", choices=["torch", "widened", "ref"], default="torch")
    ap.add_argument("--against", help="with --vs ref: a kernels/cpu folder to build and time")
    args = ap.parse_args()
    if args.vs == "ref":
        assert args.against, "--vs ref needs --against DIR"
        load_reference(args.against)
    if args.threads:
        torch.set_num_threads(args.threads)
    ok, why = available()
    assert ok, why
    print(f"build {best_isa()}, torch {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for xname in args.x.split(","):
        for fmt in args.formats.split(","):
            if fmt in ("fp32", "w8a8") and xname == "bf16":
                continue
            for rows in map(int, args.rows.split(",")):
                for name in args.shapes.split(","):
                    n, k = SHAPES[name]
                    x = torch.randn(rows, k).to(dtypes[xname])
                    nbytes, ours, theirs = cases(fmt, x, n, k, args.vs == "widened")
                    if args.vs == "ref":
                        theirs = cases(fmt, x, n, k, ops=torch.ops.workbench_cpu_ref)[1]
                    a, b = alternating_pairs(ours, theirs, args.pairs)
                    print(f"x {xname} w {fmt:4} M={rows:<2} {name:8} {n:5}x{k:<4}  ours "
                          f"{a * 1e6:8.1f} us ({nbytes / a / 1e9:5.1f} GB/s)  {args.vs} "
                          f"{b * 1e6:8.1f} us  {args.vs}/ours {b / a:5.2f}", flush=True)


if __name__ == "__main__":
    main()
