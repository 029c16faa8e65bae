"""A decode step in one C++ call (kernels/cpu/decode_step.cpp): the last rung of the CPU speed
ladder, after torch.compile.

Data flow of a step the engine runs with `fused_decode=True`:

    runner.execute -> FusedDecodeForward(input_ids, positions, kv_caches, meta, backend)
      decode-like step (every sequence feeds 1 to MAX_QUERY_LEN tokens that all get logits: a
      decode step, or the k + 1 tokens of a speculative verification), paged cache in the model's
      dtype (bf16 or fp32), C++ attention backend:
        embedding lookup (one torch op)
        -> torch.ops.workbench_cpu.decode_step: for each layer, in C++,
           add + RMSNorm -> QKV GEMV -> rotary -> write K/V + paged attention -> O GEMV
           -> add + RMSNorm -> gate/up GEMV -> SiLU x up -> down GEMV;   then the final norm
           (the GEMVs are the layers' own: bf16, INT8, INT4 or fp32 weights, gemv.cpp; each
           layer's own number of query heads, so head-pruned models run fused too)
      anything else (prefills, long chunks, the layer-skip drafter): the inner forward, eager or
      compiled, unchanged
    -> hidden states -> the LM head (its own GEMV layer) -> logits, as before

Why a step is worth one call: after torch.compile a SmolLM2 decode step at batch 1 spends most of
its time in the GEMV loops reading the weights, and most of the rest calling (a few hundred kernel
calls from Inductor's Python wrapper, 30 attention calls through Python, size asserts), not
arithmetic. The C++ loop does the same arithmetic with none of that (`python -m
workbench.bench.cpu_decode_step bf16 int4` times a fused step against an unfused one).

A verification's tokens run as rows of their own: token i of a sequence gets the sequence's block
table and a context of its position + 1. The step writes every row's K/V before any row attends,
so each token sees exactly its prefix, the causal attention of a prefill, with no mask.

The module holds only references to the model's own parameters, rotary tables and (INT4) the
layout of the codes that aten's kernel reads, which the layers cache anyway: no copies, no memory;
the engine never edits its model after building it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.attention.metadata import AttentionMetadata


# weight_kind of decode_step.cpp: 0 bf16, 1 INT8, 2 INT4, 3 fp32 weights.
# Longest query per sequence a fused step takes: speculative verifications (k + 1 tokens) fit;
# prefills do not (one row per token re-reads the context once per token, a prefill's GEMM does not).
MAX_QUERY_LEN = 16
WEIGHT_KINDS = {"GemvLinear": 0, "Int8GemvLinear": 1, "Int4GemvLinear": 2}
LAYER_NAMES = "GemvLinear (bf16 or fp32), Int8GemvLinear, Int4GemvLinear or an fp32 nn.Linear"


def weight_kind(layer) -> int | None:
    """decode_step.cpp's weight_kind for a projection, None if it takes no such layer: the GEMV
    layers by class, an fp32 weight (GemvLinear, or a plain bias-free nn.Linear) as kind 3."""
    name = type(layer).__name__
    if name in ("GemvLinear", "Linear") and layer.bias is None \
            and layer.weight.dtype == torch.float32:
        return 3
    return WEIGHT_KINDS.get(name)


def layer_tensors(layer, kind: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors of one projection that decode_step.cpp reads (its `Projections`): the weight
    (bf16, fp32); qweight and scale (INT8); the INT4 codes, scale, minimum and aten's layout of
    them for activations of `dtype`."""
    if kind in (0, 3):
        return [layer.weight]
    if kind == 1:
        return [layer.qweight, layer.scale]
    aten_packed, _, aten_scale_zero = layer._aten_pack(dtype)
    return [layer.packed, layer.scale, layer.minimum, aten_packed, aten_scale_zero]


def fused_decode_unsupported(model) -> str | None:
    """Why this model cannot run the fused step (None if it can): its activations bf16 or fp32, its
    projections all one of the GEMV layers (bf16, INT8 or INT4 with an even group size, no
    experts) or fp32 weights with fp32 activations, and its head size one the attention kernel
    takes."""
    args = model.args
    dtype = model.norm.weight.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return f"its activations are {dtype}, and the fused step takes bfloat16 or float32"
    kinds = set()
    for i, layer in enumerate(model.layers):
        for name, mod in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", getattr(layer.mlp, "gate_up_proj", None)),
                          ("down_proj", getattr(layer.mlp, "down_proj", None))):
            kind = weight_kind(mod) if mod is not None else None
            if kind is None:
                what = type(mod).__name__ if mod is not None else "missing (experts?)"
                return (f"layer {i}'s {name} is {what}, and the fused step takes {LAYER_NAMES}: "
                        "bf16, INT8, INT4 or fp32 weights, no "
                        "experts")
            if kind == 3 and dtype != torch.float32:
                return f"layer {i}'s {name} has fp32 weights and the activations are {dtype}"
            kinds.add(kind)      # INT4 group sizes may differ: the step reads each one's own
    if len(kinds) > 1:
        return f"its projections mix weight kinds {sorted(kinds)}; the fused step takes one kind"
    if args.head_dim % 16:
        return f"head_dim={args.head_dim} is not a multiple of 16 (the paged attention kernel's)"
    return None


class FusedDecodeForward:
    """A drop-in for the runner's forward: decode-like steps go to the C++ step, the rest to
    `inner` (the model itself, or its CompiledForward)."""

    def __init__(self, model, inner):
        why_not = fused_decode_unsupported(model)
        if why_not:
            raise ValueError(f"fused_decode=True is invalid for this model: {why_not}")
        self.model, self.inner = model, inner
        layers = model.layers
        self.in_norms = [l.input_layernorm.weight for l in layers]
        self.post_norms = [l.post_attention_layernorm.weight for l in layers]
        first = layers[0].self_attn.qkv_proj
        self.weight_kind = k = weight_kind(first)
        dt = model.norm.weight.dtype
        self.qkv = [t for l in layers for t in layer_tensors(l.self_attn.qkv_proj, k, dt)]
        self.o = [t for l in layers for t in layer_tensors(l.self_attn.o_proj, k, dt)]
        self.gate_up = [t for l in layers for t in layer_tensors(l.mlp.gate_up_proj, k, dt)]
        self.down = [t for l in layers for t in layer_tensors(l.mlp.down_proj, k, dt)]
        attn = layers[0].self_attn
        # The most query heads any layer has: the step reads each layer's own count from its qkv
        # rows (head-pruned layers have fewer, decode_step.cpp); the KV heads are all layers'.
        self.num_heads = max(l.self_attn.num_heads for l in layers)
        self.num_kv_heads, self.scale = attn.num_kv_heads, attn.scale
        self.eps = model.norm.eps
        if any(l.input_layernorm.eps != self.eps or l.post_attention_layernorm.eps != self.eps
               for l in layers):
            raise ValueError("fused_decode=True is invalid for this model: its norms' eps differ")
        self._caches = (None, None, None)        # (the engine's cache list, its K list, its V list)

    @staticmethod
    def takes(meta: AttentionMetadata, backend) -> bool:
        """Whether a step runs fused: every sequence feeds one token, or up to MAX_QUERY_LEN that
        all get logits (a verification: no prompt tokens), over the paged cache in the model's
        dtype, with the C++ attention backend."""
        short = meta.max_query_len == 1 or (meta.decode_like
                                            and meta.max_query_len <= MAX_QUERY_LEN)
        return (short and meta.block_tables is not None and meta.kv_cache_dtype == "auto"
                and getattr(backend, "decode_kernel", False))

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
        block_tables, seq_lens = meta.block_tables, meta.seq_lens
        if meta.max_query_len > 1:       # one row per token, its context up to its own position
            counts = torch.tensor(meta.query_lens, device=block_tables.device)
            block_tables = block_tables.repeat_interleave(counts, dim=0)
            seq_lens = (positions + 1).contiguous()
        return torch.ops.workbench_cpu.decode_step(
            x, positions, self.in_norms, self.post_norms, self.qkv, self.o, self.gate_up,
            self.down, m.norm.weight, m.rotary.cos, m.rotary.sin, k_caches, v_caches,
            meta.slot_mapping, block_tables, seq_lens, meta.block_size, self.eps,
            self.scale, self.num_heads, self.num_kv_heads, self.weight_kind)
