"""Lab 11 (memory hierarchy): the KV cache's size per token for a published model.

The references are the workbench's own: `memory_plan(...).kv_bytes_per_token`
(`workbench/plan/calculator.py`) over the bundled configs (`workbench/plan/configs/`), and for
SmolLM2 the engine's `kv_bytes_per_token` (`workbench/kv/paged_cache.py`), which sizes the pool.
"""
from __future__ import annotations

import json

from .core import call, exercise, expect_equal

CHAPTER = "11_memory_hierarchy"


def _configs() -> list[dict]:
    from ...plan.architecture import CONFIGS
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(CONFIGS.glob("*.json"))]


def _kv_mistake(cfg: dict, kv_bytes: int, got) -> str:
    """The hint for a typical wrong count, or '' when none matches."""
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if cfg.get("kv_lora_rank"):
        per_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * kv_bytes
        if got == 2 * per_layer * layers:
            return ("MLA caches one latent per token and layer, used for both keys and values: "
                    "no factor 2 for K and V.")
        if got == 2 * layers * kv_heads * head_dim * kv_bytes or got == 2 * layers * heads * (
                cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) * kv_bytes:
            return ("with MLA (kv_lora_rank > 0) the cache holds the compressed latent "
                    "(kv_lora_rank values) plus the shared rotary key (qk_rope_head_dim values) per "
                    "layer, not per-head keys and values.")
        return ""
    full = 2 * layers * kv_heads * head_dim * kv_bytes
    if kv_heads != heads and got == full // kv_heads * heads:
        return ("grouped-query attention: only num_key_value_heads heads have keys and values; "
                f"the {heads} query heads share them ({heads // kv_heads} per KV head).")
    if got == full // 2:
        return "K and V are two tensors: count both."
    if got == full // layers:
        return "every layer has its own K and V: multiply by num_hidden_layers."
    if got == full // kv_bytes:
        return "that counts elements: multiply by the bytes of one element (kv_bytes)."
    return ""


@exercise("memory.kv_bytes_per_token", CHAPTER, "kv_bytes_per_token",
          "KV cache bytes per token of a model, from its config.json",
          hint="per layer a token stores a key and a value for each KV head: 2 x "
               "num_key_value_heads x head_dim elements (head_dim defaults to hidden_size // "
               "num_attention_heads, and num_key_value_heads to num_attention_heads). With MLA "
               "(kv_lora_rank > 0) it stores kv_lora_rank + qk_rope_head_dim elements instead. "
               "Multiply by the layers and the bytes of one element.")
def check_kv_bytes_per_token(kv_bytes_per_token) -> None:
    from ...plan import memory_plan

    kv_names = {1: "fp8", 2: "bf16", 4: "fp32"}
    # Dense attention first, MLA last: a mistake meets the case its hint speaks of.
    for cfg in sorted(_configs(), key=lambda c: bool(c.get("kv_lora_rank"))):
        for kv_bytes in (4, 2, 1):   # fp32 first: a missing factor 2 and missing bytes differ
            expected = memory_plan(cfg["name"], kv_cache_dtype=kv_names[kv_bytes]).kv_bytes_per_token
            what = f"kv_bytes_per_token(<{cfg['name']} config>, kv_bytes={kv_bytes})"
            got = call(kv_bytes_per_token, what, dict(cfg), kv_bytes)
            if got != expected:
                expect_equal(got, expected, what, _kv_mistake(cfg, kv_bytes, got))
    # The engine sizes its own pool with the same formula (SmolLM2 in bf16: 30 layers x 3 KV heads).
    import torch

    from ...kv.paged_cache import kv_bytes_per_token as engine_kv_bytes
    from ...models.llama import LlamaArgs
    cfg = next(c for c in _configs() if c["name"] == "SmolLM2-135M")
    args = LlamaArgs.from_hf_config({**cfg, "model_type": "llama"})
    expected = engine_kv_bytes(args, torch.bfloat16)
    what = "kv_bytes_per_token(<SmolLM2-135M config>, kv_bytes=2), the engine's own pool"
    got = call(kv_bytes_per_token, what, dict(cfg), 2)
    expect_equal(got, expected, what, _kv_mistake(cfg, 2, got))
