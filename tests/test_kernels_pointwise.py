"""Fused RMSNorm (+ residual add) and rotary embedding against their references.

The kernels round where the reference rounds, so on a GPU they agree bit for bit in every dtype.
Triton's interpreter truncates fp32 -> bf16/fp16 casts instead of rounding to nearest, so on CPU
half-precision results may differ by one unit in the last place; fp32 agrees to float rounding.
"""
from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_DEVICES
from workbench.kernels.reference import rms_norm_reference, rotary_reference
from workbench.kernels.rms_norm import rms_norm
from workbench.kernels.rotary import apply_rotary_
from workbench.layers.rotary import RotaryEmbedding
from workbench.models.llama import LlamaArgs


def ulp_close(out, ref, device):
    if device == "cuda" or out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6 if out.dtype == torch.float32 else 0)
        return
    # The interpreter truncates at each of the two or three roundings: a couple of units in the
    # last place, at the magnitude of the operands (values here are of order 1).
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out, ref, rtol=2 * eps, atol=2 * eps)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576])          # 576: SmolLM2's, not a power of two
def test_rms_norm(device, dtype, hidden):
    torch.manual_seed(0)
    x = torch.randn(7, hidden, device=device).to(dtype)
    w = torch.randn(hidden, device=device).to(dtype)
    ulp_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fused_residual(device, dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 576, device=device).to(dtype)
    residual = torch.randn(5, 576, device=device).to(dtype)
    w = torch.randn(576, device=device).to(dtype)
    ref_out, ref_sum = rms_norm_reference(x, w, 1e-5, residual.clone())
    buffer = residual.clone()
    out, new_residual = rms_norm(x, w, 1e-5, buffer)
    assert new_residual.data_ptr() == buffer.data_ptr()   # updated in place, no new allocation
    ulp_close(new_residual, ref_sum, device)
    ulp_close(out, ref_out, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 128)])
def test_rotary_in_place_on_fused_qkv_views(device, dtype, heads, kv_heads, head_dim):
    """q and k are strided views into one QKV row, as in the model; v must stay untouched."""
    torch.manual_seed(2)
    args = LlamaArgs(vocab_size=8, hidden_size=heads * head_dim, intermediate_size=8,
                     num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=300, tie_word_embeddings=True)
    rope = RotaryEmbedding(args, 300)
    cos, sin = rope.cos.to(device), rope.sin.to(device)
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.tensor([0, 1, 5, 77, 150, 299], device=device)
    ref_q, ref_k = (rotary_reference(t.clone(), positions, cos, sin) for t in (q, k))
    apply_rotary_(q, k, positions, cos, sin)
    ulp_close(q, ref_q, device)
    ulp_close(k, ref_k, device)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)


def test_rotary_reference_is_the_models_arithmetic():
    """The spec the kernel is held to is the model's own rotate-half code (transformers')."""
    from workbench.layers.rotary import apply_rotary
    args = LlamaArgs(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True)
    rope = RotaryEmbedding(args, 64)
    x = torch.randn(5, 2, 64).to(torch.bfloat16)
    positions = torch.tensor([0, 3, 9, 20, 63])
    cos, sin = rope(positions, torch.bfloat16)
    assert torch.equal(rotary_reference(x, positions, rope.cos, rope.sin),
                       apply_rotary(x, cos, sin))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="weight has 8 elements"):
        rms_norm(torch.randn(2, 16), torch.randn(8), 1e-5)
    q = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="disagree"):
        apply_rotary_(q, torch.randn(4, 2, 16), torch.arange(3), torch.randn(8, 16),
                      torch.randn(8, 16))
