"""Hand-written CPU kernels (C++, AVX-512): the batch-1 decode matmuls (gemv.cpp) and paged
decode attention that reads K/V blocks in place (paged_attention.cpp).

They are compiled on first use with torch's extension builder (about 30 s on 2 cores, then cached
under torch's extension folder) and registered as torch operators:

    torch.ops.workbench_cpu.linear_bf16(x, w)          x (M, K) bf16, w (N, K) bf16 -> (M, N)
    torch.ops.workbench_cpu.linear_int8(x, w, scale)   w (N, K) int8, scale (N,) bf16: x @ w.T * scale
    torch.ops.workbench_cpu.linear_int4(x, packed, scale, minimum, group_size, aten_packed,
                                        aten_scale_zero)
        Int4Linear's codes (N, K/2) and per-group scale/minimum; aten's layout for 3+ rows
    torch.ops.workbench_cpu.paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                         block_size, scale)
        q (seqs, H, D) one decode query per sequence; caches (slots, KVH, D); bf16 or fp32
    torch.ops.workbench_cpu.paged_decode_write(q, k, v, k_cache, v_cache, slot_mapping,
                                               block_tables, seq_lens, block_size, scale)
        the same after writing k, v (seqs, KVH, D) into the caches at slot_mapping (seqs,)
    torch.ops.workbench_cpu.decode_step(x, positions, in_norms, post_norms, qkv, o, gate_up, down,
                                        final_norm, cos, sin, k_caches, v_caches, ...,
                                        weight_kind, group_size)
        a whole decode step of a Llama model (bf16 activations; bf16, INT8 or INT4 weights), every
        layer in one call (models/fused_decode.py)

M <= 2 runs the hand-written loop (measured: it loses to torch's GEMM from 3 rows on); larger M
goes to torch's kernel (aten's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu for INT8 /
INT4). The operators have fake (shape-only) implementations, so torch.compile traces through them
as opaque calls.

`available()` says whether they can run here and, if not, why (no AVX-512 BF16, no compiler, a
failed build); the engine then keeps torch's kernels and prints the reason.
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(n) for n in ("gemv.cpp", "paged_attention.cpp",
                                                 "decode_step.cpp")]
MAX_ROWS = 2          # must match kMaxRows in gemv.cpp


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.lru_cache(maxsize=None)
def _build() -> str | None:
    """Build and load the operator once per process; None on success, else the reason."""
    missing = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++/g++) on PATH"
    try:
        from torch.utils.cpp_extension import load
        # -fopenmp: at::parallel_for in a header only splits work when compiled with OpenMP;
        # the library resolves to the libgomp torch already loaded (same soname).
        load(name="workbench_cpu", sources=[str(p) for p in SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:           # a compiler error is a reason to fall back, not to crash
        return f"building kernels/cpu failed: {str(e).splitlines()[0][:200]}"
    _register_fakes()
    return None


def available() -> tuple[bool, str]:
    """(True, "") when the kernels are loaded; (False, reason) otherwise. Builds on first call."""
    reason = _build()
    return reason is None, reason or ""


def _register_fakes() -> None:
    @torch.library.register_fake("workbench_cpu::linear_bf16")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("workbench_cpu::linear_int8")
    def _(x, w, scale):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("workbench_cpu::linear_int4")
    def _(x, packed, scale, minimum, group_size, aten_packed, aten_scale_zero):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("workbench_cpu::paged_decode")
    def _(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("workbench_cpu::paged_decode_write")
    def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, block_size, scale):
        return torch.empty_like(q)
