"""A differentiable, batched forward pass over the engine's own `LlamaModel`, for training it.

The engine's forward writes into a paged KV cache and runs inference kernels; training needs
autograd through every weight. This runs the same weights and the same math (transformers'
RMSNorm, rotate-half rotary, causal grouped-query attention, SwiGLU) on dense (B, T) batches with
`scaled_dot_product_attention`, and decodes with a growing per-layer K/V cache so a student can
sample its own continuations (on-policy distillation) without re-running the prompt each token.
Each layer reads its own head counts and MLP width, so pruned models train as they are.

    ids (B, T) -> embed -> [norm -> qkv -> rotary -> causal SDPA (GQA) -> o_proj -> + ->
                            norm -> gate_up -> silu * up -> down -> +] x L -> norm -> hidden
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.kernels.reference import rms_norm_reference
from workbench.layers.rotary import apply_rotary
from workbench.models.llama import LlamaModel


def hidden_states(model: LlamaModel, ids: torch.Tensor,
                  cache: list | None = None, share_from: list[int] | None = None) -> torch.Tensor:
    """Final hidden states (B, T, hidden) of `ids` (B, T). With `cache` (a list, empty at the
    first call) each layer's K and V are kept there and `ids` continue the cached positions.
    share_from: cross-layer KV sharing, layer i attending to layer share_from[i]'s K and V
    (experiments/kv_compression.py's sharing_map); not with `cache`."""
    if share_from is not None and cache is not None:
        raise ValueError("share_from with a decode cache is invalid: sharing is for dense batches")
    kept = {}
    batch, length = ids.shape
    start = cache[0][0].shape[2] if cache else 0
    positions = torch.arange(start, start + length, device=ids.device)
    x = model.embed_tokens(ids)
    cos = model.rotary.cos[positions].to(x.dtype)[None, None]   # (1, 1, T, D)
    sin = model.rotary.sin[positions].to(x.dtype)[None, None]
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = rms_norm_reference(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(batch, length, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = k.view(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.view(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if share_from is not None:
            if share_from[index] != index:        # the group's first layer's K and V
                k, v = kept[share_from[index]]
            kept[index] = (k, v)
        if cache is not None:
            if index < len(cache):
                k, v = torch.cat([cache[index][0], k], 2), torch.cat([cache[index][1], v], 2)
                cache[index] = (k, v)
            else:
                cache.append((k, v))
        # A query sees every cached position and the causal part of its own chunk.
        mask = None
        if start and length > 1:
            mask = torch.ones(length, start + length, dtype=torch.bool, device=ids.device).tril(start)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale,
                                             is_causal=not start and length > 1,
                                             enable_gqa=attn.num_heads != attn.num_kv_heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, attn.q_size))
        h = rms_norm_reference(x, layer.post_attention_layernorm.weight,
                               layer.post_attention_layernorm.eps)
        x = x + layer.mlp(h)
    return rms_norm_reference(x, model.norm.weight, model.norm.eps)


def logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits (B, T, vocab), fp32."""
    return model.compute_logits(hidden_states(model, ids))


@torch.no_grad()
def sample(model: LlamaModel, prompts: torch.Tensor, new_tokens: int, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """prompts (B, P) followed by `new_tokens` tokens sampled from the model (temperature 0:
    greedy), (B, P + new_tokens). EOS is not special: every row has the same length."""
    cache: list = []
    seqs, step_ids = prompts, prompts
    for _ in range(new_tokens):
        z = model.compute_logits(hidden_states(model, step_ids, cache)[:, -1])
        if temperature == 0:
            nxt = z.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=generator)
        seqs, step_ids = torch.cat([seqs, nxt], 1), nxt
    return seqs
