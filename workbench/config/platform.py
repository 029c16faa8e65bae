"""What this machine offers the engine: the device, the dtype names the engine accepts and what
"auto" means here, and whether the CPU multiplies bf16 natively."""
from __future__ import annotations

import platform

import torch

from workbench.kernels.cpu import best_isa, cpu_flags

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEVICES = ("auto", "cpu", "cuda")


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX-512 BF16, which AMX machines also have, or
    ARM's BF16 extension), where bf16 is the fast path; elsewhere torch emulates bf16 arithmetic
    several times slower than fp32. WORKBENCH_ISA=avx2 makes an AVX-512 machine answer as an AVX2
    one would."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in cpu_flags()
    return best_isa() == "avx512bf16"


def onednn_bf16_prepack_reason() -> str | None:
    """Why oneDNN cannot prepack bf16 weights on this CPU (None if it can): torch's
    mkldnn_reorder_linear_weight needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for bf16."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if best_isa().startswith("avx512") or "avx_ne_convert" in cpu_flags():
        return None
    return ("oneDNN prepacks bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or "
            "AVX-NE-CONVERT, and this one runs the " + best_isa() + " build")


def check_dtype_name(dtype) -> None:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is invalid: allowed are float32, bfloat16, float16")
    elif dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: allowed values are 'auto', "
                         + ", ".join(repr(k) for k in DTYPES))


def resolve_device(device: str) -> torch.device:
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is invalid: allowed values are {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid here: torch sees no CUDA device "
                         "(use device='cpu' or 'auto')")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and on CPUs with native bf16, fp32 on other CPUs."""
    check_dtype_name(dtype)
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    resolved = dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError("dtype='float16' is invalid on CPU: CPU kernels for fp16 are slow or "
                         "missing; use 'float32' or 'bfloat16'")
    return resolved
