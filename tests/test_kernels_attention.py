"""The attention kernels against their plain-PyTorch references (kernels/reference.py).

On CPU they run in Triton's interpreter; the same tests run natively when CUDA is present. Shapes
are small and chosen for the edges: one token, lengths that are not a multiple of the tile (16 in
the interpreter, 64/128 on a GPU), fewer queries than keys (bottom-right causal), GQA ratios 1, 3
and 8, block tables with holes, shared blocks, and empty splits.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from conftest import KERNEL_DEVICES
from workbench.kernels.flash_attention import flash_attention, flash_attention_varlen
from workbench.kernels.paged_decode import paged_decode_attention
from workbench.kernels.reference import (attention_reference, paged_attention_reference,
                               paged_decode_reference, varlen_attention_reference)

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
GQA = [(4, 4), (6, 2), (8, 1)]          # (heads, kv_heads): ratios 1, 3, 8


def close(out, ref, dtype, tol=None):
    tol = TOL[dtype] if tol is None else tol
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol} for {dtype}"


def randn(*shape, device, dtype=torch.float32):
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (1, 37), (16, 16), (33, 33), (17, 50)])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_flash_attention_matches_reference(device, causal, seq_q, seq_k, heads, kv_heads):
    torch.manual_seed(seq_q * 100 + seq_k)
    q = randn(2, heads, seq_q, 64, device=device)
    k, v = randn(2, kv_heads, seq_k, 64, device=device), randn(2, kv_heads, seq_k, 64, device=device)
    out = flash_attention(q, k, v, causal=causal)
    close(out, attention_reference(q, k, v, causal=causal), torch.float32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_half_precision(device, dtype, head_dim):
    torch.manual_seed(1)
    q = randn(1, 6, 40, head_dim, device=device, dtype=dtype)
    k, v = (randn(1, 2, 40, head_dim, device=device, dtype=dtype) for _ in range(2))
    out = flash_attention(q, k, v, causal=True)
    assert out.dtype == dtype
    close(out, attention_reference(q, k, v, causal=True), dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_flash_attention_equals_sdpa(device):
    """The reference is the spec; SDPA is the peer users know. All three agree."""
    torch.manual_seed(2)
    q = randn(2, 8, 45, 64, device=device)
    k, v = randn(2, 2, 45, 64, device=device), randn(2, 2, 45, 64, device=device)
    for causal in (True, False):
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        close(flash_attention(q, k, v, causal=causal), sdpa, torch.float32)
    scaled = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    close(flash_attention(q, k, v, causal=True, sm_scale=0.3), scaled, torch.float32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_varlen_packed_bottom_right(device):
    """Packed sequences of different lengths, some with fewer queries than keys."""
    torch.manual_seed(3)
    q_lens, k_lens = [1, 17, 32, 5], [1, 40, 32, 9]
    cu_q = torch.tensor([0] + q_lens, device=device).cumsum(0)
    cu_k = torch.tensor([0] + k_lens, device=device).cumsum(0)
    q = randn(sum(q_lens), 6, 64, device=device)
    k, v = randn(sum(k_lens), 2, 64, device=device), randn(sum(k_lens), 2, 64, device=device)
    for causal in (True, False):
        out = flash_attention_varlen(q, k, v, cu_q, max(q_lens), cu_seqlens_k=cu_k, causal=causal)
        close(out, varlen_attention_reference(q, k, v, cu_q, cu_k, causal=causal), torch.float32)


def paged_setup(seq_lens, block_size, kv_heads, head_dim, device, share_first=False, seed=0,
                dtype=torch.float32):
    """A cache larger than needed, filled with noise; each sequence's blocks are scattered (holes
    between them), tables are padded with a garbage block id, and with `share_first` sequences 0
    and 1 start with the same block (a shared prefix)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4 * sum(-(-n // block_size) for n in seq_lens) + 8
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in seq_lens) + 1
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append([order.pop() for _ in range(need)] + [num_blocks - 1] * (width - need))
    if share_first and len(tables) > 1:
        tables[1][0] = tables[0][0]
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    block_table = torch.tensor(tables, device=device, dtype=torch.int32)
    return k_cache, v_cache, block_table, torch.tensor(seq_lens, device=device, dtype=torch.int32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_varlen_paged_chunked_prefill(device, block_size, heads, kv_heads):
    """Chunks of prompts on top of cached blocks, mixed with a decode row and a fresh prompt."""
    torch.manual_seed(4)
    seq_lens, q_lens = [37, 9, 1, 20], [5, 9, 1, 1]
    k_cache, v_cache, table, lens = paged_setup(seq_lens, block_size, kv_heads, 64, device,
                                                share_first=True)
    cu_q = torch.tensor([0] + q_lens, device=device).cumsum(0)
    q = randn(sum(q_lens), heads, 64, device=device)
    out = flash_attention_varlen(q, k_cache, v_cache, cu_q, max(q_lens), seq_lens_k=lens,
                                 block_table=table, block_size=block_size)
    ref = paged_attention_reference(q, k_cache, v_cache, cu_q, lens, table, block_size)
    close(out, ref, torch.float32)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_varlen_paged_random_batches(data):
    """Random batches: any mix of lengths, chunk sizes, block sizes and GQA ratio."""
    num_seqs = data.draw(st.integers(1, 4))
    seq_lens = data.draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    q_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    block_size = data.draw(st.sampled_from([1, 2, 8, 16, 32]))
    heads, kv_heads = data.draw(st.sampled_from(GQA))
    k_cache, v_cache, table, lens = paged_setup(seq_lens, block_size, kv_heads, 32, "cpu",
                                                seed=data.draw(st.integers(0, 1000)))
    cu_q = torch.tensor([0] + q_lens).cumsum(0)
    q = torch.randn(sum(q_lens), heads, 32)
    out = flash_attention_varlen(q, k_cache, v_cache, cu_q, max(q_lens), seq_lens_k=lens,
                                 block_table=table, block_size=block_size)
    close(out, paged_attention_reference(q, k_cache, v_cache, cu_q, lens, table, block_size),
          torch.float32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 5, 40])   # 40: most splits are empty
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_paged_decode_matches_reference(device, num_splits, heads, kv_heads):
    torch.manual_seed(5)
    seq_lens = [1, 70, 16, 33]
    k_cache, v_cache, table, lens = paged_setup(seq_lens, 16, kv_heads, 64, device,
                                                share_first=True)
    q = randn(len(seq_lens), heads, 64, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, 16, num_splits=num_splits)
    close(out, paged_decode_reference(q, k_cache, v_cache, table, lens, 16), torch.float32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_half_precision(device, dtype, head_dim):
    torch.manual_seed(6)
    seq_lens = [50, 3]
    k_cache, v_cache, table, lens = paged_setup(seq_lens, 8, 2, head_dim, device, dtype=dtype)
    q = randn(2, 6, head_dim, device=device, dtype=dtype)
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, 8, num_splits=3)
    assert out.dtype == dtype
    close(out, paged_decode_reference(q, k_cache, v_cache, table, lens, 8), dtype)


def test_split_count_does_not_change_the_answer():
    """Merging log-sum-exp weighted partials is exact: 1 split and 7 splits agree to rounding."""
    torch.manual_seed(7)
    k_cache, v_cache, table, lens = paged_setup([100, 64], 16, 3, 64, "cpu")
    q = torch.randn(2, 9, 64) * 4          # peaked softmax: the max matters
    one = paged_decode_attention(q, k_cache, v_cache, table, lens, 16, num_splits=1)
    seven = paged_decode_attention(q, k_cache, v_cache, table, lens, 16, num_splits=7)
    assert (one - seven).abs().max().item() < 2e-6


def test_bad_inputs_name_the_problem():
    q = torch.randn(1, 4, 8, 48)
    with pytest.raises(ValueError, match="head_dim=48"):
        flash_attention(q, q, q)
    q = torch.randn(1, 6, 8, 64)
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        flash_attention(q, torch.randn(1, 4, 8, 64), torch.randn(1, 4, 8, 64))
    with pytest.raises(ValueError, match="seq_q <= seq_k"):
        flash_attention(torch.randn(1, 2, 9, 64), torch.randn(1, 2, 4, 64),
                        torch.randn(1, 2, 4, 64), causal=True)
    q = torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match=r"q_len <= kv_len for every sequence \(q_lens \[5\], "
                                         r"kv_lens \[3\]\)"):
        flash_attention_varlen(q, q[:3], q[:3], torch.tensor([0, 5]), 5,
                               cu_seqlens_k=torch.tensor([0, 3]))
    k_cache = torch.randn(40, 2, 64)
    with pytest.raises(ValueError, match="block_size=3"):
        paged_decode_attention(torch.randn(1, 2, 64), k_cache, k_cache,
                               torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]), 3)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_kv_cache_is_dequantized_on_read(device, fmt, dtype):
    """Both attention kernels read FP8/INT8 rows (codes + scale) and agree with the reference
    run on the dequantized cache: quantization error is the cache's, not the kernel's."""
    from workbench.layers.kv_formats import dequantize_rows, quantize_rows
    torch.manual_seed(8)
    seq_lens, q_lens = [37, 9, 1], [5, 9, 1]
    k_cache, v_cache, table, lens = paged_setup(seq_lens, 8, 2, 64, device)
    kq, vq = quantize_rows(k_cache, fmt), quantize_rows(v_cache, fmt)
    kd, vd = (dequantize_rows(c, fmt, dtype) for c in (kq, vq))   # dequantized to q's dtype
    cu_q = torch.tensor([0] + q_lens, device=device).cumsum(0)
    q = randn(sum(q_lens), 6, 64, device=device, dtype=dtype)
    out = flash_attention_varlen(q, kq, vq, cu_q, max(q_lens), seq_lens_k=lens, block_table=table,
                                 block_size=8, kv_cache_dtype=fmt)
    ref = paged_attention_reference(q, kd, vd, cu_q, lens, table, 8)
    # The interpreter truncates the dequantized bf16 values (a GPU rounds them, as the reference
    # does): a one-sided error of up to one bf16 step in every key and value.
    tol = 5e-2 if dtype == torch.bfloat16 and device == "cpu" else None
    close(out, ref, dtype, tol)
    qd = randn(3, 6, 64, device=device, dtype=dtype)
    out = paged_decode_attention(qd, kq, vq, table, lens, 8, num_splits=3, kv_cache_dtype=fmt)
    close(out, paged_decode_reference(qd, kd, vd, table, lens, 8), dtype, tol)
    with pytest.raises(ValueError, match="needs a paged uint8 cache"):
        paged_decode_attention(qd, k_cache, v_cache, table, lens, 8, kv_cache_dtype=fmt)
