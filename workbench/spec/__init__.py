"""Speculative decoding: a drafter guesses k tokens, the target verifies them in one forward pass.

    proposer.py       Draft; NgramProposer (prompt lookup)
    model_drafter.py  ModelDrafter: quantized_self, layer_skip, draft_model
    __init__.py       build_drafter: the drafter a SpeculativeConfig (config/speculative.py) names
Verification is in sample/rejection.py; compress/draft.py distils a small draft from the target.

The engine (engine/llm_engine.py) drafts for the sequences the scheduler gave lookahead slots, feeds
1 + k tokens per such sequence through the target, verifies, keeps the accepted positions and
gives back the blocks of the rejected ones (kv/block_manager.py: trim).
"""
from __future__ import annotations

import copy

from workbench.config import EnginePlan, QuantConfig
from workbench.config.quant import CALIBRATED
from workbench.models.fused_decode import FusedDecodeForward, fused_decode_unsupported
from workbench.models.loader import load_model, read_args, resolve_checkpoint
from workbench.quant.apply import quantize_model
from workbench.spec.model_drafter import ModelDrafter
from workbench.spec.proposer import Draft, NgramProposer
from workbench.worker.builder import apply_kernels, build_kv_cache, calibration

__all__ = ["Draft", "NgramProposer", "ModelDrafter", "build_drafter"]


def build_drafter(plan: EnginePlan, target, tokenizer, generator):
    """The drafter the plan's speculative_config describes, built next to the target (an
    in-process executor: its built model, KV cache and attention backend), with the same builder
    and the same kernels as the target."""
    cfg = plan.config.spec_config
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    config, k = plan.config, plan.kernels
    common = dict(block_size=config.block_size, backend=target.backend, device=k.device,
                  kv_cache_dtype=config.kv_cache_dtype, generator=generator)
    num_target_layers = target.built.args.num_hidden_layers
    if cfg.method == "layer_skip":
        n = cfg.draft_num_layers or max(1, num_target_layers // 3)
        if n >= num_target_layers:
            raise ValueError(f"speculative_config['draft_num_layers']={n} is invalid: the target "
                             f"has {num_target_layers} layers; the draft must use fewer")
        return ModelDrafter(target.model, target.cache.kv_caches, None, num_layers=n, **common)
    if cfg.method == "quantized_self":
        if target.built.quantization is not None:
            raise ValueError("speculative_config['method']='quantized_self' is invalid for a "
                             f"target that is already quantized ({target.built.quantization!r}): "
                             "the draft is quantized from the target's unquantized weights")
        qcfg = QuantConfig.from_args(cfg.draft_quantization, cfg.draft_quantization_config)
        if qcfg.method in ("int8", "int4"):
            # Round-to-nearest only reads the weights it replaces, so the copy shares every tensor
            # with the target (embedding, norms, and the projections until each is swapped for
            # its quantized layer): no second full-precision model, even for a moment (the
            # peak RSS of building this draft: `/usr/bin/time -v python -m workbench.bench spec
            # --drafters quantized_self`).
            model = copy.deepcopy(target.model,
                                  memo={id(t): t for t in shared_tensors(target.model)})
        else:   # calibrated methods rescale weights and norms in place: the draft needs its own
            model = copy.deepcopy(target.model)
        quantize_model(model, qcfg, calibration(tokenizer, "speculative_config['draft_"
                                                "quantization']", qcfg, CALIBRATED))
        args = target.built.args
    else:
        folder = resolve_checkpoint(cfg.model)
        args = read_args(folder)
        if args.vocab_size != target.built.args.vocab_size:
            raise ValueError(f"speculative_config['model']={cfg.model!r} is invalid: its "
                             f"vocabulary has {args.vocab_size} tokens, the target's "
                             f"{target.built.args.vocab_size}; a draft must share the tokenizer")
        if args.max_position_embeddings < plan.max_model_len:
            raise ValueError(f"speculative_config['model']={cfg.model!r} is invalid: it handles "
                             f"{args.max_position_embeddings} positions, fewer than "
                             f"max_model_len={plan.max_model_len}")
        if args.sliding_window is not None and args.sliding_window < plan.max_model_len:
            raise ValueError(f"speculative_config['model']={cfg.model!r} is invalid: it attends "
                             f"over a sliding window of {args.sliding_window} tokens, which the "
                             f"engine does not apply, fewer than max_model_len={plan.max_model_len}")
        model = load_model(folder, k.dtype, k.device, plan.max_model_len)
    apply_kernels(model, plan)    # the target's kernels: its quantized layers too
    cache = build_kv_cache(args, plan)
    drafter = ModelDrafter(model, cache.kv_caches, cache, **common)
    if k.fused_decode and fused_decode_unsupported(model) is None:
        drafter.forward = FusedDecodeForward(model, model)   # one-token rounds in one C++ call
    return drafter


def shared_tensors(model) -> list:
    """Every parameter and buffer of `model`, for a deep copy that shares them instead."""
    return [*model.parameters(), *model.buffers()]
