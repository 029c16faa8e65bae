"""2:4 weights on the kernels that read them: PyTorch's semi-structured sparse tensors.

    2:4-pruned nn.Linear (dense, half its weights zero)
      -> torch.sparse.to_sparse_semi_structured(weight): the kept values (half the columns) plus
         2-bit position metadata, the layout sparse tensor cores read (cuSPARSELt or CUTLASS)
      -> F.linear(x, weight) dispatches to the sparse matmul; the zeros are never multiplied

Sparse tensor cores exist on NVIDIA GPUs of compute capability 8.0 and newer (Ampere onward), for
fp16, bf16 and int8 weights whose shape is a multiple of (32, 64). Nothing on a CPU reads the
format, so there the engine keeps the dense tensor with its zeros and runs at dense speed
(`python -m workbench.bench compress` measures that). On a GPU, `python -m workbench.bench compress
--device cuda` times decode with these weights (variants `<method>-2:4-semi`) against dense.
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.quant.gptq import ORDER, get_module
from workbench.compress.masks import follows_pattern

MIN_CAPABILITY = (8, 0)
DTYPES = (torch.float16, torch.bfloat16)


def unsupported(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why 2:4 semi-structured kernels cannot run for this device and dtype, or None if they can."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"they need a CUDA GPU with compute capability >= {MIN_CAPABILITY[0]}.0, and this "
                f"engine runs on {device.type}; no kernel here reads 2:4 weights on a CPU")
    if not torch.cuda.is_available():
        return "they need CUDA, which this PyTorch cannot use"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"they need compute capability >= {MIN_CAPABILITY[0]}.0 (Ampere or newer); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    if dtype not in DTYPES:
        return f"they need fp16 or bf16 weights; this engine runs {dtype}"
    return None


@torch.no_grad()
def to_semi_structured(model: nn.Module) -> int:
    """Replace every decoder projection's dense 2:4 weight by a semi-structured sparse tensor, in
    place; returns how many were converted. Raises ValueError naming a projection that does not
    follow 2:4 (converting it would silently drop weights)."""
    from torch.sparse import to_sparse_semi_structured
    count = 0
    for index, layer in enumerate(model.layers):
        for path in ORDER:
            linear = get_module(layer, path)[2]
            if not follows_pattern(linear.weight, "2:4"):
                raise ValueError(f"layers.{index}.{path} does not follow the 2:4 pattern: prune "
                                 "with pruning_config={'pattern': '2:4'} first")
            linear.weight = nn.Parameter(to_sparse_semi_structured(linear.weight.detach()),
                                         requires_grad=False)
            count += 1
    return count


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """The dense form of a weight, semi-structured or not (for saving a checkpoint)."""
    from torch.sparse import SparseSemiStructuredTensor
    return weight.to_dense() if isinstance(weight, SparseSemiStructuredTensor) else weight
