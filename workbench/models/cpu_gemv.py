"""Route a model's batch-1 matmuls on CPU through the hand-written kernels of kernels/cpu.

`use_cpu_gemv(model)` switches, in place (the same parameters, the same state dict, only the
forward differs), for bf16 or fp32 activations:
- each bias-free bf16 or fp32 `nn.Linear` (the projections, the LM head) to `GemvLinear`;
- each INT8 weight-only layer (`Int8Linear`: INT8 models, and the LM head of every quantized
  model) to `Int8GemvLinear`: its loop reads the head's codes at closer to the memory's rate than
  aten's `_weight_int8pack_mm` at batch 1 (`python -m workbench.bench.cpu_gemv --formats int8,int4`
  times both);
- each SmoothQuant layer (`W8A8Linear`) to `W8A8GemvLinear`: the INT8 activations go through the
  INT8 weight kernel as exact fp32 integers, far faster than torch._int_mm on a CPU
  (`python -m workbench.bench.cpu_gemv --x fp32 --formats w8a8`);
- each INT4 layer (`Int4Linear`, an even group size, rows a multiple of 16) to
  `Int4GemvLinear`: both it and aten's `_weight_int4pack_mm_for_cpu` are compute-bound at batch 1,
  ours on fewer instructions per code; with fp32 activations it also beats the fp32 F.linear,
  while aten's kernel, which takes fp32 x, runs many times slower (`python -m workbench.bench.cpu_gemv
  --x fp32,bf16 --formats int4`; kernels/cpu/gemv.cpp, int4_rows).
The operators run their own loops for a few rows (1-2 for bf16 activations, more for fp32 ones)
and torch's kernels above that, so prefill and larger batches are unchanged.

`store_weights_bf16(model)` rounds the weights of the fp32 GemvLinear layers to bf16 and keeps
the activations fp32 (`dtype="auto"` on CPUs without native bf16): a decode step reads half the
bytes, the loops widen bf16 to fp32 in registers, and the weights are those of a bf16 model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.layers.linear import Int4Linear, Int8Linear, W8A8Linear


ACTIVATIONS = (torch.bfloat16, torch.float32)


def _needs_grad(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernels write into preallocated outputs and have no backward: a product autograd must
    record goes to torch's linear."""
    return torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)


class GemvLinear(nn.Linear):
    """An nn.Linear (no bias, bf16 or fp32 weight) whose small-batch products run the kernels'
    loops (x bf16 or fp32; an fp32 weight needs fp32 x)."""

    def runs_loops(self, x: torch.Tensor) -> bool:
        """Whether x goes to the kernel (else torch's linear)."""
        w = self.weight
        return (x.dtype in ACTIVATIONS and not (w.dtype == torch.float32 and x.dtype != w.dtype)
                and not _needs_grad(x, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if _needs_grad(x, w):       # training through the layer (experiments/cla_distill.py): x's dtype
            return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))
        if not self.runs_loops(x):
            return super().forward(x)
        shape = x.shape
        op = torch.ops.workbench_cpu.linear_fp32 if w.dtype == torch.float32 \
            else torch.ops.workbench_cpu.linear_bf16
        out = op(x.reshape(-1, self.in_features).contiguous(), w)
        return out.view(*shape[:-1], self.out_features)


def _runs_kernel(layer, x: torch.Tensor) -> bool:
    """Whether a quantized layer's fast path takes x on the kernels (bf16 or fp32 on CPU; fp32
    never reaches aten's packed kernels, which are slow for it: layers/linear.py)."""
    return layer.impl == "fast" and x.device.type == "cpu" and x.dtype in ACTIVATIONS


class Int8GemvLinear(Int8Linear):
    """An Int8Linear whose products on CPU run the kernel's INT8 loop (same formula as aten's:
    fp32 sums of x * w, times the row's scale, rounded once to x's dtype)."""

    def runs_loops(self, x: torch.Tensor) -> bool:
        return _runs_kernel(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _runs_kernel(self, x):
            return super().forward(x)
        shape = x.shape
        out = torch.ops.workbench_cpu.linear_int8(x.reshape(-1, self.in_features).contiguous(),
                                                  self.qweight, self.scale)
        return out.view(*shape[:-1], self.out_features)


class Int4GemvLinear(Int4Linear):
    """An Int4Linear whose products on CPU run the kernel's INT4 loop for a few rows (aten's
    kernel, on its own layout of the same codes, above that)."""

    def runs_loops(self, x: torch.Tensor) -> bool:
        return _runs_kernel(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _runs_kernel(self, x):
            return super().forward(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()      # the op reads the padding as 0
        aten_packed, group_size, aten_scale_zero = self._aten_pack(x.dtype)
        out = torch.ops.workbench_cpu.linear_int4(x2, self.packed, self.scale, self.minimum,
                                                  group_size, aten_packed, aten_scale_zero)
        return out.view(*shape[:-1], self.out_features)


class W8A8GemvLinear(W8A8Linear):
    """A W8A8Linear whose products on CPU run the INT8 weight loop (few rows) or its widened GEMM
    (more) on the quantized activations held as fp32 integers, with unit scales: every product is
    exact and so is each sum below 2^24, so the sums equal torch._int_mm's int32 ones, whatever
    the number of rows (python -m workbench.bench.cpu_gemv --formats w8a8 --x fp32 --rows 1,256)."""

    def integer_products(self, xq: torch.Tensor) -> torch.Tensor:
        if self.impl != "fast" or xq.device.type != "cpu":
            return super().integer_products(xq)
        return torch.ops.workbench_cpu.linear_int8(xq.float(), self.qweight_t.t(), self._ones)


def use_cpu_gemv(model: nn.Module) -> int:
    """Switch every eligible layer of `model`; returns how many were switched."""
    switched = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.bias is None and m.weight.dtype in ACTIVATIONS \
                and m.weight.is_contiguous():
            m.__class__ = GemvLinear
            switched += 1
        elif type(m) is Int8Linear and m.qweight.is_contiguous() \
                and m.scale.dtype in ACTIVATIONS:
            m.__class__ = Int8GemvLinear
            switched += 1
        elif type(m) is Int4Linear and m.group_size % 2 == 0 and m.out_features % 16 == 0 \
                and m.scale.dtype in ACTIVATIONS and m.packed.is_contiguous():
            m.__class__ = Int4GemvLinear
            switched += 1
        elif type(m) is W8A8Linear:
            # the kernel reads (N, K) rows; qweight_t (the state dict's name) becomes their view
            m.qweight_t = m.qweight_t.t().contiguous().t()
            m._ones = torch.ones(m.out_features)
            m.__class__ = W8A8GemvLinear
            switched += 1
    return switched


def store_weights_bf16(model: nn.Module) -> int:
    """Round each fp32 GemvLinear weight to bf16 (as a bf16 model's are); returns how many. A head
    tied to the embedding gets its own bf16 copy, and the table stays fp32 for the lookup."""
    stored = 0
    for m in model.modules():
        if type(m) is GemvLinear and m.weight.dtype == torch.float32:
            half = m.weight.detach().to(torch.bfloat16)
            m.weight = nn.Parameter(half, requires_grad=m.weight.requires_grad)
            stored += 1
    return stored
