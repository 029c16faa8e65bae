"""Saving and loading pruned models, so calibration runs once.

A pruned checkpoint is a folder that `LLM(model=folder)` loads like any other:

    config.json           the source's, with num_hidden_layers set to the layers kept
    generation_config.json, tokenizer files      copied from the source checkpoint
    model.safetensors     the engine's own state dict (fused qkv_proj and gate_up_proj names),
                          masked weights holding their zeros, removed channels, heads and layers
                          absent
    pruning.json          {"format": "workbench-pruned", "version": 1, "method": ..., "config":
                           {PruneConfig's options}, "intermediate_sizes": [one per layer kept],
                           "num_attention_heads": [query heads, one per layer kept], and for a
                           distilled student "distillation": {loss, config, teacher}}

Each layer's MLP width and number of query heads come from the manifest, so channel and head
pruning's per-layer shapes survive (config.json keeps the unpruned num_attention_heads and
intermediate_size; a manifest without "num_attention_heads" means every layer has those);
transformers' LlamaConfig has one of each for all layers, so this is a format for this engine, as
the quantized one is. Quantizing composes on load: `LLM(model=folder, quantization="int4")`.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from workbench.compress.semi_structured import dense_weight
from workbench.layers.linear import QuantLinear
from workbench.models.llama import MLP, Attention, LlamaModel
from workbench.models.loader import read_args

MANIFEST = "pruning.json"


def is_pruned_checkpoint(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def save_pruned(model: LlamaModel, cfg, source: Path, target: Path) -> Path:
    """The pruned `model` (pruned by PruneConfig `cfg` from the checkpoint `source`) to `target`."""
    return _write(model, source, target, {
        "method": cfg.method, "config": {k: v for k, v in asdict(cfg).items()
                                  if k not in ("method", "semi_structured")}})


def save_student(model: LlamaModel, manifest: dict, source: Path, target: Path,
                 distillation: dict) -> Path:
    """A distilled student: its pruning manifest (method "none" when it was not pruned) with the
    distillation's record added."""
    return _write(model, source, target, {
        "method": manifest.get("method", "none"), "config": manifest.get("config", {}),
        "distillation": {k: v for k, v in distillation.items() if k != "history"}})


def _write(model: LlamaModel, source: Path, target: Path, manifest: dict) -> Path:
    from safetensors.torch import save_file
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("save_pruned needs an unquantized model: save the pruned model (no "
                         "quantization=), then quantize when loading it: "
                         "LLM(model=folder, quantization=...)")
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for f in Path(source).iterdir():
        if f.name == "generation_config.json" or f.name.startswith(
                ("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    config = json.loads((Path(source) / "config.json").read_text())
    config["num_hidden_layers"] = len(model.layers)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    state = {k: dense_weight(v.detach()).contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_word_embeddings:
        state.pop("lm_head.weight", None)          # tied: stored once, as the embedding
    save_file(state, str(target / "model.safetensors"))
    manifest = {"format": "workbench-pruned", "version": 1, **manifest,
                "intermediate_sizes": [layer.mlp.down_proj.in_features for layer in model.layers],
                "num_attention_heads": [layer.self_attn.num_heads for layer in model.layers]}
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return target


def load_pruned(folder: Path, dtype: torch.dtype, device: torch.device,
                max_positions: int | None = None) -> tuple[LlamaModel, dict]:
    from safetensors.torch import load_file

    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != "workbench-pruned" or manifest.get("version") != 1:
        raise ValueError(f"{folder / MANIFEST} is not a workbench pruned checkpoint (format "
                         f"{manifest.get('format')!r} version {manifest.get('version')!r})")
    args = read_args(folder)
    widths = manifest["intermediate_sizes"]
    if len(widths) != args.num_hidden_layers:
        raise ValueError(f"{folder}: {MANIFEST} lists {len(widths)} layers' widths, config.json "
                         f"has num_hidden_layers={args.num_hidden_layers}")
    heads = manifest.get("num_attention_heads", [args.num_attention_heads] * len(widths))
    if len(heads) != args.num_hidden_layers:
        raise ValueError(f"{folder}: {MANIFEST} lists {len(heads)} layers' query heads, "
                         f"config.json has num_hidden_layers={args.num_hidden_layers}")
    with torch.device("meta"):
        model = LlamaModel(args, max_positions)
        for layer, width, count in zip(model.layers, widths, heads):
            if width != args.intermediate_size:
                layer.mlp = MLP(args.__class__(**{**vars(args), "intermediate_size": width}))
            if count != args.num_attention_heads:
                layer.self_attn = Attention(args, num_heads=count)
    model.to_empty(device=device)
    model.to(dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    state = load_file(str(folder / "model.safetensors"), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and args.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"pruned checkpoint {folder} does not fit the model: missing "
                         f"{missing[:4]}, unexpected {unexpected[:4]}")
    model.rotary.rebuild(device)
    return model.eval(), manifest
