"""Speculative decoding: a drafter guesses k tokens, the target verifies them in one forward pass.

    config.py         SpeculativeConfig (vLLM's speculative_config shape), validated once
    proposer.py       Draft; NgramProposer (prompt lookup)
    model_drafter.py  ModelDrafter: quantized_self, layer_skip, draft_model
    rejection.py      verification: rejection sampling (lossless), argmax match for greedy
    distill.py        make a small draft model from the target (sequence-level + logit KL)

The engine (engine.py) drafts for the sequences the scheduler gave lookahead slots, feeds
1 + k tokens per such sequence through the target, verifies, keeps the accepted positions and
gives back the blocks of the rejected ones (kv/block_manager.py: trim).
"""
from __future__ import annotations

import copy

import torch

from .config import METHODS, SpeculativeConfig
from .model_drafter import ModelDrafter
from .proposer import Draft, NgramProposer

__all__ = ["METHODS", "SpeculativeConfig", "Draft", "NgramProposer", "ModelDrafter",
           "build_drafter"]


def build_drafter(cfg: SpeculativeConfig, engine):
    """The drafter `cfg` describes, built next to the engine's target model and KV cache."""
    from ..kv.paged_cache import PagedKVCache
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    config, target = engine.config, engine.model
    common = dict(block_size=config.block_size, backend=engine.backend, device=engine.device,
                  kv_cache_dtype=config.kv_cache_dtype, generator=engine.sampler.generator)
    num_target_layers = engine.model_args.num_hidden_layers
    if cfg.method == "layer_skip":
        n = cfg.draft_num_layers or max(1, num_target_layers // 3)
        if n >= num_target_layers:
            raise ValueError(f"speculative_config['draft_num_layers']={n} is invalid: the target "
                             f"has {num_target_layers} layers; the draft must use fewer")
        return ModelDrafter(target, engine.cache.kv_caches, None, num_layers=n, **common)
    if cfg.method == "quantized_self":
        if engine.quantization is not None:
            raise ValueError("speculative_config['method']='quantized_self' is invalid for a "
                             f"target that is already quantized ({engine.quantization!r}): the "
                             "draft is quantized from the target's unquantized weights")
        from ..quant.apply import QuantConfig
        qcfg = QuantConfig.from_args(cfg.draft_quantization, cfg.draft_quantization_config)
        if qcfg.method in ("int8", "int4"):
            # Round-to-nearest only reads the weights it replaces, so the copy shares every tensor
            # with the target (embedding, norms, and the projections until each is swapped for
            # its quantized layer): no second bf16 model, even for a moment. A full deep copy
            # would hold a second set of the target's weights next to it (the peak RSS of building
            # this draft: `/usr/bin/time -v python -m workbench.bench spec --drafters
            # quantized_self`).
            model = copy.deepcopy(target, memo={id(t): t for t in shared_tensors(target)})
        else:   # calibrated methods rescale weights and norms in place: the draft needs its own
            model = copy.deepcopy(target)
        calibration = None
        from ..quant.apply import CALIBRATED
        if qcfg.method in CALIBRATED:
            from ..quant.calibration import calibration_windows
            calibration = calibration_windows(engine.tokenizer, qcfg.num_calibration_windows,
                                              qcfg.calibration_window_len)
        from ..quant.apply import quantize_model
        quantize_model(model, qcfg, calibration)
        args = engine.model_args
    else:
        from ..models.loader import load_model, read_args, resolve_checkpoint
        folder = resolve_checkpoint(cfg.model)
        args = read_args(folder)
        if args.vocab_size != engine.model_args.vocab_size:
            raise ValueError(f"speculative_config['model']={cfg.model!r} is invalid: its "
                             f"vocabulary has {args.vocab_size} tokens, the target's "
                             f"{engine.model_args.vocab_size}; a draft must share the tokenizer")
        if args.max_position_embeddings < config.max_model_len:
            raise ValueError(f"speculative_config['model']={cfg.model!r} is invalid: it handles "
                             f"{args.max_position_embeddings} positions, fewer than "
                             f"max_model_len={config.max_model_len}")
        model = load_model(folder, engine.dtype, engine.device, config.max_model_len)
    _kernels_of_the_target(model, engine)
    cache = PagedKVCache(args, config.num_kv_blocks, config.block_size, engine.dtype,
                         engine.device, config.num_cpu_blocks, kv_cache_dtype=config.kv_cache_dtype)
    drafter = ModelDrafter(model, cache.kv_caches, cache, **common)
    if config.use_fused_decode:   # the draft's one-token rounds in one C++ call, as the target's
        from ..models.fused_decode import FusedDecodeForward, fused_decode_unsupported
        if fused_decode_unsupported(model) is None:
            drafter.forward = FusedDecodeForward(model, model)
    return drafter


def shared_tensors(model) -> list:
    """Every parameter and buffer of `model`, for a deep copy that shares them instead."""
    return [*model.parameters(), *model.buffers()]


def _kernels_of_the_target(model, engine) -> None:
    """The draft runs on the target's kernels: the CPU loops (its quantized layers too, which
    otherwise take torch's packed kernels, far slower with fp32 activations: `python -m
    kernels.cpu.bench --x fp32 --formats int8,int4` times both) and the
    batch-invariant layers. Both switches skip layers already switched (those shared with the
    target)."""
    config = engine.config
    if config.use_cpu_gemv:
        from ..models.cpu_gemv import store_weights_bf16, use_cpu_gemv
        use_cpu_gemv(model)
        if config.weight_dtype == torch.bfloat16 and engine.dtype == torch.float32:
            store_weights_bf16(model)
    if config.batch_invariant:
        from ..models.batch_invariant import make_batch_invariant
        make_batch_invariant(model)
