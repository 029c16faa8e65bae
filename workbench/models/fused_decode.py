"""A decode step in one C++ call (kernels/cpu/decode_step.cpp): the last rung of the CPU speed
ladder, after torch.compile.

Data flow of a step the engine runs with `fused_decode=True`:

    runner.execute -> FusedDecodeForward(input_ids, positions, kv_caches, meta, backend)
      decode-only step (every sequence feeds one token), paged bf16 cache, C++ attention backend:
        embedding lookup (one torch op)
        -> torch.ops.workbench_cpu.decode_step_bf16: for each layer, in C++,
           add + RMSNorm -> QKV GEMV -> rotary -> write K/V + paged attention -> O GEMV
           -> add + RMSNorm -> gate/up GEMV -> SiLU x up -> down GEMV;   then the final norm
      anything else (prefills, chunked or speculative steps, the layer-skip drafter): the inner
      forward, eager or compiled, unchanged
    -> hidden states -> the LM head (GemvLinear) -> logits, as before

Why a step is worth one call: after torch.compile a bf16 SmolLM2 decode step on the 2-core VM is
~12 ms, of which the GEMV loops reading the weights take ~9; most of the other ~3 ms is calling
(~240 kernel calls from Inductor's Python wrapper, 30 attention calls through Python, size
asserts), not arithmetic. The C++ loop does the same arithmetic with none of that.

The module holds only references to the model's own parameters and rotary tables (no copies), so
it costs no memory; the engine never edits its model after building it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.metadata import AttentionMetadata


def fused_decode_unsupported(model) -> str | None:
    """Why this model cannot run the fused step (None if it can): it needs bf16 weights in plain
    linear layers (no quantization, no experts) and a head size the attention kernel takes."""
    from .cpu_gemv import GemvLinear
    args = model.args
    for i, layer in enumerate(model.layers):
        for name, mod in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", getattr(layer.mlp, "gate_up_proj", None)),
                          ("down_proj", getattr(layer.mlp, "down_proj", None))):
            if not isinstance(mod, GemvLinear):
                kind = type(mod).__name__ if mod is not None else "missing (experts?)"
                return (f"layer {i}'s {name} is {kind}, and the fused step takes bf16 GemvLinear "
                        "layers only (no quantization, no experts)")
    if args.head_dim % 16:
        return f"head_dim={args.head_dim} is not a multiple of 16 (the paged attention kernel's)"
    return None


class FusedDecodeForward:
    """A drop-in for the runner's forward: decode-only steps go to the C++ step, the rest to
    `inner` (the model itself, or its CompiledForward)."""

    def __init__(self, model, inner):
        why_not = fused_decode_unsupported(model)
        if why_not:
            raise ValueError(f"fused_decode=True is invalid for this model: {why_not}")
        self.model, self.inner = model, inner
        layers = model.layers
        self.in_norms = [l.input_layernorm.weight for l in layers]
        self.post_norms = [l.post_attention_layernorm.weight for l in layers]
        self.qkv = [l.self_attn.qkv_proj.weight for l in layers]
        self.o = [l.self_attn.o_proj.weight for l in layers]
        self.gate_up = [l.mlp.gate_up_proj.weight for l in layers]
        self.down = [l.mlp.down_proj.weight for l in layers]
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, attn.scale
        self.eps = model.norm.eps
        if any(l.input_layernorm.eps != self.eps or l.post_attention_layernorm.eps != self.eps
               for l in layers):
            raise ValueError("fused_decode=True is invalid for this model: its norms' eps differ")
        self._caches = (None, None, None)        # (the engine's cache list, its K list, its V list)

    @staticmethod
    def takes(meta: AttentionMetadata, backend) -> bool:
        """Whether a step runs fused: every sequence decodes one token, over the paged cache in the
        model's dtype, with the C++ attention backend."""
        return (meta.max_query_len == 1 and meta.block_tables is not None
                and meta.kv_cache_dtype == "auto" and getattr(backend, "decode_kernel", False))

    def _split(self, kv_caches):
        if self._caches[0] is not kv_caches:     # the list is the engine's, built once
            self._caches = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        return self._caches[1], self._caches[2]

    def __call__(self, input_ids, positions, kv_caches, meta, backend, num_layers=None):
        if num_layers is not None or not self.takes(meta, backend):
            return self.inner(input_ids, positions, kv_caches, meta, backend, num_layers)
        m = self.model
        k_caches, v_caches = self._split(kv_caches)
        x = F.embedding(input_ids, m.embed_tokens.weight)
        return torch.ops.workbench_cpu.decode_step_bf16(
            x, positions, self.in_norms, self.post_norms, self.qkv, self.o, self.gate_up,
            self.down, m.norm.weight, m.rotary.cos, m.rotary.sin, k_caches, v_caches,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.block_size, self.eps,
            self.scale, self.num_heads, self.num_kv_heads)
