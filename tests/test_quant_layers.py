"""Quantized formats and layers against their references.

- formats: round trips within half a step, nibble packing, ragged last groups;
- the fast CPU paths (torch's packed INT8/INT4 kernels) against dequantize + F.linear, and W8A8's
  integer product (fp32 on CPU, on the kernels/cpu loops too) against torch._int_mm's;
- the Triton dequantize-and-multiply kernel (interpreter on CPU, native on CUDA) against the same.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import KERNEL_DEVICES
from workbench.kernels.cpu import available as cpu_kernels_available
from workbench.kernels.quant_matmul import int4_weight_matmul, int8_weight_matmul
from workbench.layers.formats import (pack_int4, pad_to_groups, quantize_int4, quantize_int8,
                                     unpack_int4)
from workbench.layers.linear import Int4Linear, Int8Linear, W8A8Linear, quantize_activations_int8


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(40, 70) * torch.linspace(0.01, 10, 40)[:, None]
    q = quantize_int8(w)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 * 1.0001).all()


def test_int8_in_row_chunks_equals_the_whole_matrix_at_once():
    """quantize_int8 works through the rows in chunks (to bound its fp32 temporaries on a large
    LM head); every row is quantized on its own, so chunking changes nothing, bit for bit."""
    w = (torch.randn(37, 48) * torch.logspace(-2, 1, 37)[:, None]).to(torch.bfloat16)
    whole = quantize_int8(w, rows_per_chunk=10**6)
    for chunk in (1, 5, 36):
        part = quantize_int8(w, rows_per_chunk=chunk)
        assert torch.equal(part.qweight, whole.qweight) and torch.equal(part.scale, whole.scale)
    reference_scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-12)
    assert torch.equal(whole.scale, reference_scale)
    assert torch.equal(whole.qweight, torch.round(w.float() / reference_scale[:, None])
                       .clamp(-127, 127).to(torch.int8))


@pytest.mark.parametrize("in_features,group", [(128, 32), (576, 128), (70, 64)])
def test_int4_round_trip_and_ragged_groups(in_features, group):
    torch.manual_seed(0)
    w = torch.randn(24, in_features)
    q = quantize_int4(w, group)
    assert q.packed.shape == (24, -(-in_features // group) * group // 2)
    back = q.dequantize()
    assert back.shape == w.shape
    step = q.scale.repeat_interleave(group, dim=1)[:, :in_features]
    assert ((back - w).abs() <= step / 2 * 1.0001).all()
    codes = q.codes()
    assert codes.max() <= 15 and torch.equal(unpack_int4(pack_int4(codes)), codes)


def test_nibble_order_is_documented_one():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_int4(codes).tolist() == [[1 | 2 << 4, 3 | 4 << 4]]


def test_group_size_is_validated():
    with pytest.raises(ValueError, match="group_size=48 is invalid"):
        quantize_int4(torch.randn(4, 96), 48)


def reference_linear(layer, x):
    w = layer.dequantize(torch.float32)
    if isinstance(layer, Int4Linear):
        return F.linear(x.float(), w)
    return F.linear(x.float(), w)


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("kind", ["int8", "int8-ragged", "int4", "int4-ragged"])
def test_fast_cpu_path_matches_reference(rows, kind):
    """int8-ragged: 40 input features, where aten's INT8 kernel would crash the process on 2+
    rows (torch 2.13); the layer takes its reference path there instead."""
    torch.manual_seed(rows)
    in_features = {"int4-ragged": 576, "int8-ragged": 40}.get(kind, 256)
    w = torch.randn(96, in_features) / 16
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    layer = (Int8Linear(quantize_int8(w), torch.bfloat16) if kind.startswith("int8")
             else Int4Linear(quantize_int4(w, 128), torch.bfloat16))
    fast = layer(x)
    layer.impl = "reference"
    ref = layer(x)
    exact = F.linear(x.float(), layer.dequantize(torch.float32))
    # bf16 output rounding: both paths are within a few bf16 steps of the exact product
    tol = exact.abs().max().item() * 2 ** -6
    assert (fast.float() - exact).abs().max().item() < tol
    assert (ref.float() - exact).abs().max().item() < tol


def test_w8a8_integer_path_equals_its_reference():
    torch.manual_seed(1)
    w = torch.randn(64, 128) / 8
    x = torch.randn(5, 128).to(torch.bfloat16)
    layer = W8A8Linear(quantize_int8(w), torch.bfloat16)
    xq, xs = quantize_activations_int8(x)
    assert ((xq.float() * xs - x.float()).abs() <= xs / 2 * 1.0001).all()
    # the integer truth: torch._int_mm's int32 sums, scaled as the layer scales them
    truth = (torch._int_mm(xq, layer.qweight_t).float() * xs
             * layer.scale[None, :]).to(x.dtype)
    assert torch.equal(layer(x), truth)
    layer.impl = "reference"
    assert torch.equal(layer(x), truth)


@pytest.mark.parametrize("rows", [1, 3, 17, 65, 300])
def test_w8a8_on_the_cpu_kernels_equals_the_integer_product(rows):
    ok, why = cpu_kernels_available()
    if not ok:
        pytest.skip(why)
    from workbench.models.cpu_gemv import W8A8GemvLinear, use_cpu_gemv
    torch.manual_seed(rows)
    model = torch.nn.Sequential(W8A8Linear(quantize_int8(torch.randn(96, 1536) / 8), torch.float32))
    x = torch.randn(rows, 1536) * 3
    before = model(x)
    assert use_cpu_gemv(model) == 1 and type(model[0]) is W8A8GemvLinear
    assert model[0].qweight_t.t().is_contiguous()       # the kernel's (N, K) rows
    assert torch.equal(model(x), before)                 # every sum is an exact integer here
    assert torch.equal(model(x[:1]), before[:1])         # and a row's output ignores the others


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 20])
def test_triton_int8_matmul(device, dtype, rows):
    torch.manual_seed(2)
    w = torch.randn(40, 72)
    q = quantize_int8(w)
    x = torch.randn(rows, 72).to(device, dtype)
    out = int8_weight_matmul(x, q.qweight.to(device), q.scale.to(device, dtype))
    ref = F.linear(x.float(), q.dequantize().to(device))
    tol = 1e-4 if dtype == torch.float32 else ref.abs().max().item() * 2 ** -6
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,group", [(96, 64), (128, 32)])
def test_triton_int4_matmul(device, dtype, in_features, group):
    torch.manual_seed(3)
    w = torch.randn(40, in_features)
    q = quantize_int4(w, group)
    x = pad_to_groups(torch.randn(3, in_features), group).to(device, dtype)
    out = int4_weight_matmul(x, q.packed.to(device), q.scale.to(device, dtype),
                             q.minimum.to(device, dtype), group)
    ref = F.linear(x.float()[:, :in_features], q.dequantize().to(device))
    tol = 1e-4 if dtype == torch.float32 else ref.abs().max().item() * 2 ** -6
    assert (out.float() - ref).abs().max().item() < tol
