"""The one place where the engine chooses its attention implementation, and the contract
every implementation keeps.

A backend is an object with a `name` and one method, called once per layer per step:

    forward(q, k, v, k_cache, v_cache, meta, scale) -> (num_tokens, num_heads * head_dim)

- q (num_tokens, num_heads, head_dim), k and v (num_tokens, num_kv_heads, head_dim): this step's
  new tokens, packed, rotary embedding already applied;
- k_cache, v_cache (num_blocks * block_size, num_kv_heads, head_dim): this layer's paged cache;
- meta: AttentionMetadata (attention/metadata.py): where each sequence's new tokens start
  (query_start_loc), how long each context is (seq_lens), where to write (slot_mapping) and where
  to read (block_tables, or slot_table for backends that prefer one index per position).
The backend must first write k and v at slot_mapping, then attend each new query to its sequence's
keys up to its own position (causal, aligned bottom-right). It may cache per-step work in
`meta.plan` (the metadata object is shared by all layers of one step).

Only the plain-PyTorch reference exists so far; the Triton kernels (FlashAttention for prefill,
paged split-KV decode) register here, and `attention_backend="auto"` will prefer them on CUDA.
"""
from __future__ import annotations

import torch

from .torch_backend import TorchAttention

BACKENDS = {"torch": TorchAttention}


def get_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is invalid: allowed values are "
                         f"'auto', {', '.join(repr(b) for b in BACKENDS)}")
    return BACKENDS[name]()
