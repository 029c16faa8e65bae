"""Compile every kernel for a Hopper GPU (sm_90) without one: python -m workbench.kernels.compile_check

Triton compiles ahead of time on any machine: Python -> Triton IR -> GPU IR -> LLVM IR -> PTX,
then ptxas (shipped inside the triton wheel) -> machine code. That catches what the CPU interpreter
cannot: type errors only the compiler checks, shared memory over the chip's limit, and register
spills (ptxas -v). It is not a substitute for running on a GPU, but it is the closest a CPU-only
machine gets, and it runs in CI. TRITON_INTERPRET must be unset (the interpreter replaces
`@triton.jit` functions at import time).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HOPPER_SHARED_LIMIT = 227 * 1024    # bytes of shared memory one block may use on sm_90


@dataclass
class Compiled:
    name: str
    config: str
    shared_bytes: int
    registers: int
    spill_bytes: int


def _signature(fn, pointers: dict[str, str], floats: set[str], constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def _ptxas_usage(ptx: str, arch: str) -> tuple[int, int]:
    """(registers, spill bytes) that ptxas reports for the kernel."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(int(arch[3:5])).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills


def compile_one(fn, name: str, pointers: dict[str, str], floats: set[str], constexprs: dict,
                num_warps: int, num_stages: int, capability: int = 90) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = _signature(fn, pointers, floats, constexprs)
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    regs, spills = _ptxas_usage(kernel.asm["ptx"], f"sm_{capability}a")
    config = ", ".join(f"{k}={v}" for k, v in constexprs.items())
    return Compiled(name, config, kernel.metadata.shared, regs, spills)


def compile_all(dtype: str = "bf16") -> list[Compiled]:
    """The configurations the launchers use on a GPU, for head_dim 64 and 128."""
    from .flash_attention import _flash_attention_fwd
    from .paged_decode import _paged_decode_merge, _paged_decode_split
    from .rms_norm import _rms_norm
    from .rotary import _rotary
    import torch

    from .flash_attention import _tile_sizes
    from .paged_decode import decode_config
    gpu = torch.device("cuda")     # only its type is read: the configs the launchers pick on a GPU
    ptr = f"*{dtype}"
    results = []
    for head_dim in (64, 128):
        for varlen, paged in ((False, False), (True, False), (True, True)):
            block_m, block_n, warps, stages = _tile_sizes(head_dim, gpu, varlen)
            results.append(compile_one(
                _flash_attention_fwd, "flash_attention",
                {"Q": ptr, "K": ptr, "V": ptr, "Out": ptr, "cu_seqlens_q": "*i64",
                 "cu_seqlens_k": "*i64", "seq_lens_k": "*i64", "block_table": "*i64"},
                {"qk_scale"},
                dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=True,
                     VARLEN=varlen, PAGED=paged, PAGE=16, PRECISION="tf32", KV_QUANT=0),
                warps, stages))
        block_n, warps = decode_config(head_dim, gpu)
        results.append(compile_one(
            _paged_decode_split, "paged_decode_split",
            {"Q": ptr, "K": ptr, "V": ptr, "PartialOut": "*fp32", "PartialLse": "*fp32",
             "block_table": "*i64", "seq_lens": "*i64"}, {"qk_scale"},
            dict(HEAD_DIM=head_dim, BLOCK_G=16, BLOCK_N=block_n, PAGE=16, PRECISION="tf32",
                 KV_QUANT=0), warps, 2))
        results.append(compile_one(
            _paged_decode_merge, "paged_decode_merge",
            {"PartialOut": "*fp32", "PartialLse": "*fp32", "Out": ptr}, set(),
            dict(HEAD_DIM=head_dim, BLOCK_S=64), 4, 1))
        results.append(compile_one(
            _rotary, "rotary", {"Q": ptr, "K": ptr, "positions": "*i64", "Cos": "*fp32",
                                "Sin": "*fp32"}, set(),
            dict(HALF=head_dim // 2, BLOCK_H=32), 4, 1))
    # head_dim 256 in bf16 and head_dim 128 in fp32: the widest rows, the smallest tiles.
    for head_dim, dt, ty in ((256, torch.bfloat16, ptr), (128, torch.float32, "*fp32")):
        block_m, block_n, warps, stages = _tile_sizes(head_dim, gpu, False, dt)
        results.append(compile_one(
            _flash_attention_fwd, "flash_attention",
            {"Q": ty, "K": ty, "V": ty, "Out": ty, "cu_seqlens_q": "*i64",
             "cu_seqlens_k": "*i64", "seq_lens_k": "*i64", "block_table": "*i64"}, {"qk_scale"},
            dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=True, VARLEN=False,
                 PAGED=False, PAGE=16, PRECISION="ieee" if dt == torch.float32 else "tf32",
                 KV_QUANT=0), warps, stages))
    # Quantized KV caches (FP8 = 2, INT8 = 1): uint8 rows of codes + scale.
    block_m, block_n, warps, stages = _tile_sizes(128, gpu, True)
    for code in (1, 2):
        results.append(compile_one(
            _flash_attention_fwd, "flash_attention",
            {"Q": ptr, "K": "*u8", "V": "*u8", "Out": ptr, "cu_seqlens_q": "*i64",
             "cu_seqlens_k": "*i64", "seq_lens_k": "*i64", "block_table": "*i64"}, {"qk_scale"},
            dict(HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=True, VARLEN=True,
                 PAGED=True, PAGE=16, PRECISION="tf32", KV_QUANT=code), warps, stages))
        block_n, warps = decode_config(128, gpu)
        results.append(compile_one(
            _paged_decode_split, "paged_decode_split",
            {"Q": ptr, "K": "*u8", "V": "*u8", "PartialOut": "*fp32", "PartialLse": "*fp32",
             "block_table": "*i64", "seq_lens": "*i64"}, {"qk_scale"},
            dict(HEAD_DIM=128, BLOCK_G=16, BLOCK_N=block_n, PAGE=16, PRECISION="tf32",
                 KV_QUANT=code), warps, 2))
    from .quant_matmul import _blocks, _int4_matmul, _int8_matmul
    for m in (1, 64):
        block_m, block_n, block_k, warps = _blocks(m, gpu)
        results.append(compile_one(
            _int8_matmul, "int8_weight_matmul",
            {"X": ptr, "W": "*i8", "Scale": ptr, "Out": ptr}, set(),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32"), warps, 3))
        results.append(compile_one(
            _int4_matmul, "int4_weight_matmul",
            {"X": ptr, "Packed": "*u8", "Scale": ptr, "Minimum": ptr, "Out": ptr}, set(),
            dict(GROUP=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                 PRECISION="tf32"), warps, 3))
    results.append(compile_one(
        _rms_norm, "rms_norm", {"X": ptr, "Residual": ptr, "W": ptr, "Out": ptr}, {"eps"},
        dict(BLOCK=4096, HAS_RESIDUAL=True), 16, 1))
    return results


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels at import time",
              file=sys.stderr)
        return 2
    ok = True
    for c in compile_all():
        flags = []
        if c.shared_bytes > HOPPER_SHARED_LIMIT:
            flags.append("SHARED MEMORY OVER THE LIMIT")
            ok = False
        if c.spill_bytes:
            flags.append("spills")
        print(f"{c.name:20s} {c.config:80s} shared {c.shared_bytes / 1024:6.1f} KiB  "
              f"registers {c.registers:3d}  spill {c.spill_bytes:4d} B  {' '.join(flags)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
