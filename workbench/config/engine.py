"""EngineConfig: every engine argument, flat, with vLLM's names (`LLM(max_num_seqs=8)`), its
default and its help; checked in groups at construction and never changed afterwards.

    config = EngineConfig(max_num_seqs=8)    # each group checks its fields (groups.py), then the
    config.scheduler_config                  # rules that cross groups run once (resolve.py)
    plan = resolve(config, facts)            # what the engine does, with a reason for each choice
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from workbench.config.groups import (CacheConfig, KernelConfig, ModelConfig, OffloadConfig,
                                     ParallelConfig, SchedulerConfig)
from workbench.config.pruning import prune_config
from workbench.config.quant import quant_config
from workbench.config.resolve import plan_kernels
from workbench.config.speculative import spec_config

# One configuration group per engine part; each EngineConfig field belongs to exactly one.
GROUPS = {"model_config": ModelConfig, "scheduler_config": SchedulerConfig,
          "cache_config": CacheConfig, "parallel_config": ParallelConfig,
          "kernel_config": KernelConfig, "offload_config": OffloadConfig}
METHOD_FIELDS = {"quant_config": ("quantization", "quantization_config"),
                 "prune_config": ("pruning", "pruning_config"),
                 "spec_config": ("speculative_config",)}


def arg(default, help: str):
    """A field with its help text (shown by `python -m workbench ... --help` and in docs)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built with, as the user gave it."""

    # --- model (ModelConfig)
    model: str = arg("smollm2-135m", "a registry name, a Hugging Face folder or a GGUF file")
    dtype: str | torch.dtype = arg("auto", "float32, bfloat16 or float16; auto: bf16 on CUDA "
                                   "and on CPUs with native bf16, else fp32")
    device: str = arg("auto", "cpu, cuda, or auto (cuda when torch sees one)")
    max_model_len: int | None = arg(None, "tokens of prompt and output per sequence; default: "
                                    "the model's context, capped at 1024")
    seed: int = arg(0, "the seed of sampling without a per-request seed")
    num_threads: int | None = arg(None, "CPU threads for torch; default: torch's choice")
    # --- scheduler (SchedulerConfig)
    max_num_seqs: int = arg(8, "sequences decoded together in one step")
    max_num_batched_tokens: int = arg(512, "tokens (prefill chunks + decodes) in one forward pass")
    enable_chunked_prefill: bool = arg(True, "split long prompts over steps within the token budget")
    tpot_slo: float | None = arg(None, "SLO-aware batching: a target decode step time in seconds; "
                                 "prefill chunks shrink while decode steps run over it")
    record_block_tables: bool = arg(False, "copy every block table into each StepRecord")
    # --- paged KV cache (CacheConfig)
    block_size: int = arg(16, "tokens per KV block")
    num_kv_blocks: int | None = arg(None, "the KV pool in blocks; default: max_num_seqs full "
                                    "contexts")
    kv_cache_memory: int | None = arg(None, "the KV pool in bytes (instead of num_kv_blocks)")
    kv_cache_layout: str = arg("paged", "paged, or contiguous (max_model_len reserved per "
                               "sequence)")
    kv_cache_dtype: str | list[str] = arg("auto", "auto (the model's dtype), fp8, int8, int4, or a "
                                          "per-layer plan such as 'auto:0-5,int8:6-29'")
    enable_prefix_caching: bool = arg(False, "reuse the KV blocks of shared prompt prefixes")
    preemption_mode: str = arg("recompute", "recompute, or swap (to CPU memory)")
    swap_space: int | None = arg(None, "bytes of CPU memory for swapped blocks; default: the "
                                 "pool's size")
    kv_cpu_tier_bytes: int = arg(0, "bytes of CPU memory for evicted prefix blocks (a KV tier)")
    kv_disk_tier_bytes: int = arg(0, "bytes of disk for prefix blocks evicted from the CPU tier")
    kv_disk_tier_path: str | None = arg(None, "the disk tier's directory (reused by a later "
                                        "engine)")
    # --- parallelism (ParallelConfig)
    tensor_parallel_size: int = arg(1, "Megatron splits of every layer over worker processes")
    pipeline_parallel_size: int = arg(1, "consecutive layer stages, micro-batches in flight")
    expert_parallel_size: int = arg(1, "the experts of a moe_config model spread over ranks")
    moe_config: dict | None = arg(None, "{'num_experts': E, 'top_k': k}: the MLPs cut into "
                                  "experts")
    sequence_parallel: bool = arg(False, "tokens split over the tensor-parallel ranks between "
                                  "blocks (Megatron SP)")
    # --- kernels and compilation (KernelConfig)
    attention_backend: str = arg("auto", "torch, cpu (the C++ paged decode kernel), triton, or "
                                 "auto")
    compile: bool = arg(False, "torch.compile the forward, attention left opaque")
    freeze_weights: bool = arg(False, "with compile: weights compiled in as constants, prepacked "
                               "for oneDNN on CPU (a second copy of the weights)")
    batch_invariant: bool = arg(False, "results independent of what else shares the batch "
                                "(exact, slower)")
    cpu_gemv: bool | None = arg(None, "the hand-written CPU matmuls for few rows; None: where "
                                "they run")
    fused_decode: bool | None = arg(None, "a decode step as one C++ call; None: where it runs")
    cuda_graphs: bool = arg(False, "decode steps replayed from CUDA graphs (CUDA, Triton "
                            "attention)")
    # --- weight offload (OffloadConfig)
    cpu_offload_gb: float = arg(0, "GiB of decoder layers kept in the slow tier, the last ones "
                                "first")
    weight_offload: str = arg("auto", "the slow tier: cpu (pinned memory), disk (files), or auto")
    offload_dir: str | None = arg(None, "where the disk tier writes its files; default: a "
                                  "temporary directory")
    offload_keep_page_cache: bool = arg(False, "let disk reads hit the OS page cache")
    # --- quantization, pruning, speculative decoding (QuantConfig, PruneConfig, SpeculativeConfig)
    quantization: str | None = arg(None, "int8, int4, gptq, awq, smoothquant or mixed")
    quantization_config: dict | None = arg(None, "QuantConfig options: group_size, "
                                           "quantize_lm_head, ...")
    pruning: str | None = arg(None, "magnitude, wanda, sparsegpt, channels, layers or heads "
                              "(before quantization)")
    pruning_config: dict | None = arg(None, "PruneConfig options: sparsity, pattern ('2:4'), "
                                      "ratio, ...")
    speculative_config: dict | None = arg(None, "{'method': ..., 'num_speculative_tokens': k, "
                                          "...}")

    def __post_init__(self) -> None:
        for name, group in GROUPS.items():
            object.__setattr__(self, name, group(**{f.name: getattr(self, f.name)
                                                    for f in fields(group)}))
        object.__setattr__(self, "quant_config",
                           quant_config(self.quantization, self.quantization_config))
        object.__setattr__(self, "prune_config", prune_config(self.pruning, self.pruning_config))
        object.__setattr__(self, "spec_config", spec_config(self.speculative_config))
        plan_kernels(self)           # the rules that cross groups and need no model: fail now

    @property
    def world_size(self) -> int:
        return self.parallel_config.world_size

    @staticmethod
    def help(name: str) -> str:
        return EngineConfig.__dataclass_fields__[name].metadata["help"]
