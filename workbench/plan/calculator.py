"""memory_plan: what a published model needs in GPU memory (weights, KV cache, activations) under a
given precision and parallel layout, and how many sequences fit on GPUs of a given size."""
from __future__ import annotations

from workbench.plan.architecture import Architecture, architecture
from workbench.plan.formats import DTYPE_BYTES, DTYPE_NAMES, KV_DTYPE_BYTES, WEIGHT_FORMATS, linear_bytes
from workbench.plan.plan import GB, MemoryPlan, gb
from workbench.plan.tensors import Tensor, kv_heads_per_gpu, layer_tensors, outer_tensors

LOGITS_BYTES = 4  # logits are computed in fp32


def memory_plan(model: str | Architecture, *, dtype: str = "bf16", weight_format: str | None = None,
                kv_cache_dtype: str = "auto", batch: int = 1, context: int = 4096, tp: int = 1,
                pp: int = 1, ep: int = 1, gpu_memory_gb: float | None = None,
                gpu_memory_utilization: float = 0.9,
                max_num_batched_tokens: int = 8192) -> MemoryPlan:
    """Memory of `model` (a name from `known_models()`, or an `Architecture`) served by
    tp x pp x ep GPUs.

    - dtype: activations and every weight that `weight_format` leaves alone (embedding, LM head,
      norms, routers, biases), by any name the engine accepts ("bf16" or "bfloat16", "fp16",
      "float16" or "half", "fp32", "float32" or "float"); the plan reports the short name.
      weight_format quantizes the projection matrices (formats.py).
    - kv_cache_dtype: "auto" (the default, as the engine names it) stores the KV cache in `dtype`;
      a dtype name, "fp8" or "int8" (one byte per element) stores it in that format.
    - KV cache per token: 2 (K and V) x layers x KV heads x head_dim x element bytes; with MLA one
      latent vector (kv_lora_rank + qk_rope_head_dim) per layer, shared by all heads and kept
      whole on every tensor-parallel rank.
    - Activations: the peak of one prefill chunk of T = max_num_batched_tokens tokens, counting the
      residual stream and the normed hidden states (2 x T x hidden), the MLP's gate/up output and
      its activated product (3 x T x width / tp; 2 x for a two-matrix MLP; width = the experts a
      token visits, experts_per_token x moe_intermediate_size plus the shared experts), and the
      fp32 logits of the chunk's last tokens (min(batch, T) x vocab). Attention scores are not
      counted: flash attention never materializes them.
    - gpu_memory_gb (10^9 bytes): the KV budget is gpu_memory_gb x gpu_memory_utilization minus
      the weights and the activations per GPU; `max_sequences` is how many KV caches of `context`
      tokens it holds, and `reason` says why when that is 0.
    The model's weights only: no CUDA context, no CUDA graphs, no multi-token-prediction module.
    """
    arch = _check_model(model)
    dtype = normalize_dtype(dtype)
    _check_choice("weight_format", weight_format, WEIGHT_FORMATS)
    kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype, dtype)
    for name, value in (("batch", batch), ("context", context),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        _check_positive(name, value)
    _check_layout(arch, tp, pp, ep)
    if gpu_memory_gb is not None and not (_is_number(gpu_memory_gb) and gpu_memory_gb > 0):
        raise ValueError(f"gpu_memory_gb={gpu_memory_gb!r} is invalid: use a number > 0 or None")
    if not (_is_number(gpu_memory_utilization) and 0 < gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} is invalid: "
                         "use a number in (0, 1]")

    elem = DTYPE_BYTES[dtype]
    layers = [layer_tensors(arch, i, tp) for i in range(arch.num_hidden_layers)]
    outer = outer_tensors(arch, tp, pp)
    everything = [t for ts in layers for t in ts] + outer
    params_total = sum(t.numel for t in everything if not t.tied_copy)
    params_active = sum(_active(arch, t) for t in everything if not t.tied_copy)
    weight_total = sum(_bytes(t, t.shape, weight_format, elem, 1) for t in everything
                       if not t.tied_copy)

    stages = stage_layers(arch.num_hidden_layers, pp)
    stage_weights = []
    for s, (start, stop) in enumerate(stages):
        held = [t for ts in layers[start:stop] for t in ts]
        held += [t for t in outer if (t.stage == "first" and s == 0)
                 or (t.stage == "last" and s == pp - 1)]
        stage_weights.append(sum(_bytes(t, t.gpu_shape, weight_format, elem, ep) for t in held))
    weight_per_gpu = max(stage_weights)

    kv_elem = KV_DTYPE_BYTES[kv_cache_dtype]
    kv_layer, kv_layer_gpu = _kv_per_layer(arch, tp, kv_elem)
    kv_token = kv_layer * arch.num_hidden_layers
    kv_token_gpu = kv_layer_gpu * max(stop - start for start, stop in stages)
    kv_batch_gpu = kv_token_gpu * context * batch
    activations = activation_bytes(arch, max_num_batched_tokens, batch, tp, elem)
    total_gpu = weight_per_gpu + kv_batch_gpu + activations

    budget = sequences = reason = None
    if gpu_memory_gb is not None:
        usable = gpu_memory_gb * GB * gpu_memory_utilization
        room = int(usable) - weight_per_gpu - activations
        budget = max(0, room)
        sequences = budget // (kv_token_gpu * context)
        if weight_per_gpu > usable:
            reason = (f"the weights need {gb(weight_per_gpu)} per GPU, more than the "
                      f"{gb(usable)} usable ({gpu_memory_gb:g} GB x {gpu_memory_utilization:g})")
        elif room <= 0:
            reason = (f"the weights ({gb(weight_per_gpu)}) and activations "
                      f"({gb(activations)}) leave no room for the KV cache in {gb(usable)}")
        elif sequences == 0:
            reason = (f"one {context}-token sequence needs {gb(kv_token_gpu * context)} of KV "
                      f"cache per GPU, more than the {gb(budget)} left")

    return MemoryPlan(
        model=arch.name, source=arch.source, dtype=dtype, weight_format=weight_format,
        kv_cache_dtype=kv_cache_dtype, batch=batch, context=context, tp=tp, pp=pp, ep=ep,
        num_gpus=tp * pp * ep, params_total=params_total, params_active=params_active,
        weight_bytes_total=weight_total, weight_bytes_per_gpu=weight_per_gpu,
        kv_bytes_per_token=kv_token, kv_bytes_per_token_per_gpu=kv_token_gpu,
        kv_bytes_per_sequence=kv_token * context, kv_bytes_batch=kv_token * context * batch,
        kv_bytes_batch_per_gpu=kv_batch_gpu, activation_bytes_per_gpu=activations,
        total_bytes_per_gpu=total_gpu, gpu_memory_gb=gpu_memory_gb,
        gpu_memory_utilization=gpu_memory_utilization, kv_budget_bytes=budget,
        max_sequences=sequences, reason=reason)


def stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, stop) of each pipeline stage's layers: an even split whose remainder goes to the
    stages just before the last one, which also holds the LM head (vLLM's get_pp_indices)."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def activation_bytes(arch: Architecture, tokens: int, batch: int, tp: int, elem: int) -> int:
    """The prefill chunk's peak per GPU, as memory_plan's docstring counts it."""
    widths = [arch.intermediate_size] if arch.first_k_dense_replace or not arch.is_moe else []
    if arch.is_moe:
        widths.append((arch.experts_per_token + arch.num_shared_experts)
                      * arch.moe_intermediate_size)
    mlp_tensors = 3 if arch.gated_mlp else 2
    hidden = 2 * tokens * arch.hidden_size * elem
    mlp = mlp_tensors * tokens * (max(widths) // tp) * elem
    logits = min(batch, tokens) * arch.vocab_size * LOGITS_BYTES
    return hidden + mlp + logits


def _kv_per_layer(arch: Architecture, tp: int, elem: int) -> tuple[int, int]:
    """(KV bytes per token of one layer for the whole model, the same on one GPU)."""
    if arch.is_mla:
        latent = (arch.kv_lora_rank + arch.qk_rope_head_dim) * elem
        return latent, latent
    per_head = 2 * arch.head_dim * elem
    return arch.num_key_value_heads * per_head, kv_heads_per_gpu(arch, tp) * per_head


def _bytes(t: Tensor, shape: tuple[int, ...], weight_format: str | None, elem: int,
           ep: int) -> int:
    count = t.count // ep if t.experts == "routed" else t.count
    if t.linear:
        return count * linear_bytes(shape[0], shape[1], weight_format, elem)
    n = 1
    for d in shape:
        n *= d
    return count * n * elem


def _active(arch: Architecture, t: Tensor) -> int:
    if t.experts == "routed":
        return t.numel // t.count * arch.experts_per_token
    return t.numel


def _check_model(model) -> Architecture:
    if isinstance(model, Architecture):
        return model
    return architecture(model)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def normalize_dtype(dtype) -> str:
    """The short name ("bf16", "fp16", "fp32") of any dtype name the engine accepts."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise ValueError(f"dtype={dtype!r} is invalid: allowed are "
                     + ", ".join(repr(name) for name in DTYPE_NAMES))


def normalize_kv_cache_dtype(kv_cache_dtype, dtype: str) -> str:
    """The KV cache's format: "auto" is `dtype` (already normalized), a dtype name its short name,
    "fp8" and "int8" themselves."""
    if kv_cache_dtype == "auto":
        return dtype
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in DTYPE_NAMES:
        return DTYPE_NAMES[kv_cache_dtype]
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_DTYPE_BYTES:
        return kv_cache_dtype
    quantized = [name for name in KV_DTYPE_BYTES if name not in DTYPE_BYTES]
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid: allowed are 'auto' (the "
                     f"dtype, here {dtype!r}), " + ", ".join(repr(name) for name in DTYPE_NAMES)
                     + ", " + ", ".join(repr(name) for name in quantized))


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed are "
                         + ", ".join(repr(a) for a in allowed))


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: use an integer >= 1")


def allowed_tp(arch: Architecture) -> list[int]:
    """Sizes that give every rank whole attention heads, whole KV heads (or one replicated KV
    head when tp is a multiple of them) and an equal share of every MLP width."""
    kv = arch.num_key_value_heads
    widths = [arch.intermediate_size] + ([arch.moe_intermediate_size] if arch.is_moe else [])
    return [tp for tp in range(1, arch.num_attention_heads + 1)
            if arch.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
            and all(w % tp == 0 for w in widths)]


def _check_layout(arch: Architecture, tp: int, pp: int, ep: int) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        _check_positive(name, value)
    if tp not in allowed_tp(arch):
        raise ValueError(f"tp={tp} is invalid for {arch.name} ({arch.num_attention_heads} attention "
                         f"heads, {arch.num_key_value_heads} KV heads): allowed are "
                         + ", ".join(map(str, allowed_tp(arch))))
    if pp > arch.num_hidden_layers:
        raise ValueError(f"pp={pp} is invalid for {arch.name}: allowed are 1 to "
                         f"{arch.num_hidden_layers} (its number of layers)")
    if ep > 1 and not arch.is_moe:
        raise ValueError(f"ep={ep} is invalid for {arch.name}, a dense model: allowed is 1")
    if arch.is_moe and arch.num_routed_experts % ep:
        allowed = [e for e in range(1, arch.num_routed_experts + 1)
                   if arch.num_routed_experts % e == 0]
        raise ValueError(f"ep={ep} is invalid for {arch.name} ({arch.num_routed_experts} routed "
                         "experts): allowed are " + ", ".join(map(str, allowed)))
