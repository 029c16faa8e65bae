"""Route a model's batch-1 matmuls on CPU through the hand-written kernels of kernels/cpu.

`use_cpu_gemv(model)` switches, in place and keeping every parameter where it is:
- each bias-free bf16 `nn.Linear` (the projections, the LM head) to `GemvLinear`, whose forward
  calls torch.ops.workbench_cpu.linear_bf16;
- each Int8Linear (bf16 scales) to the int8 kernel. Int4Linear keeps aten's packed kernel, which
  is faster than a row-major loop (kernels/cpu/gemv.cpp says why).
The operators run their own loops for up to 8 rows and torch's kernels above that, so prefill and
large batches are unchanged. Nothing is copied: the weights are read in the layout they have.
"""
from __future__ import annotations

import torch
from torch import nn

from ..quant.linear import Int8Linear


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
        elif isinstance(m, Int8Linear) and m.scale.dtype == torch.bfloat16:
            m.cpu_gemv = True
        else:
            continue
        switched += 1
    return switched
