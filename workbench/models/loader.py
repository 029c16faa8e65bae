"""Load a Llama-family checkpoint into the engine's own `LlamaModel`.

Every source is first turned into one format, a transformers-style folder (config.json,
model.safetensors, tokenizer files), so there is one weight-loading path:
- a local folder is used as it is;
- a GGUF file (the embedded default included) is dequantized once by transformers' GGUF reader and
  saved in the cache, keyed by the file's hash: the first load dequantizes the whole file, later
  ones only read the saved folder (`time python -m workbench info`, twice, shows both);
- 'random:<preset>' writes a seeded random-weight checkpoint once, also in the cache.
The same folder is what tests hand to transformers, so engine and oracle read identical weights.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from workbench.models.llama import LlamaArgs, LlamaModel
from workbench.models.registry import (ALIASES, GGUF_ARCHITECTURES, RANDOM_COMMON, RANDOM_PRESETS,
                                       cache_dir, describe_sources, embedded_gguf)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _publish(tmp: Path, target: Path) -> Path:
    """Move a finished folder into place; if another process won the race, keep theirs."""
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_architecture(gguf_path: Path) -> str:
    """The file's `general.architecture`, read from its header (no tensor data is read)."""
    from gguf import GGUFReader
    try:
        field = GGUFReader(str(gguf_path)).fields.get("general.architecture")
    except (ValueError, OSError) as e:
        raise ValueError(f"model={str(gguf_path)!r} is not a readable GGUF file: {e}") from None
    if field is None:
        raise ValueError(f"model={str(gguf_path)!r}: the GGUF file names no "
                         "general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into a cached transformers folder (fp32 safetensors + tokenizer).
    An architecture the engine cannot run is refused from the file's header, before anything is
    dequantized or written."""
    target = cache_dir() / "models" / f"{gguf_path.stem}-{_file_hash(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    arch = gguf_architecture(gguf_path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"model={str(gguf_path)!r} is not supported: its GGUF architecture is "
                         f"{arch!r}, and the workbench runs "
                         + ", ".join(repr(a) for a in GGUF_ARCHITECTURES)
                         + " (Llama-family) files; nothing was converted")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    print(f"[workbench] converting {gguf_path.name} once into {target} (about 20 s)")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the folder ourselves.
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors stores it once
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["workbench_source"] = gguf_path.name
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    hf_model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish(tmp, target)


def make_random_checkpoint(preset: str, seed: int = 0, folder: Path | None = None) -> Path:
    """Write a seeded random-weight Llama (transformers' own init) as a folder; cached by default."""
    if preset not in RANDOM_PRESETS:
        raise ValueError(f"model='random:{preset}' is invalid: presets are "
                         + ", ".join(RANDOM_PRESETS))
    target = folder or cache_dir() / "models" / f"random-{preset}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    from transformers import LlamaConfig, LlamaForCausalLM
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".random-"))
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(LlamaConfig(**RANDOM_COMMON, **RANDOM_PRESETS[preset]))
    hf_model.save_pretrained(tmp)
    try:  # Share SmolLM2's tokenizer so text prompts work; token-id prompts work without it.
        tokenizer_src = resolve_checkpoint("smollm2-135m")
        for f in tokenizer_src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, tmp / f.name)
    except ValueError:
        pass
    return _publish(tmp, target)


def resolve_checkpoint(model: str) -> Path:
    """Turn a model name or path into a transformers-style folder on disk."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model={model!r} is invalid: use {describe_sources()}")
    if model.lower() in ALIASES:
        return convert_gguf(embedded_gguf())
    if model.startswith("random:"):
        return make_random_checkpoint(model.split(":", 1)[1])
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={model!r} is invalid: the folder has no config.json")
        if not list(path.glob("*.safetensors")):
            raise ValueError(f"model={model!r} is invalid: the folder has no *.safetensors weights")
        return path
    raise ValueError(f"model={model!r} is not a known model: use {describe_sources()}")


def read_args(folder: Path) -> LlamaArgs:
    return LlamaArgs.from_hf_config(json.loads((folder / "config.json").read_text()))


FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
         "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
         "mlp.up_proj": ("mlp.gate_up_proj", 1)}


def load_model(folder: Path, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None, on_layer=None) -> LlamaModel:
    """Build the model without initializing it (meta device), then fill in the checkpoint one
    tensor at a time, cast to `dtype` as it is read: peak memory stays near the final model's
    size plus one fp32 tensor. transformers' q/k/v and gate/up tensors are written straight into
    their slices of our fused `qkv_proj` and `gate_up_proj`.

    Decoder layers are allocated one at a time, just before they are filled, and handed to
    `on_layer(index, layer)` once complete: a tensor-parallel worker keeps its slices there
    (parallel/tensor.py), so it never holds more than its shard plus one whole layer."""
    from safetensors import safe_open
    args = read_args(folder)
    with torch.device("meta"):
        model = LlamaModel(args, max_positions)

    def materialize(module):
        module.to_empty(device=device)
        module.to(dtype)

    for name, child in model.named_children():
        if name != "layers":
            materialize(child)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    offsets = {"self_attn.qkv_proj": [0, q, q + kv], "mlp.gate_up_proj": [0, args.intermediate_size]}
    by_part: dict[str, list] = {}          # "" (embedding, norm, head) or "layers.<i>"
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for hf_name in st.keys():
                name = hf_name.removeprefix("model.")
                if name == "lm_head.weight" and args.tie_word_embeddings:
                    continue
                part = ".".join(name.split(".")[:2]) if name.startswith("layers.") else ""
                by_part.setdefault(part, []).append((f, hf_name, name))
    rest = {n: p for n, p in model.named_parameters() if not n.startswith("layers.")}
    _fill(folder, by_part.pop("", []), rest, offsets, args)
    for i, layer in enumerate(model.layers):
        materialize(layer)
        params = {f"layers.{i}.{n}": p for n, p in layer.named_parameters()}
        _fill(folder, by_part.pop(f"layers.{i}", []), params, offsets, args)
        if on_layer is not None:
            on_layer(i, layer)
    if by_part:
        extra = [hf for entries in by_part.values() for _, hf, _ in entries]
        raise ValueError(f"checkpoint {folder} does not fit the Llama architecture: "
                         f"unexpected tensor {extra[0]}")
    model.rotary.rebuild(device)
    return model.eval()


def _fill(folder, entries, params: dict, offsets: dict, args) -> None:
    """Copy checkpoint tensors into `params` (one part of the model); every one must be filled."""
    from safetensors import safe_open
    filled = set()
    # Each part opens the files itself and closes them after: safetensors maps the whole file,
    # and the pages read stay counted in the process's memory until the mapping is closed.
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt"))
                   for f in sorted({f for f, _, _ in entries})}
        _copy_into(folder, entries, handles, params, offsets, filled)
    expected = set()
    for name in params:
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        fused = next((f for f in offsets if f in name), None)
        parts = range(len(offsets[fused])) if fused else [None]
        expected |= {name if p is None else f"{name}#{p}" for p in parts}
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint {folder} does not fit the Llama architecture: "
                         f"missing {missing[:4]}")


CHUNK_ROWS = 4096


def _copy_into(folder, entries, handles, params: dict, offsets: dict, filled: set) -> None:
    for f, hf_name, name in entries:
        key = next((k for k in FUSED if f".{k}." in name), None)
        if key is None and name in params:
            # Unfused tensors are copied in slices of rows: the embedding alone is 113 MB in
            # fp32, and a whole temporary copy of it would double that at the peak.
            rows = handles[f].get_slice(hf_name)
            n = rows.get_shape()[0]
            for a in range(0, n, CHUNK_ROWS):
                params[name].data[a:a + CHUNK_ROWS].copy_(rows[a:min(a + CHUNK_ROWS, n)])
            filled.add(name)
            continue
        tensor = handles[f].get_tensor(hf_name)
        if key is not None:
            fused, part = FUSED[key]
            target_name = name.replace(key, fused)
            start = offsets[fused][part]
            params[target_name].data[start:start + tensor.shape[0]].copy_(tensor)
            filled.add(f"{target_name}#{part}")
        else:
            raise ValueError(f"checkpoint {folder} does not fit the Llama architecture: "
                             f"unexpected tensor {hf_name}")
        del tensor


def load_tokenizer(folder: Path):
    """The checkpoint's tokenizer, or None for a weights-only folder (token-id prompts only)."""
    if not any(folder.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))
