"""The per-token operations around attention (RMSNorm with its residual add, rotary embedding),
in two implementations with one interface; the attention backend carries the one to use.

- TorchOps: plain PyTorch, transformers' arithmetic (the specification, kernels/reference.py);
  rotary cos/sin are gathered once per step and shared by all layers.
- TritonOps: the fused kernels (kernels/rms_norm.py, kernels/rotary.py); rotary reads the fp32
  tables by position inside the kernel and rotates q and k in place.
Both give the same bits on a GPU (the kernels round where the reference rounds).
"""
from __future__ import annotations

import torch

from workbench.kernels.reference import rms_norm_reference
from workbench.layers.rotary import apply_rotary


class TorchOps:
    name = "torch"

    @staticmethod
    def rope_inputs(rotary, positions: torch.Tensor, dtype: torch.dtype):
        return rotary(positions, dtype)            # (cos, sin) per token, (T, 1, D), in dtype

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, rope):
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    @staticmethod
    def rms_norm(x, weight, eps, residual=None):
        return rms_norm_reference(x, weight, eps, residual)


class TritonOps:
    name = "triton"

    def __init__(self):
        from workbench.kernels.rms_norm import rms_norm
        from workbench.kernels.rotary import apply_rotary_
        self._rms_norm, self._rotary = rms_norm, apply_rotary_

    @staticmethod
    def rope_inputs(rotary, positions: torch.Tensor, dtype: torch.dtype):
        return positions, rotary.cos, rotary.sin

    def rotary(self, q, k, rope):
        return self._rotary(q, k, *rope)

    def rms_norm(self, x, weight, eps, residual=None):
        return self._rms_norm(x, weight, eps, residual)
