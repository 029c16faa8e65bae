"""Every weight tensor of an architecture, with its full shape and the shape one GPU holds.

Tensor parallelism follows vLLM's (and Megatron's) splits:
- column-parallel (q, k, v, gate, up, fc1, MLA's q_b and kv_b): output rows divided by tp; K and V
  keep at least one whole head per GPU, so KV heads are replicated when tp > num_key_value_heads;
- row-parallel (o_proj, down, fc2): input columns divided by tp; their biases are replicated;
- vocabulary-parallel (embedding, LM head): ceil(vocab / tp) rows per GPU;
- replicated: norms, MoE routers, MLA's down-projections (q_a, kv_a), learned position tables.
Expert parallelism divides the routed experts among `ep` groups of GPUs; shared experts stay
with every group.
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.plan.architecture import Architecture


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    gpu_shape: tuple[int, ...]   # the slice one tensor-parallel rank holds
    linear: bool = False         # a projection matrix: stored in the weight format
    experts: str = ""            # "routed" or "shared" for MoE expert weights
    count: int = 1               # identical tensors (one per routed expert)
    stage: str = "layer"         # "first" or "last": outside the layers, on that pipeline stage
    tied_copy: bool = False      # the LM head's own copy of a tied embedding (pipeline only)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.count


def _col(name, out, inp, tp, **kw) -> Tensor:
    return Tensor(name, (out, inp), (out // tp, inp), linear=True, **kw)


def _row(name, out, inp, tp, **kw) -> Tensor:
    return Tensor(name, (out, inp), (out, inp // tp), linear=True, **kw)


def _vec(name, size, split: int = 1, **kw) -> Tensor:
    return Tensor(name, (size,), (size // split,), **kw)


def kv_heads_per_gpu(arch: Architecture, tp: int) -> int:
    """K/V heads on one GPU: divided by tp, at least one (replicated when tp exceeds them)."""
    return max(1, arch.num_key_value_heads // tp)


def _norm(name, size, arch) -> list[Tensor]:
    return [_vec(name, size)] + ([_vec(name + ".bias", size)] if arch.layer_norm else [])


def _attention(arch: Architecture, tp: int) -> list[Tensor]:
    h, heads, d = arch.hidden_size, arch.num_attention_heads, arch.head_dim
    if arch.is_mla:
        qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        return [
            Tensor("q_a_proj", (arch.q_lora_rank, h), (arch.q_lora_rank, h), linear=True),
            _vec("q_a_layernorm", arch.q_lora_rank),
            _col("q_b_proj", heads * qk, arch.q_lora_rank, tp),
            Tensor("kv_a_proj_with_mqa", (arch.kv_lora_rank + arch.qk_rope_head_dim, h),
                   (arch.kv_lora_rank + arch.qk_rope_head_dim, h), linear=True),
            _vec("kv_a_layernorm", arch.kv_lora_rank),
            _col("kv_b_proj", heads * (arch.qk_nope_head_dim + arch.v_head_dim),
                 arch.kv_lora_rank, tp),
            _row("o_proj", h, heads * arch.v_head_dim, tp)]
    kv, kv_gpu = arch.num_key_value_heads * d, kv_heads_per_gpu(arch, tp) * d
    found = [_col("q_proj", heads * d, h, tp),
             Tensor("k_proj", (kv, h), (kv_gpu, h), linear=True),
             Tensor("v_proj", (kv, h), (kv_gpu, h), linear=True),
             _row("o_proj", h, heads * d, tp)]
    if arch.qkv_bias or arch.linear_bias:
        found += [_vec("q_proj.bias", heads * d, tp),
                  Tensor("k_proj.bias", (kv,), (kv_gpu,)), Tensor("v_proj.bias", (kv,), (kv_gpu,))]
    if arch.linear_bias:
        found.append(_vec("o_proj.bias", h))
    return found


def _mlp(arch: Architecture, width: int, tp: int, **kw) -> list[Tensor]:
    h = arch.hidden_size
    if not arch.gated_mlp:
        found = [_col("fc1", width, h, tp, **kw), _row("fc2", h, width, tp, **kw)]
        if arch.linear_bias:
            found += [_vec("fc1.bias", width, tp, **kw), _vec("fc2.bias", h, **kw)]
        return found
    return [_col("gate_proj", width, h, tp, **kw), _col("up_proj", width, h, tp, **kw),
            _row("down_proj", h, width, tp, **kw)]


def _moe(arch: Architecture, tp: int) -> list[Tensor]:
    e, h, w = arch.num_routed_experts, arch.hidden_size, arch.moe_intermediate_size
    found = [Tensor("router", (e, h), (e, h))]
    if arch.is_mla:
        found.append(_vec("router.e_score_correction_bias", e))  # DeepSeek-V3's balancing bias
    found += _mlp(arch, w, tp, experts="routed", count=e)
    if arch.num_shared_experts:
        found += _mlp(arch, arch.num_shared_experts * w, tp, experts="shared")
    return found


def layer_tensors(arch: Architecture, index: int, tp: int) -> list[Tensor]:
    mlp = _moe(arch, tp) if arch.is_moe_layer(index) else _mlp(arch, arch.intermediate_size, tp)
    h = arch.hidden_size
    return (_norm("input_layernorm", h, arch) + _attention(arch, tp)
            + _norm("post_attention_layernorm", h, arch) + mlp)


def outer_tensors(arch: Architecture, tp: int, pp: int) -> list[Tensor]:
    """Embedding and position table (first stage), final norm and LM head (last stage)."""
    h, v = arch.hidden_size, arch.vocab_size
    rows = -(-v // tp)
    found = [Tensor("embed_tokens", (v, h), (rows, h), stage="first")]
    if arch.learned_positions:
        found.append(Tensor("embed_positions", (arch.learned_positions, h),
                            (arch.learned_positions, h), stage="first"))
    found += [Tensor(t.name, t.shape, t.gpu_shape, stage="last")
              for t in _norm("norm", h, arch)]
    # A tied head is the embedding itself, unless the pipeline puts them on different GPUs.
    if not arch.tie_word_embeddings or pp > 1:
        found.append(Tensor("lm_head", (v, h), (rows, h), stage="last",
                            tied_copy=arch.tie_word_embeddings))
    return found
