"""Quantized replacements for nn.Linear, each with a reference path and a fast path.

- Int8Linear: INT8 weights per output channel, activations in the model's dtype.
- Int4Linear: INT4 group-wise weights (RTN, GPTQ and AWQ all produce this format).
- W8A8Linear: SmoothQuant's INT8 weights *and* INT8 activations (per-token scales computed on
  the fly, or one calibrated static scale per layer), multiplied in integers with int32
  accumulation.

`impl` picks the arithmetic:
- "reference": dequantize the weight to the activation dtype, then F.linear. The specification.
- "fast": torch's packed CPU kernels (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu)
  on CPU; the Triton dequantize-and-multiply kernel (kernels/quant_matmul.py) on
  CUDA. Where no fast kernel exists for the input (fp32 activations on CPU: aten's packed kernels
  take them but are written for bf16/fp16, see FAST_CPU_DTYPES), the reference path runs; so does
  W8A8 on CPU, where the fp32 product of the integers is exact and faster than torch._int_mm.
The weight-only layers read 1 (INT8) or ~0.5 (INT4) bytes per weight instead of 2: at batch 1,
decode is bound by reading weights, so that is where the speed comes from.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.layers.formats import Int4Weight, Int8Weight, pad_to_groups

# aten's packed INT8 / INT4 CPU kernels accept fp32 activations but are written for bf16/fp16: in
# fp32 they run slower than dequantizing and F.linear (`python -m workbench.bench.cpu_gemv --x fp32
# --formats int8,int4 --rows 16,64` times aten's kernels, and with `--vs widened` the dequantized
# F.linear, each against the same loops). fp32 models take the hand-written loops of kernels/cpu
# instead (models/cpu_gemv.py).
FAST_CPU_DTYPES = (torch.bfloat16, torch.float16)


class QuantLinear(nn.Module):
    impl = "fast"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, impl={self.impl}"

    def weight_bytes(self) -> int:
        """Bytes of the quantized format (codes and scales) read by one pass over the layer."""
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers()
                   if not n.startswith("_"))

    def _use_fast(self, x: torch.Tensor) -> bool:
        if self.impl != "fast":
            return False
        return x.is_cuda or x.dtype in FAST_CPU_DTYPES


class Int8Linear(QuantLinear):
    def __init__(self, weight: Int8Weight, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scale", weight.scale.to(dtype))   # the kernels want x's dtype

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scale.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self._use_fast(x):
            if x.is_cuda:
                from workbench.kernels.quant_matmul import int8_weight_matmul
                out = int8_weight_matmul(x2, self.qweight, self.scale)
            elif self.in_features % 16 == 0:
                out = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale.to(x.dtype))
            else:   # aten's kernel crashes the process (SIGSEGV, torch 2.13) on 2+ rows here
                out = F.linear(x2, self.dequantize(x.dtype))
        else:
            out = F.linear(x2, self.dequantize(x.dtype))
        return out.view(*shape[:-1], self.out_features)


class Int4Linear(QuantLinear):
    def __init__(self, weight: Int4Weight, dtype: torch.dtype):
        super().__init__()
        self.out_features = weight.packed.shape[0]
        self.in_features = weight.in_features
        self.group_size = weight.group_size
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scale", weight.scale.to(dtype))
        self.register_buffer("minimum", weight.minimum.to(dtype))
        self._cpu_layout = None   # aten's own nibble order, built on first use (same byte count)

    def as_weight(self) -> Int4Weight:
        return Int4Weight(self.packed, self.scale.float(), self.minimum.float(), self.group_size,
                          self.in_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.as_weight().dequantize().to(dtype)

    def _pad(self, x2: torch.Tensor) -> torch.Tensor:
        pad = self.packed.shape[1] * 2 - self.in_features
        return F.pad(x2, (0, pad)) if pad else x2

    def _aten_pack(self, dtype):
        if self._cpu_layout is None or self._cpu_layout[2].dtype != dtype:
            codes = self.as_weight().codes().to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            # aten computes (q - 8) * scale + zero: zero = minimum + 8 * scale.
            scale, minimum = self.scale.float(), self.minimum.float()
            sz = torch.stack([scale, minimum + 8 * scale], dim=-1).transpose(0, 1)
            self._cpu_layout = (packed, self.group_size, sz.contiguous().to(dtype))
        return self._cpu_layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = self._pad(x.reshape(-1, self.in_features))
        if self._use_fast(x) and x.is_cuda:
            from workbench.kernels.quant_matmul import int4_weight_matmul
            out = int4_weight_matmul(x2, self.packed, self.scale, self.minimum, self.group_size)
        elif self._use_fast(x) and self.out_features % 16 == 0:   # aten packs rows by 16
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(),
                                                             *self._aten_pack(x.dtype))
        else:
            w = pad_to_groups(self.dequantize(x.dtype), self.group_size)
            out = F.linear(x2, w)
        return out.view(*shape[:-1], self.out_features)


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric INT8: each row gets its own scale, found at run time."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-8)
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_activations_int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor symmetric INT8 with a calibrated fp32 scale: values beyond the calibration
    range saturate at +-127."""
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)


class W8A8Linear(QuantLinear):
    """y = (x_q @ w_q^T) * x_scale * w_scale, integer products accumulated in int32. The input
    is expected already smoothed (divided by the migration factors folded into the previous op).
    x_scale is per token, found at run time, unless `input_scale` (an fp32 scalar, calibrated
    once: SmoothQuant's static O1-O3 settings) is given; then every token uses it."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        self.register_buffer("qweight_t", weight.qweight.t().contiguous())   # (K, N) for _int_mm
        self.register_buffer("scale", weight.scale.float())
        # A None buffer stays out of the state dict: dynamic checkpoints keep their keys.
        self.register_buffer("input_scale", None if input_scale is None
                             else input_scale.detach().float().reshape(()).clone())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight_t.t().float() * self.scale[:, None]).to(dtype)

    def integer_products(self, xq: torch.Tensor) -> torch.Tensor:
        """xq @ w_q^T as fp32 (int8 x int8 products, int32 sums)."""
        # CPU: the integers multiplied in fp32, exact below 2^24 and far faster than
        # torch._int_mm there (python -m workbench.bench.cpu_gemv --formats w8a8 --x fp32 --rows 1,256)
        if self.impl == "fast" and xq.is_cuda and xq.shape[0] > 16:
            return torch._int_mm(xq, self.qweight_t).float()
        return xq.float() @ self.qweight_t.float()   # the reference: exact below 2^24

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.input_scale is None:
            xq, xs = quantize_activations_int8(x2)
        else:
            xs = self.input_scale
            xq = quantize_activations_int8_static(x2, xs)
        out = (self.integer_products(xq) * xs * self.scale[None, :]).to(x.dtype)
        return out.view(*shape[:-1], self.out_features)


def set_impl(model: nn.Module, impl: str) -> None:
    """Switch every quantized layer of `model` between "fast" and "reference"."""
    if impl not in ("fast", "reference"):
        raise ValueError(f"impl={impl!r} is invalid: allowed are 'fast', 'reference'")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.impl = impl
