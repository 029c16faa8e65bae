"""Saving and loading quantized models, so calibration (GPTQ, AWQ, SmoothQuant) runs once.

A quantized checkpoint is a folder that `LLM(model=folder)` loads like any other:

    config.json, generation_config.json, tokenizer files   copied from the source checkpoint
    model.safetensors     the engine's own state dict: fused projections, quantized buffers
                          (qweight + scale, packed + scale + minimum, qweight_t + scale, and
                          SmoothQuant's static activation scale input_scale, an fp32 scalar,
                          where calibrated), norm weights with any smoothing already folded in
    quantization.json     {"format": "workbench-quant", "version": 1, "method": ..., "group_size":
                           ..., "dtype": ..., "layers": {module name: {"kind": "int8" | "int4" |
                           "w8a8", "in_features": K}}}

The names are the engine's (qkv_proj, gate_up_proj), not transformers': this is a format for this
engine, documented here, not an interchange format. INT4 codes are stored two per byte, low nibble
first (formats.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from workbench.layers.formats import Int4Weight, Int8Weight
from workbench.layers.linear import Int4Linear, Int8Linear, QuantLinear, W8A8Linear
from workbench.models.llama import LlamaModel
from workbench.models.loader import read_args

MANIFEST = "quantization.json"
KINDS = {Int8Linear: "int8", Int4Linear: "int4", W8A8Linear: "w8a8"}


def is_quantized_checkpoint(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def save_quantized(model: LlamaModel, method: str, group_size: int, source: Path,
                   target: Path) -> Path:
    from safetensors.torch import save_file
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for f in Path(source).iterdir():
        if f.name in ("config.json", "generation_config.json") or f.name.startswith(
                ("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    # By format (the class that holds the codes), whichever forward a layer runs (cpu_gemv's
    # subclasses, batch_invariant's padding) when it is saved.
    layers = {name: {"kind": next(KINDS[c] for c in type(m).__mro__ if c in KINDS),
                     "in_features": m.in_features}
              for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.lm_head, "weight", None) is model.embed_tokens.weight:
        state.pop("lm_head.weight", None)          # tied: stored once, as the embedding
    save_file(state, str(target / "model.safetensors"))
    manifest = {"format": "workbench-quant", "version": 1, "method": method,
                "group_size": group_size, "dtype": str(model.embed_tokens.weight.dtype),
                "layers": layers}
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return target


def load_quantized(folder: Path, dtype: torch.dtype, device: torch.device,
                   max_positions: int | None = None) -> tuple[LlamaModel, dict]:
    from safetensors.torch import load_file

    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != "workbench-quant" or manifest.get("version") != 1:
        raise ValueError(f"{folder / MANIFEST} is not a workbench quantized checkpoint (format "
                         f"{manifest.get('format')!r} version {manifest.get('version')!r})")
    saved_dtype = manifest["dtype"].removeprefix("torch.")
    if str(dtype).removeprefix("torch.") != saved_dtype:
        raise ValueError(f"dtype={str(dtype).removeprefix('torch.')!r} is invalid for this "
                         f"quantized checkpoint: it was saved in {saved_dtype!r}; load it with that")
    args = read_args(folder)
    # Fresh, aligned copies: tensors read out of the file can sit at any byte offset, and torch's
    # packed CPU kernels (aten._weight_int8pack_mm) can crash on such a weight.
    state = {k: v.clone() for k, v in load_file(str(folder / "model.safetensors"),
                                                 device=str(device)).items()}
    with torch.device("meta"):
        model = LlamaModel(args, max_positions)
    model.to_empty(device=device)   # allocate the float parameters (unused projections too, then
    model.to(dtype)                 # replaced below: the peak is about the float model's size)
    for name, spec in manifest["layers"].items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, _build_layer(spec, name, state, dtype))
    if args.tie_word_embeddings and "lm_head.weight" not in state and "lm_head" not in \
            manifest["layers"]:
        model.lm_head.weight = model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and args.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"quantized checkpoint {folder} does not fit the model: missing "
                         f"{missing[:4]}, unexpected {unexpected[:4]}")
    model.rotary.rebuild(device)
    return model.eval(), manifest


def _build_layer(spec: dict, name: str, state: dict, dtype: torch.dtype) -> QuantLinear:
    kind = spec["kind"]
    if kind == "int8":
        return Int8Linear(Int8Weight(state[f"{name}.qweight"], state[f"{name}.scale"].float()),
                          dtype)
    if kind == "w8a8":
        # input_scale is saved only by static SmoothQuant; without it the layer is dynamic
        return W8A8Linear(Int8Weight(state[f"{name}.qweight_t"].t(), state[f"{name}.scale"]),
                          dtype, state.get(f"{name}.input_scale"))
    scale = state[f"{name}.scale"].float()
    packed = state[f"{name}.packed"]
    group = packed.shape[1] * 2 // scale.shape[1]
    return Int4Linear(Int4Weight(packed, scale, state[f"{name}.minimum"].float(), group,
                                 spec["in_features"]), dtype)
