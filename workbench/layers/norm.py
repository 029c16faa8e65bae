"""RMSNorm as transformers computes it: in fp32, cast back to the activations' dtype."""
from __future__ import annotations

import torch
from torch import nn

from workbench.kernels.reference import rms_norm_reference


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, exactly as transformers' LlamaRMSNorm does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standalone use; inside the model, the backend's ops apply the norm with the residual
        add fused (layers/ops.py)."""
        return rms_norm_reference(x, self.weight, self.eps)
