"""Hand-written CPU kernels (C++): the small-batch decode matmuls (gemv.cpp), paged decode attention
that reads K/V blocks in place (paged_attention.cpp) and a whole decode step in one call
(decode_step.cpp).

One source, one build per instruction set. The sources are compiled with the flags of one ISA
(`ISA_FLAGS`), with `CPU_CAPABILITY_*` defined as PyTorch defines it for its own kernels, so
ATen's `at::vec::Vectorized<float>` is 16 lanes under AVX-512, 8 under AVX2 and 4 (NEON) or a
plain array elsewhere. Only a few inner products are written per ISA (the BF16 dot product, INT4
unpacking), behind `#if defined(WB_ISA_...)` in the sources. The ISA is chosen at run time from the
CPU's flags (`best_isa()`); `WORKBENCH_ISA=avx2` forces a lower one (tests run the AVX2 build on an
AVX-512 machine that way). Each ISA builds into its own library (workbench_cpu_<isa>, cached under
torch's extension folder; the first build compiles every source, `time python -m workbench.kernels.cpu`
measures it), and one process loads one of them.

Registered as torch operators:

    torch.ops.workbench_cpu.linear_bf16(x, w)          x (M, K), w (N, K) bf16 -> (M, N)
    torch.ops.workbench_cpu.linear_fp32(x, w)          x (M, K), w (N, K) fp32 -> (M, N)
    torch.ops.workbench_cpu.linear_int8(x, w, scale)   w (N, K) int8, scale (N,): x @ w.T * scale
    torch.ops.workbench_cpu.linear_int4(x, packed, scale, minimum, group_size, aten_packed,
                                        aten_scale_zero)
        Int4Linear's codes (N, K/2) and per-group scale/minimum; aten's layout for 3+ rows
    torch.ops.workbench_cpu.set_row_invariant(on) -> previous
        this thread's row-invariant mode: the loops take every row count, one sum order per row
        (batch_invariant=True)
    torch.ops.workbench_cpu.paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                         block_size, scale)
        q (seqs, H, D) one decode query per sequence; caches (slots, KVH, D); bf16 or fp32
    torch.ops.workbench_cpu.paged_decode_write(q, k, v, k_cache, v_cache, slot_mapping,
                                               block_tables, seq_lens, block_size, scale)
        the same after writing k, v (seqs, KVH, D) into the caches at slot_mapping (seqs,)
    torch.ops.workbench_cpu.decode_step(x, positions, in_norms, post_norms, qkv, o, gate_up, down,
                                        final_norm, cos, sin, k_caches, v_caches, ...,
                                        weight_kind)
        a whole decode step of a Llama model, every layer in one call (models/fused_decode.py);
        each INT4 projection's group size is its own (Kp over its scale's columns)

x and the result are bf16 or fp32 (the activation dtype); the weights keep their own format.
The operators have fake (shape-only) implementations, so torch.compile traces through them as
opaque calls.

`available()` says whether they can run here and, if not, why (no compiler, a failed build); the
engine then keeps torch's kernels and says so.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import time
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(n) for n in ("gemv.cpp", "paged_attention.cpp",
                                                 "decode_step.cpp")]
MAX_ROWS = 2          # must match kMaxRows in gemv.cpp

# Best first. Each entry: the /proc/cpuinfo flags it needs and the compiler flags of its build.
_X86 = ["-mfma", "-mf16c"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
ISA_FLAGS: dict[str, tuple[set[str], list[str]]] = {
    "avx512bf16": ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma", "f16c"},
                   _AVX512 + ["-mavx512bf16"] + _X86 + ["-DCPU_CAPABILITY=AVX512",
                   "-DCPU_CAPABILITY_AVX512", "-DWB_ISA_AVX512", "-DWB_ISA_AVX512BF16"]),
    "avx512": ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
               _AVX512 + _X86 + ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
                                 "-DWB_ISA_AVX512"]),
    "avx2": ({"avx2", "fma", "f16c"},
             ["-mavx2"] + _X86 + ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-DWB_ISA_AVX2"]),
    # ARM (NEON through ATen's 128-bit Vectorized on aarch64) and any other CPU: portable code.
    "default": (set(), ["-DCPU_CAPABILITY=DEFAULT", "-DWB_ISA_DEFAULT"]),
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def runnable_isas() -> list[str]:
    """The builds this CPU can execute, best first ("default" always)."""
    flags, x86 = cpu_flags(), platform.machine().lower() in ("x86_64", "amd64", "i686")
    return [isa for isa, (needs, _) in ISA_FLAGS.items()
            if isa == "default" or (x86 and needs <= flags)]


def best_isa() -> str:
    """The ISA whose build this process loads: WORKBENCH_ISA if set (it must be runnable here),
    else the best one the CPU has."""
    forced = os.environ.get("WORKBENCH_ISA")
    runnable = runnable_isas()
    if forced:
        if forced not in runnable:
            raise ValueError(f"WORKBENCH_ISA={forced!r} is invalid on this CPU: it can run "
                             + ", ".join(runnable))
        return forced
    return runnable[0]


# A build takes a minute at most; a lock this old was left by a build that was killed.
STALE_LOCK_S = 600


def build_directory(isa: str, flags: list[str]) -> Path:
    """One directory per ISA and version of the sources, flags and torch: checkouts with other
    sources never rebuild over each other ($WORKBENCH_CACHE, else ~/.cache/workbench)."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(flags).encode())
    for source in SOURCES + sorted(Path(__file__).parent.glob("*.h")):
        digest.update(source.read_bytes())
    root = os.environ.get("WORKBENCH_CACHE") or Path.home() / ".cache" / "workbench"
    folder = Path(root) / "kernels" / f"{isa}-{digest.hexdigest()[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        print(f"[workbench.kernels.cpu] removing {lock}, left by a build that did not finish")
        lock.unlink(missing_ok=True)       # torch's FileBaton would wait for it forever
    return folder


@functools.lru_cache(maxsize=None)
def _build() -> str | None:
    """Build and load the operators once per process; None on success, else the reason."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++/g++) on PATH"
    isa = best_isa()
    try:
        from torch.utils.cpp_extension import load
        # -fopenmp: at::parallel_for in a header only splits work when compiled with OpenMP;
        # the library resolves to the libgomp torch already loaded (same soname).
        # -fvisibility=hidden: the inline ATen code compiled here with this ISA's flags stays
        # inside this library, never resolving another library's calls.
        cflags = ["-O3", "-fopenmp", "-fvisibility=hidden",
                  "-fvisibility-inlines-hidden"] + ISA_FLAGS[isa][1]
        load(name=f"workbench_cpu_{isa}", sources=[str(p) for p in SOURCES],
             is_python_module=False, verbose=False, extra_cflags=cflags,
             extra_ldflags=["-fopenmp"], build_directory=str(build_directory(isa, cflags)))
    except Exception as e:           # a compiler error is a reason to fall back, not to crash
        return f"building kernels/cpu for {isa} failed: {str(e).splitlines()[0][:200]}"
    _register_fakes()
    return None


def available() -> tuple[bool, str]:
    """(True, "") when the kernels are loaded; (False, reason) otherwise. Builds on first call."""
    reason = _build()
    return reason is None, reason or ""


def describe() -> str:
    """One line: which build runs here, or why none does."""
    ok, reason = available()
    return f"kernels/cpu {best_isa()} build" if ok else f"kernels/cpu not used ({reason})"


def _register_fakes() -> None:
    @torch.library.register_fake("workbench_cpu::linear_bf16")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("workbench_cpu::linear_fp32")
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
