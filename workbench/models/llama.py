"""The Llama family (SmolLM2, Llama 2/3, TinyLlama, ...) in plain PyTorch, written for inference.

Differences from transformers' modeling code, each for a reason:
- Tokens are *packed*: `input_ids` is one row of all scheduled sequences' new tokens, and
  `AttentionMetadata` says where each sequence starts. No padding, no attention over padding.
- Q, K, V are one fused linear (`qkv_proj`), gate and up another (`gate_up_proj`): fewer, larger
  matmuls per layer. The loader concatenates transformers' separate weights into them.
- The KV cache and the attention backend are passed in, not owned: the engine decides how keys and
  values are stored (contiguous or paged) and which kernel reads them.
- Every projection is a plain `nn.Linear`, so quantization and tensor parallelism can swap modules.
- Each layer returns (output, residual) and the residual add happens inside the next RMSNorm
  (vLLM's layer signature); norms and rotary go through the backend's `ops` (layers/ops.py), so the
  Triton backend swaps in fused kernels without changing the arithmetic.
The arithmetic (fp32 RMSNorm, rotate-half RoPE, SwiGLU) follows transformers' `LlamaForCausalLM`
so that greedy outputs match it token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.attention.metadata import AttentionMetadata
from workbench.layers.linear import QuantLinear
from workbench.layers.norm import RMSNorm
from workbench.layers.rotary import RotaryEmbedding, check_rope_scaling


# config.json model_type values this module runs (None: a config that does not say).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", None)


@dataclass
class LlamaArgs:
    """The architecture numbers, read from a transformers `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    # Mistral's sliding window: each token attends to itself and the window - 1 before it. The
    # engine has no sliding-window attention, so it runs such a model only on contexts of at most
    # this many tokens, where full attention sees the same keys (config/resolve.py caps the context).
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArgs":
        """The numbers of a supported config.json; a ValueError names what does not fit."""
        family = cfg.get("model_type")
        if family not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={family!r} is not supported: the workbench runs "
                             + ", ".join(repr(t) for t in SUPPORTED_MODEL_TYPES if t)
                             + " (Llama-family) models")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ValueError(f"{flag}={cfg[flag]!r} is not supported: the Llama module's "
                                 "projections have no bias")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported: the Llama "
                             "module's MLP is SwiGLU (allowed: 'silu')")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        check_rope_scaling(scaling)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False), rope_scaling=scaling,
            sliding_window=cfg.get("sliding_window") if family == "mistral" else None)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token occupies in the cache, all layers together."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


class Attention(nn.Module):
    """The attention projections and sizes; DecoderLayer runs them around the backend's call.

    num_heads: this layer's query heads, when they are fewer than args.num_attention_heads
    (structured head pruning, compress/structured.py, removes the same number from every KV
    group, so they stay a multiple of num_kv_heads and query head i reads KV head
    i // (num_heads // num_kv_heads)). Everything that runs attention reads the layer's own
    `num_heads` / `q_size`, never the args'; the KV heads, and so the cache, are the args'."""

    def __init__(self, args: LlamaArgs, num_heads: int | None = None):
        super().__init__()
        heads = args.num_attention_heads if num_heads is None else num_heads
        if heads < 1 or heads % args.num_key_value_heads:
            raise ValueError(f"num_heads={heads} is invalid: it must be a positive multiple of "
                             f"num_key_value_heads={args.num_key_value_heads}")
        self.num_heads, self.num_kv_heads = heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up in one matmul."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, residual, rope, kv_cache, meta, backend):
        """x: the previous layer's output (not yet added to the residual stream); residual: the
        stream so far (None in the first layer). The add is fused into each norm, as in vLLM.

        The layer is three calls so that the dense parts around attention, which see only
        this step's tokens, can be compiled (torch.compile fuses their dozens of small ops) while
        the attention call, which reads the paged cache with a different shape every step, stays
        eager: see models/compile.py."""
        q, k, v, residual = self.pre_attention(x, residual, rope, backend.ops)
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.self_attn.scale)
        return self.post_attention(attn, residual, backend.ops)

    def pre_attention(self, x, residual, rope, ops):
        """Residual add + input norm, the QKV projection and rotary: q (T, H, D), k and v
        (T, KVH, D), and the residual stream."""
        norm = self.input_layernorm
        if residual is None:
            x, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            x, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
        attn = self.self_attn
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        q, k = ops.rotary(q, k, rope)
        return q, k, v, residual

    def post_attention(self, attn_out, residual, ops):
        """The output projection, residual add + post-attention norm, and the MLP."""
        x = self.self_attn.o_proj(attn_out)
        norm = self.post_attention_layernorm
        x, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Token ids in, final hidden states out; `compute_logits` applies the LM head."""

    def __init__(self, args: LlamaArgs, max_positions: int | None = None):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(args, max_positions or args.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend, num_layers: int | None = None) -> torch.Tensor:
        """num_layers: run only the first layers, then the final norm (an early exit: the
        layer-skip drafter of spec/)."""
        x = self.embed_tokens(input_ids)
        rope = backend.ops.rope_inputs(self.rotary, positions, x.dtype)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers[:num_layers], kv_caches)):
            x, residual = layer(x, residual, rope, kv_cache, meta.for_layer(i), backend)
        return backend.ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32, whatever the model dtype, so sampling and logprobs are precise."""
        return self.lm_head(hidden).float()

    def num_parameters(self) -> int:
        """The model's logical parameters, each counted once, as its checkpoint (and transformers)
        counts them. A head tied to the embedding is the embedding's table, whatever copy of it
        the kernels keep: an fp32 engine over bf16 weights gives the head a bf16 copy of its own
        (models/cpu_gemv.py: store_weights_bf16), which is not counted again."""
        tied = self.args.tie_word_embeddings
        return sum(p.numel() for name, p in self.named_parameters()
                   if not (tied and name.startswith("lm_head.")))

    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step: every matrix once (quantized layers in their
        packed format); of the embedding table only a row is read, unless the LM head is that
        same table (tied and unquantized), in which case the head reads all of it."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        total += sum(m.weight_bytes() for m in self.modules() if isinstance(m, QuantLinear))
        if getattr(self.lm_head, "weight", None) is not self.embed_tokens.weight:
            w = self.embed_tokens.weight
            total -= w.numel() * w.element_size()
        return total
