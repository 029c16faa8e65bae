"""What the engine decided from its configuration, the machine and the model, and why: frozen
records that resolve.py fills and `LLM.describe()` prints."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KernelPlan:
    """How this machine runs the model: device and dtypes, and which implementations."""
    device: torch.device
    dtype: torch.dtype                  # activations (and weights unless weight_dtype differs)
    weight_dtype: torch.dtype           # bf16 weights under fp32 activations on CPUs without bf16
    attention_backend: str              # "torch", "cpu" or "triton"
    cpu_gemv: bool                      # the hand-written CPU matmuls for few rows
    fused_decode: bool                  # decode steps as one C++ call
    offload_tier: str                   # where offloaded weights live: "cpu" or "disk"
    reasons: dict[str, str] = field(default_factory=dict)   # decision -> why, when not obvious


@dataclass(frozen=True)
class ModelFacts:
    """What the resolver needs to know of the model (its config.json, before any weight loads)."""
    max_position_embeddings: int
    kv_bytes_per_token: int             # in the plan's dtype and KV format, every layer together
    sliding_window: int | None = None   # a window the engine does not apply: contexts stay within it


@dataclass(frozen=True)
class EnginePlan:
    """Every decision the engine runs by. `config` is the user's, unchanged."""
    config: object                      # EngineConfig
    kernels: KernelPlan
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    num_cpu_blocks: int                 # swap space, in blocks
    num_cpu_tier_blocks: int            # the CPU KV tier, in blocks
    micro_batch_max_num_seqs: int       # max_num_seqs of each pipeline micro-batch's scheduler
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.config.block_size
