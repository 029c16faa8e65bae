"""python -m workbench.bench.cpu_attention [bf16|fp32 ...]: the paged decode kernel against the torch
backend's gather + SDPA on the offline-mixed decode shape, in alternating pairs.

Shape: 48 decoding sequences of 40-420 cached positions (mean ~230), H=9, KVH=3, D=64 (SmolLM2),
block size 16, blocks scattered over the pool, and 30 layers' caches walked in turn so that, as in
an engine step, a layer's cache is not in L3 when its call starts. Per pair, each side runs every
layer REPEAT times; the side that runs first alternates. Printed: us per layer call of
paged_decode alone (the figure the comments of paged_attention.cpp quote), of the cpu backend's
forward (write + attend, one call) and of the torch backend's forward (write, gather, SDPA), and
the median over pairs of torch / cpu backend. WORKBENCH_ISA picks the build as everywhere.

--against DIR: also build DIR's kernels/cpu sources (another checkout's, e.g. from `git archive`)
with their operators renamed to workbench_cpu_ref, and time their paged_decode in the same pairs:
an A/B of two versions of the kernel in one process, so both see the same load.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from workbench.kernels.cpu import ISA_FLAGS, SOURCES, available, best_isa
from workbench.attention import AttentionMetadata
from workbench.attention.torch_backend import TorchAttention

SEQS, HEADS, KV_HEADS, DIM, BLOCK, LAYERS, REPEAT, PAIRS = 48, 9, 3, 64, 16, 30, 4, 7


def make_step(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(40, 421, (SEQS,), generator=g)
    width = -(-int(lens.max()) // BLOCK)
    num_blocks = 2 * SEQS * width
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(SEQS)])
    pos = torch.arange(width * BLOCK)
    slot_table = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
    caches = [tuple(torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
                    for _ in range(2)) for _ in range(LAYERS)]
    q = torch.randn(SEQS, HEADS, DIM, generator=g).to(dtype)
    k, v = (torch.randn(SEQS, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(2))
    meta = dict(query_start_loc=torch.arange(SEQS + 1), seq_lens=lens,
                slot_mapping=slot_table[torch.arange(SEQS), lens - 1].contiguous(),
                slot_table=slot_table, max_query_len=1, max_seq_len=int(lens.max()),
                query_lens=[1] * SEQS, seq_lens_list=lens.tolist(), block_tables=tables,
                block_size=BLOCK)
    return q, k, v, caches, meta


def per_call_us(fn, caches) -> float:
    start = time.perf_counter()
    for _ in range(REPEAT):
        for kc, vc in caches:
            fn(kc, vc)
    return (time.perf_counter() - start) / (REPEAT * len(caches)) * 1e6


def load_reference(folder: str) -> None:
    """Build folder's sources as library workbench_cpu_ref_<isa>, operators workbench_cpu_ref::*."""
    from torch.utils.cpp_extension import load
    tmp = Path(tempfile.mkdtemp(prefix="wb_ref_"))
    for f in Path(folder).iterdir():
        if f.suffix in (".cpp", ".h"):
            (tmp / f.name).write_text(f.read_text().replace("workbench_cpu", "workbench_cpu_ref"))
    isa = best_isa()
    load(name=f"workbench_cpu_ref_{isa}", sources=[str(tmp / p.name) for p in SOURCES],
         is_python_module=False, verbose=False,
         extra_cflags=["-O3", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
         + ISA_FLAGS[isa][1], extra_ldflags=["-fopenmp"])


def run(dtype, against: bool) -> None:
    q, k, v, caches, fields = make_step(dtype)
    scale = DIM ** -0.5
    lens, tables = fields["seq_lens"], fields["block_tables"]
    sides = {
        "kernel": lambda kc, vc: torch.ops.workbench_cpu.paged_decode(q, kc, vc, tables, lens,
                                                                      BLOCK, scale),
        "cpu": (lambda b, m: lambda kc, vc: b.forward(q, k, v, kc, vc, m, scale))(
            TorchAttention(decode_kernel=True), AttentionMetadata(**fields)),
        "torch": (lambda b, m: lambda kc, vc: b.forward(q, k, v, kc, vc, m, scale))(
            TorchAttention(), AttentionMetadata(**fields)),
    }
    if against:
        sides["ref"] = lambda kc, vc: torch.ops.workbench_cpu_ref.paged_decode(
            q, kc, vc, tables, lens, BLOCK, scale)
    with torch.inference_mode():
        for fn in sides.values():
            per_call_us(fn, caches[:2])                     # warm up (plans, allocator)
        times = {name: [] for name in sides}
        for p in range(PAIRS):
            for name in (list(sides) if p % 2 == 0 else list(sides)[::-1]):
                times[name].append(per_call_us(sides[name], caches))
    ratios = [t / c for t, c in zip(times["torch"], times["cpu"])]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    name = str(dtype).replace("torch.", "")
    print(f"{best_isa()} {torch.get_num_threads()} threads {name}: paged_decode "
          f"{med['kernel']:.0f} us "
          f"per layer call (pairs: {', '.join(f'{t:.0f}' for t in times['kernel'])}); "
          f"cpu backend {med['cpu']:.0f} us, torch backend {med['torch']:.0f} us: "
          f"torch / cpu {statistics.median(ratios):.2f}x "
          f"(pairs {min(ratios):.2f}-{max(ratios):.2f}x)")
    if against:
        ab = [r / k for r, k in zip(times["ref"], times["kernel"])]
        print(f"  against the reference build: ref {med['ref']:.0f} us / this {med['kernel']:.0f} "
              f"us = {statistics.median(ab):.2f}x (pairs {', '.join(f'{x:.2f}' for x in ab)})")


if __name__ == "__main__":
    ok, why = available()
    if not ok:
        sys.exit(f"kernels/cpu unavailable: {why}")
    parser = argparse.ArgumentParser()
    parser.add_argument("dtypes", nargs="*", help="bf16, fp32 (default: both)")
    parser.add_argument("--against", help="a kernels/cpu folder to A/B against")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.against:
        load_reference(args.against)
    for name in args.dtypes or ["bf16", "fp32"]:
        run({"bf16": torch.bfloat16, "fp32": torch.float32}[name], args.against is not None)
