"""The model builder: one path from a checkpoint to a model ready to run, for the engine's own
process, a speculative drafter and a parallel worker alike.

    load        a quantized folder, a pruned folder, or any other checkpoint (models/loader.py)
    prune       masks or structure removed (compress/), calibrated on text where the method is
    quantize    projections swapped for quantized layers (quant/); SparseGPT with GPTQ in one pass
    experts     the MLPs cut into a mixture of experts (moe_config)
    kernels     the CPU loops, bf16 weights under fp32 activations, batch-invariant layers
    offload     the last layers moved to a slow tier (offload/)
    KV cache    the paged pool for the layers that remain (kv/paged_cache.py)

Every step reads the plan (config/resolve.py), never the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from workbench.compress import semi_structured
from workbench.compress.checkpoint import is_pruned_checkpoint, load_pruned
from workbench.compress.pruning import prune_model
from workbench.config import EnginePlan
from workbench.config.pruning import CALIBRATED as CALIBRATED_PRUNING
from workbench.config.quant import CALIBRATED as CALIBRATED_QUANT
from workbench.kv.paged_cache import PagedKVCache
from workbench.memory import release_memory
from workbench.models.batch_invariant import make_batch_invariant
from workbench.models.cpu_gemv import store_weights_bf16, use_cpu_gemv
from workbench.models.fused_decode import fused_decode_unsupported
from workbench.models.llama import LlamaArgs, LlamaModel
from workbench.models.loader import load_model
from workbench.offload import WeightOffload, offload_model
from workbench.parallel.moe import moefy
from workbench.quant.apply import quantize_lm_head, quantize_model
from workbench.quant.calibration import calibration_windows
from workbench.quant.checkpoint import is_quantized_checkpoint, load_quantized


@dataclass
class BuiltModel:
    """A model ready to run, and what building it found out."""
    model: LlamaModel
    args: LlamaArgs                       # the model's shape after pruning (fewer layers, ...)
    quantization: str | None              # the method its weights carry
    pruned_manifest: dict | None          # pruning.json of a pruned checkpoint it came from
    weights_stored_bf16: int              # fp32 layers whose weights are kept in bf16
    offload: WeightOffload | None
    fused_decode_unsupported: str | None  # why the fused decode step cannot take this model


def build_model(plan: EnginePlan, checkpoint: Path, tokenizer) -> BuiltModel:
    """The target model of a single-process engine, every step of the plan applied."""
    config, k = plan.config, plan.kernels
    quantization = pruned_manifest = None
    if is_quantized_checkpoint(checkpoint):
        for name, value in (("quantization", config.quantization), ("pruning", config.pruning)):
            if value is not None:
                raise ValueError(f"{name}={value!r} is invalid for {config.model}: it is "
                                 "already quantized; pass None")
        model, manifest = load_quantized(checkpoint, k.dtype, k.device, plan.max_model_len)
        quantization = manifest["method"]
    else:
        if is_pruned_checkpoint(checkpoint):
            if config.prune_config is not None:
                raise ValueError(f"pruning={config.pruning!r} is invalid for {config.model}: "
                                 "it is already pruned; pass None")
            model, pruned_manifest = load_pruned(checkpoint, k.dtype, k.device,
                                                 plan.max_model_len)
        else:
            model = load_model(checkpoint, k.dtype, k.device, plan.max_model_len)
        compress(model, plan, tokenizer)
        if config.quant_config is not None:
            quantization = config.quant_config.method
    if config.moe_config is not None:
        moefy(model, **config.moe_config)
    stored_bf16 = apply_kernels(model, plan)
    why_not_fused = fused_decode_unsupported(model) if plan.kernels.fused_decode else None
    offload = None
    if config.offload_config.enabled:          # last: the layers' final parameters move
        offload = offload_model(model, k.offload_tier, k.device, config.cpu_offload_gb,
                                config.offload_dir, config.offload_keep_page_cache)
        release_memory()            # the offloaded layers' resident copies
    args = replace(model.args)
    return BuiltModel(model, args, quantization, pruned_manifest, stored_bf16, offload,
                      why_not_fused)


def compress(model: LlamaModel, plan: EnginePlan, tokenizer) -> None:
    """Prune, then quantize, as the plan asks. SparseGPT with GPTQ runs in one column loop (the
    SparseGPT paper's joint mode), so pruned weights stay exact zeros; GPTQ after pruning would
    fill them in."""
    p, q = plan.config.prune_config, plan.config.quant_config
    joint = p is not None and q is not None and p.method == "sparsegpt" and q.method == "gptq"
    if p is not None:
        if p.semi_structured:            # refused before the calibration, not after it
            why_not = semi_structured.unsupported(plan.kernels.device, plan.kernels.dtype)
            if why_not is None and q is not None:
                why_not = "quantization replaces the projections it would convert"
            if why_not:
                raise ValueError(f"pruning_config['semi_structured']=True is invalid here: "
                                 f"{why_not}")
        prune_model(model, p, calibration(tokenizer, "pruning", p, CALIBRATED_PRUNING),
                    q.group_size if joint else None)
        if joint:
            release_memory()        # the full-precision weights the INT4 layers replaced
        if p.semi_structured:
            semi_structured.to_semi_structured(model)
        model.args.num_hidden_layers = len(model.layers)   # layers removed: a smaller KV cache
    if q is not None:
        if not joint:
            quantize_model(model, q, calibration(tokenizer, "quantization", q, CALIBRATED_QUANT))
            release_memory()        # the full-precision weights the quantized layers replaced
        elif q.quantize_lm_head:
            quantize_lm_head(model)


def calibration(tokenizer, knob: str, cfg, calibrated: tuple) -> list[list[int]] | None:
    """The calibration windows `cfg` asks for when its method is one of `calibrated`, else None
    (`knob`: the engine argument that chose the method, for the error)."""
    if cfg.method not in calibrated:
        return None
    if tokenizer is None:
        raise ValueError(f"{knob}={cfg.method!r} calibrates on text and needs the model's "
                         "tokenizer, which this checkpoint lacks")
    return calibration_windows(tokenizer, cfg.num_calibration_windows, cfg.calibration_window_len)


def apply_kernels(model: LlamaModel, plan: EnginePlan) -> int:
    """The plan's kernels on `model`: the CPU loops (and bf16 weights under fp32 activations) and
    batch-invariant layers. Layers already switched (shared with a target) are skipped. Returns
    the number of layers whose weights are now stored in bf16."""
    k = plan.kernels
    stored_bf16 = 0
    if k.cpu_gemv:
        use_cpu_gemv(model)
        if k.weight_dtype == torch.bfloat16 and k.dtype == torch.float32:
            stored_bf16 = store_weights_bf16(model)
    if plan.config.batch_invariant:
        make_batch_invariant(model)
    return stored_bf16


def build_kv_cache(args: LlamaArgs, plan: EnginePlan, device: torch.device | None = None
                   ) -> PagedKVCache:
    """The paged KV pool the plan sized, for a model of shape `args` (a worker's shard: its own
    layers and KV heads, on its own device)."""
    k, config = plan.kernels, plan.config
    return PagedKVCache(args, plan.num_kv_blocks, config.block_size, k.dtype, device or k.device,
                        plan.num_cpu_blocks, kv_cache_dtype=config.kv_cache_dtype)
