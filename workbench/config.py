"""EngineConfig: every engine knob in one dataclass, checked once when the engine is built.

Field names follow vLLM's engine arguments (`max_model_len`, `max_num_seqs`,
`max_num_batched_tokens`, ...) so that a learner can move between the two. Later capabilities add
their fields here (block_size, enable_prefix_caching, tensor_parallel_size, ...), never elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch")
# The KV cache reserves max_model_len slots for every sequence slot (max_num_seqs), so the default
# context is capped: SmolLM2's full 8192 tokens x 8 sequences would reserve 1.5 GB in bf16.
DEFAULT_MAX_MODEL_LEN = 1024


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX-512 BF16 or AMX), where bf16 is the fast path."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


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
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is invalid: allowed are float32, bfloat16, float16")
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"dtype={dtype!r} is invalid: allowed values are 'auto', "
                         + ", ".join(repr(k) for k in DTYPES))
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError("dtype='float16' is invalid on CPU: CPU kernels for fp16 are slow or "
                         "missing; use 'float32' or 'bfloat16'")
    return resolved


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")


@dataclass
class EngineConfig:
    """What the engine is built with. `device` and `dtype` are resolved to torch objects here."""

    model: str = "smollm2-135m"
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None     # None: the model's context, capped at DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = 8                # sequences decoded together in one step
    max_num_batched_tokens: int = 2048   # tokens (prefill + decode) in one forward pass
    attention_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None       # CPU threads for torch; None leaves torch's choice

    def __post_init__(self) -> None:
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len, 2)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is invalid: allowed "
                             f"values are {', '.join(ATTENTION_BACKENDS)}")
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an integer")

    def finalize(self, model_max_len: int) -> None:
        """Clamp to the model's context once it is known."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, DEFAULT_MAX_MODEL_LEN)
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid: the model's context "
                             f"is {model_max_len} tokens")
        if self.max_num_batched_tokens < self.max_model_len:
            # Without chunked prefill a prompt must fit in one step.
            self.max_num_batched_tokens = self.max_model_len
