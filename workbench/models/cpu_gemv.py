"""Route a model's batch-1 bf16 matmuls on CPU through the hand-written kernel of kernels/cpu.

`use_cpu_gemv(model)` switches each bias-free bf16 `nn.Linear` (the projections, the LM head) to
`GemvLinear`, in place: the same parameters, the same state dict, only the forward differs. The
operator runs its own loop for 1 or 2 rows and torch's kernel above that, so prefill and larger
batches are unchanged. Quantized layers keep aten's kernels (kernels/cpu/gemv.cpp says why).
"""
from __future__ import annotations

import torch
from torch import nn


class GemvLinear(nn.Linear):
    """An nn.Linear (no bias, bf16) whose small-batch products run the AVX-512 BF16 kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.workbench_cpu.linear_bf16(x.reshape(-1, self.in_features).contiguous(),
                                                  self.weight)
        return out.view(*shape[:-1], self.out_features)


def use_cpu_gemv(model: nn.Module) -> int:
    """Switch every eligible layer of `model`; returns how many were switched."""
    switched = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.bias is None and m.weight.dtype == torch.bfloat16 \
                and m.weight.is_contiguous():
            m.__class__ = GemvLinear
            switched += 1
    return switched
