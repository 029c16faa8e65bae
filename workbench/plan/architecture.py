"""Published model architectures: the numbers of a Hugging Face `config.json` that decide memory.

Each model is one JSON file in configs/, holding the fields of its `config.json` under their
transformers names, plus `name` (how the calculator calls it) and `source` (the Hugging Face
repository the numbers come from). `Architecture` is the same information under one set of names
for every family: Llama-style (llama, mistral, qwen2), Mixtral's MoE, DeepSeek-V3's MLA and MoE,
and OPT (learned positions, LayerNorm, plain two-matrix MLP, biases everywhere).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "deepseek_v3", "opt")


@dataclass(frozen=True)
class Architecture:
    name: str
    source: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    gated_mlp: bool = True               # SwiGLU: gate, up and down; OPT: fc1 and fc2
    layer_norm: bool = False             # LayerNorm (weight and bias) instead of RMSNorm
    qkv_bias: bool = False               # Qwen2 adds a bias to q, k and v
    linear_bias: bool = False            # OPT: every linear layer has a bias
    learned_positions: int = 0           # rows of a learned position table (OPT: 2048 + 2)
    # Mixture of experts: 0 routed experts means a dense model.
    num_routed_experts: int = 0
    num_shared_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0       # the first k layers keep a dense MLP
    # Multi-head latent attention (DeepSeek): kv_lora_rank > 0 turns it on.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, index: int) -> bool:
        return self.is_moe and index >= self.first_k_dense_replace

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "Architecture":
        """Map a config.json (with `name` and `source` added) onto the common fields."""
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"model_type={family!r} is not supported: allowed are "
                             + ", ".join(FAMILIES))
        heads = cfg["num_attention_heads"]
        common = dict(
            name=cfg["name"], source=cfg["source"], hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"], tie_word_embeddings=cfg.get("tie_word_embeddings", False))
        if family == "opt":
            if cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]:
                raise ValueError(f"{cfg['name']}: OPT's projected embeddings (word_embed_proj_dim "
                                 "!= hidden_size, as in OPT-350M) are not modelled")
            # OPT's position table has two extra rows: its position ids start at 2.
            return cls(**common, intermediate_size=cfg["ffn_dim"], gated_mlp=False,
                       layer_norm=True, linear_bias=True,
                       learned_positions=cfg["max_position_embeddings"] + 2)
        if family == "mixtral":
            return cls(**common, intermediate_size=cfg["intermediate_size"],
                       num_routed_experts=cfg["num_local_experts"],
                       experts_per_token=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["intermediate_size"])
        if family == "deepseek_v3":
            return cls(**common, intermediate_size=cfg["intermediate_size"],
                       num_routed_experts=cfg["n_routed_experts"],
                       num_shared_experts=cfg["n_shared_experts"],
                       experts_per_token=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["moe_intermediate_size"],
                       first_k_dense_replace=cfg["first_k_dense_replace"],
                       kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg["q_lora_rank"],
                       qk_rope_head_dim=cfg["qk_rope_head_dim"],
                       qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"])
        return cls(**common, intermediate_size=cfg["intermediate_size"],
                   qkv_bias=family == "qwen2" or cfg.get("attention_bias", False))


@lru_cache(maxsize=None)
def _catalog() -> dict[str, Architecture]:
    found = {}
    for path in sorted(CONFIGS.glob("*.json")):
        arch = Architecture.from_hf_config(json.loads(path.read_text()))
        found[arch.name.lower()] = arch
    return found


def known_models() -> list[str]:
    return [arch.name for arch in _catalog().values()]


def architecture(name: str) -> Architecture:
    """The published architecture by name (case-insensitive), e.g. "Llama-3-70B"."""
    arch = _catalog().get(name.lower()) if isinstance(name, str) else None
    if arch is None:
        raise ValueError(f"model={name!r} is not a known architecture: use one of "
                         + ", ".join(known_models()))
    return arch
