"""The engine's arguments in groups, as vLLM groups its configuration: each group holds related
fields and checks its own, with errors that name the field, the value and what is allowed. The
rules that cross groups are in resolve.py; the fields' defaults and help are in engine.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.config.checks import auto_bool, boolean, choice, path_or_none, positive_int
from workbench.config.kv_plan import is_mixed, layer_kv_dtypes
from workbench.config.platform import DEVICES, check_dtype_name

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_LAYOUTS = ("paged", "contiguous")
WEIGHT_OFFLOAD_TIERS = ("auto", "cpu", "disk")


@dataclass(frozen=True)
class ModelConfig:
    """Which model, in which dtype, on which device, for how long a context."""
    model: str
    dtype: str | torch.dtype
    device: str
    max_model_len: int | None
    seed: int
    num_threads: int | None

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        choice("device", self.device, DEVICES)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len, 2)
        if self.num_threads is not None:
            positive_int("num_threads", self.num_threads)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an integer")


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold: sequences, tokens, chunked prompts, a target step time."""
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    tpot_slo: float | None
    record_block_tables: bool

    def __post_init__(self) -> None:
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={self.enable_chunked_prefill!r} is invalid: "
                             "it must be a bool")
        if self.tpot_slo is not None and (isinstance(self.tpot_slo, bool)
                                          or not isinstance(self.tpot_slo, (int, float))
                                          or not self.tpot_slo > 0):
            raise ValueError(f"tpot_slo={self.tpot_slo!r} is invalid: it must be a number of "
                             "seconds > 0, or None")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, pool size, row formats, prefix caching, swap and tiers."""
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory: int | None
    kv_cache_layout: str
    kv_cache_dtype: str | list[str]
    enable_prefix_caching: bool
    preemption_mode: str
    swap_space: int | None
    kv_cpu_tier_bytes: int
    kv_disk_tier_bytes: int
    kv_disk_tier_path: str | None

    def __post_init__(self) -> None:
        layer_kv_dtypes(self.kv_cache_dtype)      # names and ranges; the layer count comes later
        positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("num_kv_blocks and kv_cache_memory are both set: give one of them")
        if self.num_kv_blocks is not None:
            positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory is not None:
            positive_int("kv_cache_memory", self.kv_cache_memory)
        if self.swap_space is not None:
            positive_int("swap_space", self.swap_space, 0)
        choice("kv_cache_layout", self.kv_cache_layout, KV_CACHE_LAYOUTS)
        choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} is invalid: "
                             "it must be a bool")
        self._check_tiers()

    @property
    def kv_tiers(self) -> bool:
        return bool(self.kv_cpu_tier_bytes or self.kv_disk_tier_bytes)

    def tiers_invalid(self, why: str) -> ValueError:
        return ValueError(f"kv_cpu_tier_bytes={self.kv_cpu_tier_bytes}, kv_disk_tier_bytes="
                          f"{self.kv_disk_tier_bytes} is invalid here: {why}")

    def _check_tiers(self) -> None:
        positive_int("kv_cpu_tier_bytes", self.kv_cpu_tier_bytes, 0)
        positive_int("kv_disk_tier_bytes", self.kv_disk_tier_bytes, 0)
        path = self.kv_disk_tier_path
        path_or_none("kv_disk_tier_path", path)
        if self.kv_disk_tier_bytes and path is None:
            raise ValueError(f"kv_disk_tier_path=None is invalid with kv_disk_tier_bytes="
                             f"{self.kv_disk_tier_bytes}: the disk tier needs a directory")
        if path is not None and not self.kv_disk_tier_bytes:
            raise ValueError(f"kv_disk_tier_path={str(path)!r} is set but kv_disk_tier_bytes is 0: "
                             "give the disk tier a size in bytes, or leave the path None")
        if not self.kv_tiers:
            return
        if not self.enable_prefix_caching:
            raise self.tiers_invalid("tiers keep evicted prefix-cache blocks, and "
                                     "enable_prefix_caching=False; set enable_prefix_caching=True")
        if is_mixed(self.kv_cache_dtype):
            raise self.tiers_invalid(
                f"kv_cache_dtype={self.kv_cache_dtype!r} gives layers different row formats, and "
                "a tier stores a block of every layer in one; use one format")


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes hold the model, and how it is split between them."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel_size: int
    moe_config: dict | None
    sequence_parallel: bool

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            positive_int(name, getattr(self, name))
        if self.moe_config is not None:
            if not isinstance(self.moe_config, dict) or set(self.moe_config) - {"num_experts",
                                                                                 "top_k"}:
                raise ValueError(f"moe_config={self.moe_config!r} is invalid: it is a dict with "
                                 "keys 'num_experts' and 'top_k'")
            for key in ("num_experts", "top_k"):
                positive_int(f"moe_config['{key}']", self.moe_config.get(key))
        boolean("sequence_parallel", self.sequence_parallel)
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("sequence_parallel=True is invalid with tensor_parallel_size=1: it "
                             "splits the tokens over the tensor-parallel ranks; set "
                             "tensor_parallel_size > 1 or sequence_parallel=False")
        if self.expert_parallel_size > 1:
            if self.moe_config is None:
                raise ValueError(f"expert_parallel_size={self.expert_parallel_size} is invalid "
                                 "without experts: set moe_config={'num_experts': ..., 'top_k': ...}")
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
                raise ValueError("expert_parallel_size > 1 is invalid together with tensor or "
                                 "pipeline parallelism here: expert parallelism replicates the "
                                 "rest of the model")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.expert_parallel_size


@dataclass(frozen=True)
class KernelConfig:
    """Which implementations run the model: attention backend, compilation, the CPU loops, the
    fused decode step, CUDA graphs, batch-invariant execution (vLLM's CompilationConfig)."""
    attention_backend: str
    compile: bool
    freeze_weights: bool
    batch_invariant: bool
    cpu_gemv: bool | None
    fused_decode: bool | None
    cuda_graphs: bool

    def __post_init__(self) -> None:
        choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        for name in ("compile", "freeze_weights", "batch_invariant", "cuda_graphs"):
            boolean(name, getattr(self, name))
        auto_bool("cpu_gemv", self.cpu_gemv)
        auto_bool("fused_decode", self.fused_decode)
        if self.freeze_weights and not self.compile:
            raise ValueError("freeze_weights=True is invalid with compile=False: freezing is a step "
                             "of compilation; set compile=True")
        if self.batch_invariant and self.compile:
            raise ValueError("compile=True is invalid with batch_invariant=True: compiled kernels "
                             "may sum in another order for another token count; set compile=False")


@dataclass(frozen=True)
class OffloadConfig:
    """Weight offload: GiB of decoder layers kept in a slow tier, and which tier."""
    cpu_offload_gb: float
    weight_offload: str
    offload_dir: str | None
    offload_keep_page_cache: bool

    def __post_init__(self) -> None:
        gb = self.cpu_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 <= gb < float("inf"):
            raise ValueError(f"cpu_offload_gb={gb!r} is invalid: it must be a number of GiB >= 0")
        choice("weight_offload", self.weight_offload, WEIGHT_OFFLOAD_TIERS)
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            raise ValueError(f"offload_dir={self.offload_dir!r} is invalid: it must be a directory "
                             "path (str) or None")
        if not isinstance(self.offload_keep_page_cache, bool):
            raise ValueError(f"offload_keep_page_cache={self.offload_keep_page_cache!r} is "
                             "invalid: allowed are True, False")

    @property
    def enabled(self) -> bool:
        return self.cpu_offload_gb > 0
