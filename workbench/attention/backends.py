"""The one place where the engine chooses its attention implementation.

Only the plain-PyTorch reference exists so far; the Triton kernels (FlashAttention for prefill,
paged split-KV decode) register here, and `attention_backend="auto"` will prefer them on CUDA.
"""
from __future__ import annotations

import torch

from .torch_backend import TorchAttention

BACKENDS = {"torch": TorchAttention}


def get_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is invalid: allowed values are "
                         f"'auto', {', '.join(repr(b) for b in BACKENDS)}")
    return BACKENDS[name]()
