"""The rules that cross configuration groups, in one place, and the plan they produce.

    plan_kernels(config)              device, dtypes, attention, the CPU loops, the fused decode
                                      step, the offload tier: from the config and this machine
    resolve(config, kernels, facts)   + the context length and the KV pool, from the model's facts
    after_build(plan, why_not)        the fused step switched off for a model it cannot take

Each decision that is not simply what the user asked for carries its reason, which
`LLM.describe()` prints. Nothing here changes the EngineConfig it reads.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import torch

from workbench.config.kv_plan import is_mixed, layer_kv_dtypes, plan_formats
from workbench.config.plan import EnginePlan, KernelPlan, ModelFacts
from workbench.config.platform import onednn_bf16_prepack_reason, resolve_device, resolve_dtype
from workbench.kernels.cpu import available as cpu_kernels_available

# The default KV budget holds max_num_seqs full contexts, so the default context is capped:
# SmolLM2's full 8192 tokens x 8 sequences would take 1.5 GB in bf16.
DEFAULT_MAX_MODEL_LEN = 1024
FUSED_QUANTIZATIONS = (None, "int8", "int4", "gptq", "awq", "mixed")


def plan_kernels(config) -> KernelPlan:
    """What runs where, decided from the config and this machine; a ValueError names any
    combination that cannot run."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    _check_single_process(config)
    _check_combinations(config, device, dtype)
    reasons: dict[str, str] = {}
    attention = _attention_backend(config, device, reasons)
    cpu_gemv = _cpu_gemv(config, device, dtype, reasons)
    weight_dtype = dtype
    if config.dtype == "auto" and cpu_gemv and dtype == torch.float32:
        # fp32 activations over the GEMV layers' weights rounded to bf16: decode reads half the
        # bytes (`python -m workbench.bench speed`: "engine default" and "engine fp32 weights")
        weight_dtype = torch.bfloat16
        reasons["weight_dtype"] = "no native bf16 on this CPU: fp32 activations over bf16 weights"
    fused = _fused_decode(config, cpu_gemv, attention, reasons)
    _check_cuda_graphs(config, device)
    offload_tier = config.weight_offload
    if offload_tier == "auto":
        offload_tier = "cpu" if device.type == "cuda" else "disk"
    if config.offload_config.enabled:
        _check_weight_offload(config)
        if fused:
            fused = False
            reasons["fused_decode"] = ("weight offload brings layers in one at a time, and the "
                                       "fused step reads all of them in one call")
    return KernelPlan(device, dtype, weight_dtype, attention, cpu_gemv, fused, offload_tier,
                      reasons)


def resolve(config, kernels: KernelPlan, facts: ModelFacts) -> EnginePlan:
    """The whole plan: `kernels` and the sizes that depend on the model."""
    reasons = {}
    model_len = facts.max_position_embeddings
    window = facts.sliding_window
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = min(model_len, DEFAULT_MAX_MODEL_LEN)
        if max_model_len < model_len:
            reasons["max_model_len"] = (f"the model's context is {model_len}; the default caps it "
                                        f"at {DEFAULT_MAX_MODEL_LEN}")
        if window is not None and window < max_model_len:
            max_model_len = window
            reasons["max_model_len"] = (f"the model attends over a sliding window of {window} "
                                        "tokens, which the engine does not apply; within it full "
                                        "attention sees the same keys")
    elif max_model_len > model_len:
        raise ValueError(f"max_model_len={max_model_len} is invalid: the model's context is "
                         f"{model_len} tokens")
    elif window is not None and max_model_len > window:
        raise ValueError(f"max_model_len={max_model_len} is invalid for this model: it attends over "
                         f"a sliding window of {window} tokens (sliding_window in its config.json), "
                         f"which the engine does not apply, so contexts must stay within "
                         f"{window} tokens, where full attention is the same")
    batched = config.max_num_batched_tokens
    if not config.enable_chunked_prefill and batched < max_model_len:
        batched = max_model_len        # without chunked prefill a whole prompt must fit a step
        reasons["max_num_batched_tokens"] = "raised to max_model_len: prefill is not chunked"
    block_size = config.block_size
    block_bytes = facts.kv_bytes_per_token * block_size
    if config.kv_cache_memory is not None:
        num_kv_blocks = config.kv_cache_memory // block_bytes
        if num_kv_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} is invalid: one block of "
                             f"{block_size} tokens needs {block_bytes} bytes")
    elif config.num_kv_blocks is not None:
        num_kv_blocks = config.num_kv_blocks
    else:
        num_kv_blocks = config.max_num_seqs * -(-max_model_len // block_size)
        reasons["num_kv_blocks"] = f"max_num_seqs={config.max_num_seqs} full contexts"
    if config.swap_space is None:
        num_cpu_blocks = num_kv_blocks if config.preemption_mode == "swap" else 0
    else:
        num_cpu_blocks = config.swap_space // block_bytes
    for name in ("kv_cpu_tier_bytes", "kv_disk_tier_bytes"):
        if 0 < getattr(config, name) < block_bytes:
            raise ValueError(f"{name}={getattr(config, name)} is invalid: one block of "
                             f"{block_size} tokens needs {block_bytes} bytes; give at least that, "
                             "or 0 for no tier")
    # With P pipeline stages, P schedulers (one micro-batch each) share max_num_seqs.
    micro = -(-config.max_num_seqs // config.pipeline_parallel_size)
    return EnginePlan(config, kernels, max_model_len, batched, num_kv_blocks, num_cpu_blocks,
                      config.kv_cpu_tier_bytes // block_bytes, micro, reasons)


def after_build(plan: EnginePlan, why_not_fused: str | None) -> EnginePlan:
    """The plan once the model is built: an automatic fused decode step goes off for a model it
    cannot take (models/fused_decode.py says why); one the user insisted on is an error."""
    if not plan.kernels.fused_decode or why_not_fused is None:
        return plan
    if plan.config.fused_decode is True:
        raise ValueError(f"fused_decode=True is invalid for this model: {why_not_fused}")
    kernels = dataclasses.replace(plan.kernels, fused_decode=False,
                                  reasons={**plan.kernels.reasons, "fused_decode": why_not_fused})
    return dataclasses.replace(plan, kernels=kernels)


# ---------------------------------------------------------------------------------- the rules
def _single_process_features(config):
    """(engine argument, its value, why the parallel workers cannot have it), for each set."""
    out = []
    if config.speculative_config is not None:
        out.append(("speculative_config", config.speculative_config,
                    "the parallel engine runs without a drafter"))
    if config.quantization is not None:
        out.append(("quantization", config.quantization,
                    "the parallel workers load unquantized shards"))
    if config.pruning is not None:
        out.append(("pruning", config.pruning, "the parallel workers load unpruned shards"))
    if config.compile:
        out.append(("compile", True, "compilation is for a single-process engine"))
    if config.cuda_graphs:
        out.append(("cuda_graphs", True, "graphs are for a single-process engine"))
    if config.cpu_gemv is True:
        out.append(("cpu_gemv", True, "the parallel workers keep torch's kernels"))
    if config.offload_config.enabled:
        out.append(("cpu_offload_gb", config.cpu_offload_gb,
                    "the parallel workers load their own shards"))
    if config.cache_config.kv_tiers:
        out.append(("kv_cpu_tier_bytes", config.kv_cpu_tier_bytes,
                    "KV tiers are for a single-process engine"))
    if layer_kv_dtypes(config.kv_cache_dtype) is not None:
        out.append(("kv_cache_dtype", config.kv_cache_dtype,
                    "the parallel workers take one KV format for every layer"))
    return out


def _check_single_process(config) -> None:
    """The one rule for everything a parallel engine's workers cannot do."""
    p = config.parallel_config
    if p.world_size == 1:
        return
    for name, value, why in _single_process_features(config):
        raise ValueError(f"{name}={value!r} is invalid with parallel workers "
                         f"(tensor_parallel_size={p.tensor_parallel_size}, pipeline_parallel_size="
                         f"{p.pipeline_parallel_size}, expert_parallel_size="
                         f"{p.expert_parallel_size}): {why}; leave it at its default or use one "
                         "process")


def _check_combinations(config, device: torch.device, dtype: torch.dtype) -> None:
    if config.speculative_config is not None and layer_kv_dtypes(config.kv_cache_dtype) is not None:
        raise ValueError(f"speculative_config={config.speculative_config!r} is invalid with a "
                         f"per-layer kv_cache_dtype plan ({config.kv_cache_dtype!r}): drafters "
                         "take one KV format; use a single format or no speculation")
    if config.tpot_slo is not None and config.batch_invariant:
        raise ValueError("tpot_slo is invalid with batch_invariant=True: its prefill chunks would "
                         "depend on timing, and batch-invariant chunks must not")
    if config.freeze_weights and device.type == "cpu" and dtype == torch.bfloat16:
        why_not = onednn_bf16_prepack_reason()
        if why_not:
            raise ValueError(f"freeze_weights=True is invalid here for bf16: {why_not}; use "
                             "dtype='float32' or freeze_weights=False")
    spec = config.spec_config
    if config.cache_config.kv_tiers and spec is not None and spec.method != "ngram":
        raise config.cache_config.tiers_invalid(
            f"speculative_config['method']={spec.method!r} keeps a draft cache that loaded blocks "
            "would not fill; use 'ngram' or no speculation")


def _attention_backend(config, device: torch.device, reasons: dict) -> str:
    """"auto": the C++ paged decode kernel on CPU where it builds, the Triton kernels on CUDA;
    INT4 rows and per-layer plans go to the torch backend (the Triton kernels read neither)."""
    backend = config.attention_backend
    why_not_triton = None
    if "int4" in plan_formats(config.kv_cache_dtype):
        why_not_triton = "the Triton kernels do not read INT4 rows"
    elif is_mixed(config.kv_cache_dtype):
        why_not_triton = "the Triton kernels read one KV format for all layers"
    if backend == "triton" and why_not_triton:
        raise ValueError(f"attention_backend='triton' is invalid with kv_cache_dtype="
                         f"{config.kv_cache_dtype!r}: {why_not_triton}; use 'torch' or 'auto'")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        if why_not_triton:
            reasons["attention_backend"] = why_not_triton
            return "torch"
        if config.batch_invariant:
            reasons["attention_backend"] = ("batch_invariant=True: the Triton decode kernel "
                                            "splits the context by batch size")
            return "torch"
        if importlib.util.find_spec("triton") is None:
            reasons["attention_backend"] = "Triton is not installed"
            return "torch"
        return "triton"
    if config.world_size > 1:
        return "torch"
    ok, why_not = cpu_kernels_available()
    if not ok:
        reasons["attention_backend"] = f"no C++ decode kernel: {why_not}"
    return "cpu" if ok else "torch"


def _cpu_gemv(config, device: torch.device, dtype: torch.dtype, reasons: dict) -> bool:
    """None becomes whether the CPU loops can run; True must be able to."""
    why_not = None
    if device.type != "cpu":
        why_not = f"they are CPU kernels and device is {device.type}"
    elif dtype not in (torch.bfloat16, torch.float32):
        why_not = f"they take bf16 or fp32 activations and dtype is {dtype}"
    elif config.world_size > 1:
        why_not = "the parallel workers keep torch's kernels"
    elif config.freeze_weights and config.cpu_gemv is None:
        why_not = ("freeze_weights=True prepacks the matmuls for oneDNN, which the loops' "
                   "operators would hide from the compiler")
    if why_not is None and config.cpu_gemv is not False:
        ok, reason = cpu_kernels_available()
        why_not = None if ok else reason
    if config.cpu_gemv is True and why_not is not None:
        raise ValueError(f"cpu_gemv=True is invalid here: {why_not}; use None (auto) or False")
    reason = why_not or ("switched off" if config.cpu_gemv is False else "")
    if reason:
        reasons["cpu_gemv"] = reason
    return config.cpu_gemv is not False and why_not is None


def _fused_decode(config, cpu_gemv: bool, attention: str, reasons: dict) -> bool:
    why_not = None
    if not cpu_gemv:
        why_not = (f"the GEMV kernels it runs are off (cpu_gemv: "
                   f"{reasons.get('cpu_gemv', 'off')})")
    elif config.batch_invariant:
        why_not = ("batch_invariant=True: its norms sum in another order than the layer-by-layer "
                   "steps that carry a prefill, so a sequence's numbers would depend on what "
                   "shares its step")
    elif attention != "cpu":
        why_not = (f"it runs the C++ paged attention, and attention_backend={attention!r}; use "
                   "attention_backend='cpu'")
    elif config.quantization not in FUSED_QUANTIZATIONS or config.moe_config is not None:
        why_not = (f"it takes bf16, INT8 or INT4 weight-only layers without experts, and "
                   f"quantization={config.quantization!r}, moe_config={config.moe_config!r}; "
                   "use quantization None, 'int8', 'int4', 'gptq' or 'awq' and moe_config=None")
    elif config.kv_cache_dtype != "auto":
        why_not = (f"it reads a cache in the model's dtype, and kv_cache_dtype="
                   f"{config.kv_cache_dtype!r}; use 'auto'")
    if config.fused_decode is True and why_not:
        raise ValueError(f"fused_decode=True is invalid here: {why_not}")
    reason = why_not or ("switched off" if config.fused_decode is False else "")
    if reason:
        reasons["fused_decode"] = reason
    return config.fused_decode is not False and why_not is None


def _check_cuda_graphs(config, device: torch.device) -> None:
    if not config.cuda_graphs:
        return
    why_not = None
    if device.type != "cuda":
        why_not = (f"graphs record GPU kernel launches, and device is {device.type!r}; use "
                   "device='cuda'")
    elif config.attention_backend not in ("auto", "triton"):
        why_not = (f"the captured steps run the Triton kernels, and attention_backend="
                   f"{config.attention_backend!r}; use 'auto' or 'triton'")
    elif config.compile:
        why_not = "graphs capture the eager forward here, and compile=True; set compile=False"
    if why_not:
        raise ValueError(f"cuda_graphs=True is invalid here: {why_not}")


def _check_weight_offload(config) -> None:
    """Refuse the paths that read every layer's weights at once or cache their addresses."""
    why_not = None
    if config.compile:
        why_not = ("the compiled forward does not call the layers' hooks that bring their "
                   "weights in; set compile=False")
    elif config.cuda_graphs:
        why_not = ("a graph replays the addresses it captured, and offloaded layers read a "
                   "different buffer each step; set cuda_graphs=False")
    elif config.fused_decode is True:
        why_not = ("the fused step reads every layer's weights in one call, and only two "
                   "offloaded layers fit the resident buffers; set fused_decode=None or False")
    elif config.quantization is not None:
        why_not = (f"quantization={config.quantization!r} keeps packed codes and caches their "
                   "aten layout per layer, which the swap does not move; use None")
    elif config.prune_config is not None and config.prune_config.semi_structured:
        why_not = ("semi-structured weights are sparse tensor subclasses; set "
                   "pruning_config['semi_structured']=False")
    elif config.speculative_config is not None:
        why_not = ("a quantized_self drafter copies the model, whose offloaded layers hold "
                   "empty parameters, and a draft model would need an offload of its own; "
                   "use None")
    if why_not:
        raise ValueError(f"cpu_offload_gb={config.cpu_offload_gb!r} is invalid here: {why_not}")
