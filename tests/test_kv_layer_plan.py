"""Per-layer KV formats: the INT4 row format bit for bit, plan parsing and its errors, the cache a
plan allocates, and that a plan runs the same tokens as a single format where it must."""
from __future__ import annotations

import math

import pytest
import torch

from test_paged_equality import make_prompts, run_engine
from workbench import LLM, SamplingParams
from workbench.kv.paged_cache import kv_bytes_per_token
from workbench.models.llama import LlamaArgs
from workbench.layers.kv_formats import dequantize_rows, quantize_rows
from workbench.config.kv_plan import layer_kv_dtypes, resolve


def test_int4_rows_pack_two_codes_per_byte_exactly():
    codes = torch.tensor([[-7, 7, 0, 3, -1, 5, 2, -4]])
    x = codes.float() * 0.25                     # a power-of-two scale: every step exact
    rows = quantize_rows(x, "int4")
    assert rows.dtype == torch.uint8 and rows.shape == (1, 4 + 4)
    nib = (codes + 8).tolist()[0]
    assert rows[0, :4].tolist() == [nib[2 * j] | (nib[2 * j + 1] << 4) for j in range(4)]
    assert rows[0, 4:].contiguous().view(torch.float32).item() == 0.25   # max|x| / 7
    assert torch.equal(dequantize_rows(rows, "int4", torch.float32), x)


def test_int4_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(40, 3, 64) * torch.logspace(-2, 2, 40)[:, None, None]
    back = dequantize_rows(quantize_rows(x, "int4"), "int4", torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert ((back - x).abs() <= amax / 14 * 1.0001).all()
    # the grid is used: some element of every row lands exactly on +-max|x|
    assert torch.allclose(back.abs().amax(-1, keepdim=True), amax)


def test_int4_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="head_dim=15"):
        quantize_rows(torch.randn(2, 15), "int4")


def test_plans_parse_to_one_format_per_layer():
    assert layer_kv_dtypes("auto:0-1,int8:2-3,int4:4") == ("auto",) * 2 + ("int8",) * 2 + ("int4",)
    assert layer_kv_dtypes(["int8", "auto"], 2) == ("int8", "auto")
    assert layer_kv_dtypes("int8") is None
    assert resolve("int8:0-3", 4) == "int8"          # uniform plans become the single format
    assert resolve(["auto", "int4"], 2) == ("auto", "int4")


@pytest.mark.parametrize("value, why", [
    ("int8:0-3,auto:3-5", "layer 3 is given twice"),
    ("int8:1-5", r"layer\(s\) \[0\] are not covered"),
    ("int9:0-5", "'int9:0-5' is not FORMAT:FIRST-LAST"),
    ("int8:3-1", "range .3-1. ends before it starts"),
    ("int8:a-b", ".a-b. is not a layer range"),
    (["auto", "int3"], r"unknown format\(s\) \['int3'\]"),
    (7, "it must be a format name"),
])
def test_bad_plans_name_the_field_value_and_reason(value, why):
    with pytest.raises(ValueError, match=f"kv_cache_dtype=.* is invalid: {why}.*allowed"):
        LLM(model="random:tiny", kv_cache_dtype=value, verbose=False)


def test_plan_length_is_checked_against_the_model():
    with pytest.raises(ValueError, match="it covers 3 layers and the model has 2"):
        LLM(model="random:tiny", kv_cache_dtype="auto:0,int8:1-2", verbose=False)


def test_mixed_plans_refuse_what_reads_one_format():
    with pytest.raises(ValueError, match="attention_backend='triton' is invalid"):
        LLM(model="random:tiny", kv_cache_dtype="auto:0,int8:1", attention_backend="triton",
            verbose=False)
    with pytest.raises(ValueError, match="speculative_config=.* is invalid with a per-layer"):
        LLM(model="random:tiny", kv_cache_dtype=["auto", "int8"], verbose=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_mixed_plan_allocates_each_layer_in_its_format(tiny_folder):
    plan = ["auto", "int8", "int4"]
    llm = LLM(model="random:tiny-mha", dtype="bfloat16", device="cpu", verbose=False,
              max_model_len=64, num_kv_blocks=5, block_size=8, kv_cache_dtype=plan)
    cache, args = llm.engine.cache, llm.engine.model_args
    heads, d = args.num_key_value_heads, args.head_dim          # 4 kv heads of 16
    expected = [(torch.bfloat16, d), (torch.uint8, d + 4), (torch.uint8, d // 2 + 4)]
    assert len(cache.kv_caches) == len(expected)
    for (k, v), (dtype, width) in zip(cache.kv_caches, expected):
        assert k.dtype == v.dtype == dtype and k.shape == v.shape == (40, heads, width)
    # bytes per token: K and V of every head, each layer in its own row size
    hand = 2 * heads * (d * 2 + (d + 4) + (d // 2 + 4))
    assert cache.bytes_per_token == hand == kv_bytes_per_token(args, torch.bfloat16, plan)
    counted = sum(t.numel() * t.element_size() for kv in cache.kv_caches for t in kv)
    assert counted == hand * cache.num_slots


def test_same_budget_holds_more_tokens_with_a_plan(tiny_folder):
    kw = dict(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
              kv_cache_memory=2**20, max_model_len=128)
    plain = LLM(**kw).engine.plan.num_kv_blocks
    mixed = LLM(kv_cache_dtype="auto:0,int4:1", **kw).engine.plan.num_kv_blocks
    # per (token, head, layer) 32 bytes in bf16 against 12 for INT4 rows at head_dim 16
    assert mixed == 2**20 // (2 * 2 * (32 + 12) * 16)
    assert mixed / plain == pytest.approx(64 / 44, rel=0.01)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_uniform_plan_is_exactly_the_single_format(tiny_folder, fmt):
    prompts = make_prompts()
    single, e1 = run_engine(tiny_folder, prompts, block_size=8, kv_cache_dtype=fmt)
    planned, e2 = run_engine(tiny_folder, prompts, block_size=8, kv_cache_dtype=f"{fmt}:0-1")
    assert planned == single
    assert e2.cache.kv_cache_dtype == fmt
    for (k1, v1), (k2, v2) in zip(e1.cache.kv_caches, e2.cache.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)     # the same bytes in every slot


def test_mixed_plan_survives_chunks_swaps_and_prefix_sharing(tiny_folder):
    """Block operations move each layer's rows in its own format: the tokens do not depend on
    how the scheduler ran the requests."""
    prompts, plan = make_prompts(), ["int4", "auto"]
    base, _ = run_engine(tiny_folder, prompts, block_size=8, kv_cache_dtype=plan)
    swapped, engine = run_engine(tiny_folder, prompts, block_size=8, num_kv_blocks=14,
                                 preemption_mode="swap", max_num_seqs=6, kv_cache_dtype=plan)
    assert sum(r.blocks_swapped_out for r in engine.trace) > 0
    assert swapped == base
    chunked, _ = run_engine(tiny_folder, prompts, block_size=4, max_num_batched_tokens=7,
                            enable_prefix_caching=True, kv_cache_dtype=plan)
    assert chunked == base


def test_mixed_plan_quantizes_only_its_layers(tiny_folder):
    """Each layer reads its own format: a plan's logits differ from both uniform caches and from
    the reversed plan (test_kv_compress_eval.py holds them to a layer-by-layer forward exactly)."""
    from conftest import engine_next_token_logits
    prompt = make_prompts()[0]
    logits = {}
    for name, value in (("auto", "auto"), ("int4", "int4"), ("plan", ["int4", "auto"]),
                        ("plan-backwards", ["auto", "int4"])):
        llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                  max_model_len=128, kv_cache_dtype=value, attention_backend="torch")
        logits[name] = engine_next_token_logits(llm, prompt)
    for name in ("plan", "plan-backwards"):
        assert not torch.equal(logits[name], logits["auto"])
        assert not torch.equal(logits[name], logits["int4"])
    assert not torch.equal(logits["plan"], logits["plan-backwards"])


def test_smollm2_mild_plan_keeps_perplexity(smollm2_folder):
    """INT8 everywhere but the first 2 layers: greedy generation runs and the perplexity on 2
    held-out windows of 128 tokens stays within 1% of the model-dtype cache (INT8's step is
    max|x| / 254 per row, which moves it far less; 1% leaves room for other CPUs' bf16 sums)."""
    from workbench.experiments.kv_compression import perplexity
    from workbench.quant.calibration import heldout_windows
    from workbench.experiments.quality import nll, window_logprobs
    plan = "auto:0-1,int8:2-29"
    llm = LLM(model="smollm2-135m", device="cpu", verbose=False, max_model_len=256,
              max_num_seqs=2, kv_cache_dtype=plan)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    engine = llm.engine
    windows = heldout_windows(engine.tokenizer, 2, 128)
    base = perplexity(engine.model, windows)        # the same model, a model-dtype cache
    planned = math.exp(torch.cat([nll(window_logprobs(llm, w), w) for w in windows]).mean())
    print(f"perplexity: model dtype {base:.4f}, plan {planned:.4f}")
    assert math.isfinite(base) and abs(planned / base - 1) < 0.01


def test_the_compiled_paths_attention_operator_reads_each_layers_format():
    """torch.ops.workbench.attention (what a compiled forward calls) writes and reads every layer
    in its own format: each layer's output equals attention over its K/V rounded through that
    format, and each format is planned once per step."""
    from workbench.attention.torch_backend import TorchAttention
    from workbench.worker.model_runner import pack
    from workbench.kv.paged_cache import PagedKVCache
    from workbench.models.compile import attention_context
    args = LlamaArgs(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                     rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)
    cpu, plan = torch.device("cpu"), ["int4", "auto", "int8"]
    cache = PagedKVCache(args, 4, 4, torch.float32, cpu, kv_cache_dtype=plan)
    _, _, meta = pack([(list(range(6)), 0)], [[2, 0]], 4, cpu, cache.kv_cache_dtype)
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    backend = TorchAttention()
    with attention_context(cache.kv_caches, meta, backend, 0.25):
        outs = [torch.ops.workbench.attention(q, k, v, i) for i in range(3)]
    assert sorted(meta.layer_views) == ["auto", "int4", "int8"]
    for i, fmt in enumerate(plan):
        stored = cache.kv_caches[i][0].index_select(0, meta.slot_mapping)
        if fmt == "auto":
            rounded_k, rounded_v = k, v
            assert torch.equal(stored, k)
        else:
            assert torch.equal(stored, quantize_rows(k, fmt))
            rounded_k = dequantize_rows(quantize_rows(k, fmt), fmt, torch.float32)
            rounded_v = dequantize_rows(quantize_rows(v, fmt), fmt, torch.float32)
        plain = PagedKVCache(args, 4, 4, torch.float32, cpu)
        _, _, plain_meta = pack([(list(range(6)), 0)], [[2, 0]], 4, cpu)
        expected = backend.forward(q, rounded_k, rounded_v, *plain.kv_caches[i], plain_meta, 0.25)
        assert torch.equal(outs[i], expected)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
