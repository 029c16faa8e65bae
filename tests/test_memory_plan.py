"""memory_plan against published numbers: parameter counts, checkpoint sizes, KV bytes per token,
tensor / expert parallel splits, what fits on one GPU, and the engine's own SmolLM2 figures.

Pure arithmetic on JSON configs, except the SmolLM2 test, which reads the embedded model's config
and builds the engine's model on the meta device (no weights are loaded)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from workbench import memory_plan
from workbench.plan import architecture, known_models
from workbench.plan.architecture import CONFIGS
from workbench.plan.calculator import stage_layers

GB = 10**9


def near(value: float, published: float, tolerance: float) -> bool:
    return abs(value / published - 1) <= tolerance


def test_every_config_names_its_source_and_loads():
    names = {json.loads(p.read_text())["name"] for p in CONFIGS.glob("*.json")}
    assert names == set(known_models()) and len(names) == 11
    for name in names:
        owner, _, repo = architecture(name).source.partition("/")
        assert owner and repo, name


# Hugging Face's model pages (safetensors metadata) give these exact parameter counts.
@pytest.mark.parametrize("model, published", [
    ("Llama-2-7B", 6_738_415_616), ("Llama-3-8B", 8_030_261_248),
    ("Mistral-7B", 7_241_732_096), ("Mixtral-8x7B", 46_702_792_704)])
def test_parameter_counts_equal_the_checkpoints(model, published):
    assert memory_plan(model).params_total == published


def test_llama_2_70b_fp16_weights_are_about_140_gb():
    # "Llama 2 70B needs about 140 GB in fp16" (2 bytes x 70 B parameters; HF lists 69 B).
    plan = memory_plan("Llama-2-70B", dtype="fp16")
    assert near(plan.weight_bytes_total, 140 * GB, 0.03)
    assert plan.weight_bytes_total == 2 * plan.params_total


def test_llama_2_70b_awq_4bit_weights():
    # 4-bit AWQ checkpoints of Llama-2-70B are quoted at about 35-42 GB. Every input width here is a multiple of 128, so each projection weight costs 4 bits plus 32 bits of
    # fp16 scale and zero per 128 weights: 4.25 bits = 17/32 bytes. The embedding, the LM head and
    # the norms stay in fp16: 2 x 32000 x 8192 x 2 bytes = 1.05 GB of the total.
    plan = memory_plan("Llama-2-70B", dtype="fp16", weight_format="awq4")
    h, inter, layers, vocab = 8192, 28672, 80, 32000
    projections = layers * (h * (h + 1024 + 1024 + h) + 3 * h * inter)
    rest = plan.params_total - projections
    assert rest == 2 * vocab * h + (2 * layers + 1) * h
    assert plan.weight_bytes_total == projections * 17 // 32 + rest * 2
    assert 37.0 * GB < plan.weight_bytes_total < 37.8 * GB
    assert 35 * GB <= plan.weight_bytes_total <= 42 * GB


def test_opt_13b_kv_cache_is_800_kb_per_token():
    # vLLM paper (Kwon et al., 2023, section 3): "the KV cache of a single token demands 800 KB
    # of space, calculated as 2 (key and value vectors) x 5120 (hidden state size) x 40 (number of
    # layers) x 2 (bytes per FP16)".
    plan = memory_plan("OPT-13B", dtype="fp16", kv_cache_dtype="fp16")
    assert plan.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819_200
    assert near(plan.params_total, 13e9, 0.02)        # facebook/opt-13b: 13 B parameters


def test_llama_3_70b_gqa_keeps_one_eighth_of_the_kv_cache():
    # meta-llama/Meta-Llama-3-70B: 80 layers, 8 KV heads of 128 for 64 query heads.
    arch = architecture("Llama-3-70B")
    gqa = memory_plan(arch)
    mha = memory_plan(dataclasses.replace(arch, num_key_value_heads=arch.num_attention_heads))
    assert gqa.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert mha.kv_bytes_per_token == 8 * gqa.kv_bytes_per_token


def test_deepseek_v3_mla_cache_and_parameters():
    # DeepSeek-V3 technical report: 671 B total parameters, 37 B activated per token; MLA caches
    # one latent of kv_lora_rank 512 plus the 64-dimensional decoupled RoPE key per layer.
    plan = memory_plan("DeepSeek-V3")
    assert plan.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert near(plan.params_total, 671e9, 0.03)
    assert near(plan.params_active, 37e9, 0.03)


def test_mixtral_total_and_active_parameters():
    # Mistral AI, "Mixtral of experts": 46.7 B parameters in all, 12.9 B used per token.
    plan = memory_plan("Mixtral-8x7B")
    assert near(plan.params_total, 46.7e9, 0.03)
    assert near(plan.params_active, 12.9e9, 0.03)


def test_llama_3_1_405b_parameters():
    # Meta, "The Llama 3 Herd of Models": 405 B parameters.
    assert near(memory_plan("Llama-3.1-405B").params_total, 405e9, 0.02)


def test_tensor_parallel_splits_all_but_the_norms():
    one, eight = memory_plan("Llama-3-70B"), memory_plan("Llama-3-70B", tp=8)
    norms = (2 * 80 + 1) * 8192 * 2                   # two per layer and the final one, bf16
    assert eight.weight_bytes_per_gpu == (one.weight_bytes_total - norms) // 8 + norms
    assert eight.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token // 8
    assert eight.num_gpus == 8


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # 8 KV heads over 16 or 32 ranks: every rank keeps one whole head.
    one_head = 80 * 2 * 128 * 2
    for tp in (8, 16, 32):
        assert memory_plan("Llama-3-70B", tp=tp).kv_bytes_per_token_per_gpu == one_head


def test_mla_latent_is_whole_on_every_tensor_parallel_rank():
    plan = memory_plan("DeepSeek-V3", tp=8)
    assert plan.kv_bytes_per_token_per_gpu == plan.kv_bytes_per_token


def test_expert_parallel_splits_only_the_routed_experts():
    one, ep8 = memory_plan("Mixtral-8x7B"), memory_plan("Mixtral-8x7B", ep=8)
    routed = 32 * 8 * 3 * 4096 * 14336 * 2
    assert one.weight_bytes_per_gpu - ep8.weight_bytes_per_gpu == routed * 7 // 8
    # DeepSeek-V3's shared expert and dense layers stay on every expert-parallel group.
    one, ep32 = memory_plan("DeepSeek-V3"), memory_plan("DeepSeek-V3", ep=32)
    routed = 58 * 256 * 3 * 7168 * 2048 * 2
    assert one.weight_bytes_per_gpu - ep32.weight_bytes_per_gpu == routed * 31 // 32
    assert ep32.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token_per_gpu


def test_pipeline_stages_split_the_layers():
    # vLLM's get_pp_indices: the remainder goes to the stages before the last one.
    assert stage_layers(126, 4) == [(0, 31), (31, 63), (63, 95), (95, 126)]
    plan = memory_plan("Llama-3.1-405B", pp=4)
    assert plan.kv_bytes_per_token_per_gpu == 32 * plan.kv_bytes_per_token // 126
    # A tied LM head needs its own copy on the last stage, which the parameter count ignores.
    one, two = memory_plan("SmolLM2-135M"), memory_plan("SmolLM2-135M", pp=2)
    assert two.params_total == one.params_total
    assert two.weight_bytes_total == one.weight_bytes_total


def test_llama_2_7b_sequences_on_an_80_gb_gpu():
    plan = memory_plan("Llama-2-7B", gpu_memory_gb=80, gpu_memory_utilization=0.9)
    weights = 2 * 6_738_415_616
    tokens, h, inter, vocab = 8192, 4096, 11008, 32000
    activations = 2 * tokens * h * 2 + 3 * tokens * inter * 2 + 1 * vocab * 4
    kv_per_sequence = 2 * 32 * 32 * 128 * 2 * 4096
    budget = int(80 * GB * 0.9) - weights - activations
    assert (plan.weight_bytes_per_gpu, plan.activation_bytes_per_gpu) == (weights, activations)
    assert plan.kv_budget_bytes == budget
    assert plan.max_sequences == budget // kv_per_sequence == 26
    assert plan.reason is None and "26 sequence(s) of 4096 tokens fit" in plan.describe()


def test_llama_3_70b_does_not_fit_one_80_gb_gpu():
    plan = memory_plan("Llama-3-70B", gpu_memory_gb=80)
    assert plan.max_sequences == 0 and plan.kv_budget_bytes == 0
    assert plan.reason.startswith("the weights need 141.1 GB per GPU, more than the 72.0 GB usable")
    assert memory_plan("Llama-3-70B", gpu_memory_gb=80, tp=4).max_sequences > 0


def test_smollm2_matches_the_engine(smollm2_folder):
    import torch

    from workbench.models.llama import LlamaModel
    from workbench.models.loader import read_args
    args = read_args(smollm2_folder)
    with torch.device("meta"):
        engine_model = LlamaModel(args)
    plan = memory_plan("SmolLM2-135M")
    assert plan.kv_bytes_per_token == args.kv_bytes_per_token(torch.bfloat16) == 23_040
    assert plan.params_total == engine_model.num_parameters()


def test_bad_arguments_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"model='GPT-5' is not a known architecture: use one of "
                                         r".*Llama-2-70B.*SmolLM2-135M"):
        memory_plan("GPT-5")
    with pytest.raises(ValueError, match=r"tp=3 is invalid for Llama-2-70B \(64 attention heads, "
                                         r"8 KV heads\): allowed are 1, 2, 4, 8, 16, 32, 64$"):
        memory_plan("Llama-2-70B", tp=3)
    with pytest.raises(ValueError, match=r"batch=-1 is invalid: use an integer >= 1"):
        memory_plan("Llama-2-7B", batch=-1)
    with pytest.raises(ValueError, match=r"ep=2 is invalid for Llama-2-7B, a dense model"):
        memory_plan("Llama-2-7B", ep=2)
    with pytest.raises(ValueError, match=r"weight_format='nf4' is invalid: allowed are None, "
                                         r"'int8', 'fp8', 'int4', 'awq4'"):
        memory_plan("Llama-2-7B", weight_format="nf4")


def test_dtype_takes_the_engines_names():
    import torch

    from workbench.config import DTYPES
    from workbench.plan.formats import DTYPE_NAMES
    # The same names as LLM(dtype=...), each meaning the same torch dtype.
    short = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert set(DTYPE_NAMES) == set(DTYPES)
    assert all(short[DTYPE_NAMES[name]] == DTYPES[name] for name in DTYPES)
    for aliases, canonical in ((("float16", "fp16", "half"), "fp16"),
                               (("bfloat16", "bf16"), "bf16"),
                               (("float32", "fp32", "float"), "fp32")):
        plans = [memory_plan("Llama-2-7B", dtype=name) for name in aliases]
        assert {p.dtype for p in plans} == {canonical}                 # normalised once
        assert {p.kv_cache_dtype for p in plans} == {canonical}        # the KV cache follows
        assert len({(p.weight_bytes_total, p.kv_bytes_per_token, p.activation_bytes_per_gpu)
                    for p in plans}) == 1
    assert memory_plan("Llama-2-7B", dtype="float16").kv_bytes_per_token == 2 * 32 * 4096 * 2
    assert memory_plan("Llama-2-7B", dtype="float32").kv_bytes_per_token == 2 * 32 * 4096 * 4


def test_kv_cache_dtype_auto_follows_dtype_and_explicit_formats_still_work():
    fp16 = memory_plan("Llama-2-7B", dtype="half")
    assert fp16.kv_cache_dtype == "fp16" and "KV cache (fp16)" in fp16.describe()
    assert memory_plan("Llama-2-7B").kv_cache_dtype == "bf16"          # the default dtype's
    assert memory_plan("Llama-2-7B", dtype="fp32", kv_cache_dtype="auto").kv_cache_dtype == "fp32"
    per_element = 2 * 32 * 4096                  # K and V x layers x hidden (MHA: 32 x 128)
    for kv, canonical, element in (("bf16", "bf16", 2), ("bfloat16", "bf16", 2), ("half", "fp16", 2),
                                   ("float", "fp32", 4), ("fp8", "fp8", 1), ("int8", "int8", 1)):
        plan = memory_plan("Llama-2-7B", dtype="float16", kv_cache_dtype=kv)
        assert (plan.kv_cache_dtype, plan.kv_bytes_per_token) == (canonical, per_element * element)
        assert plan.dtype == "fp16"


def test_bad_dtypes_name_the_field_the_value_and_the_allowed_names():
    with pytest.raises(ValueError, match=r"^dtype='fp64' is invalid: allowed are 'float32', 'fp32', "
                                         r"'float', 'bfloat16', 'bf16', 'float16', 'fp16', 'half'$"):
        memory_plan("Llama-2-7B", dtype="fp64")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='int4' is invalid: allowed are 'auto' "
                                         r"\(the dtype, here 'fp16'\), 'float32', .*'half', 'fp8', "
                                         r"'int8'$"):
        memory_plan("Llama-2-7B", dtype="float16", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype=\['auto'\] is invalid"):
        memory_plan("Llama-2-7B", kv_cache_dtype=["auto"])
