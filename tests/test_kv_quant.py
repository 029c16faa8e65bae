"""FP8 and INT8 KV cache: row format, error bounds, capacity, and that everything the paged engine
does to blocks (chunked prefill, swap to CPU, copy-on-write, prefix reuse) moves codes and scales
together, so results do not depend on how the scheduler ran the requests."""
from __future__ import annotations

import pytest
import torch

from test_paged_equality import make_prompts, run_engine
from workbench import LLM, SamplingParams
from workbench.kv.paged_cache import kv_bytes_per_token
from workbench.models.llama import LlamaArgs
from workbench.layers.kv_formats import dequantize_rows, quantize_rows


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_rows_round_trip_within_the_formats_resolution(fmt):
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-2, 2, 50)[:, None, None]   # rows of any scale
    rows = quantize_rows(x, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 68)
    back = dequantize_rows(rows, fmt, torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    if fmt == "int8":   # uniform grid: error at most half a step, step = amax / 127
        assert ((back - x).abs() <= amax / 127 / 2 * 1.0001).all()
    else:               # e4m3: 3 mantissa bits, relative error at most 2^-4 (above the subnormals)
        normal = x.abs() > amax / 448 * 2 ** -6 * 64
        assert ((back - x).abs()[normal] <= x.abs()[normal] * 2 ** -4 * 1.0001).all()
    # the scale sits in the row's last 4 bytes
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.allclose(scale, amax / (127 if fmt == "int8" else 448))


def test_capacity_nearly_doubles():
    args = LlamaArgs(vocab_size=8, hidden_size=576, intermediate_size=8, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=1e4, max_position_embeddings=8, tie_word_embeddings=True)
    bf16 = kv_bytes_per_token(args, torch.bfloat16)
    assert bf16 == 2 * 30 * 3 * 64 * 2
    for fmt in ("fp8", "int8"):
        assert kv_bytes_per_token(args, torch.bfloat16, fmt) == 2 * 30 * 3 * 68
        assert bf16 / kv_bytes_per_token(args, torch.bfloat16, fmt) == pytest.approx(128 / 68)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_same_budget_holds_more_tokens(tiny_folder, fmt):
    kw = dict(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
              kv_cache_memory=2**20, max_model_len=128)
    plain, quant = LLM(**kw).engine, LLM(kv_cache_dtype=fmt, **kw).engine
    ratio = quant.plan.num_kv_blocks / plain.plan.num_kv_blocks
    # 32 bytes vs 20 per (token, head) at the tiny model's head_dim 16 (SmolLM2's 64: 128 vs 68)
    assert ratio == pytest.approx(32 / 20, rel=0.01)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_block_operations_move_codes_with_scales(tiny_folder, fmt):
    """Greedy tokens with a quantized cache are the same whether prompts ran in odd chunks, in a
    pool so small that sequences were swapped out and back, or with prefix blocks shared."""
    prompts = make_prompts()
    base, _ = run_engine(tiny_folder, prompts, block_size=8, kv_cache_dtype=fmt)
    swapped, engine = run_engine(tiny_folder, prompts, block_size=8, num_kv_blocks=14,
                                 preemption_mode="swap", max_num_seqs=6, kv_cache_dtype=fmt)
    assert sum(r.blocks_swapped_out for r in engine.trace) > 0
    assert swapped == base
    chunked, _ = run_engine(tiny_folder, prompts, block_size=4, max_num_batched_tokens=7,
                            enable_prefix_caching=True, kv_cache_dtype=fmt)
    assert chunked == base


def test_bad_kv_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4' is invalid"):
        LLM(model="random:tiny", kv_cache_dtype="fp4", verbose=False)


def test_smollm2_with_quantized_cache_stays_close(smollm2_folder):
    """On the real model, the first greedy tokens agree with the cache in the model's dtype; prints
    how far."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for fmt in ("auto", "fp8", "int8"):
        llm = LLM(model="smollm2-135m", dtype="auto", device="cpu", verbose=False,
                  kv_cache_dtype=fmt, max_model_len=128, max_num_seqs=2)
        outs[fmt] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for fmt in ("fp8", "int8"):
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                for x, y in zip(outs["auto"], outs[fmt])]
        print(fmt, "tokens equal to the model-dtype cache before the first difference:", same)
        assert min(same) >= 4
