"""EngineConfig: every engine knob in one dataclass, checked once when the engine is built.

Field names follow vLLM's engine arguments (`max_model_len`, `max_num_seqs`,
`max_num_batched_tokens`, ...) so that a learner can move between the two. Later capabilities add
their fields here (block_size, enable_prefix_caching, tensor_parallel_size, ...), never elsewhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_LAYOUTS = ("paged", "contiguous")
WEIGHT_OFFLOAD_TIERS = ("auto", "cpu", "disk")
# The default KV budget holds max_num_seqs full contexts, so the default context is capped:
# SmolLM2's full 8192 tokens x 8 sequences would take 1.5 GB in bf16.
DEFAULT_MAX_MODEL_LEN = 1024


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX-512 BF16, which AMX machines also have, or
    ARM's BF16 extension), where bf16 is the fast path; elsewhere torch emulates bf16 arithmetic
    several times slower than fp32. WORKBENCH_ISA=avx2 makes an AVX-512 machine answer as an AVX2
    one would."""
    import platform
    from kernels.cpu import best_isa, cpu_flags
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in cpu_flags()
    return best_isa() == "avx512bf16"


def onednn_bf16_prepack_reason() -> str | None:
    """Why oneDNN cannot prepack bf16 weights on this CPU (None if it can): torch's
    mkldnn_reorder_linear_weight needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for bf16."""
    import platform
    from kernels.cpu import best_isa, cpu_flags
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = cpu_flags()
    if best_isa().startswith("avx512") or "avx_ne_convert" in flags:
        return None
    return ("oneDNN prepacks bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or "
            "AVX-NE-CONVERT, and this one runs the " + best_isa() + " build")


def resolve_device(device: str) -> torch.device:
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is invalid: allowed values are {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid here: torch sees no CUDA device "
                         "(use device='cpu' or 'auto')")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and on CPUs with native bf16, fp32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is invalid: allowed are float32, bfloat16, float16")
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"dtype={dtype!r} is invalid: allowed values are 'auto', "
                         + ", ".join(repr(k) for k in DTYPES))
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError("dtype='float16' is invalid on CPU: CPU kernels for fp16 are slow or "
                         "missing; use 'float32' or 'bfloat16'")
    return resolved


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")


@dataclass
class EngineConfig:
    """What the engine is built with. `device` and `dtype` are resolved to torch objects here."""

    model: str = "smollm2-135m"
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None     # None: the model's context, capped at DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = 8                # sequences decoded together in one step
    max_num_batched_tokens: int = 512    # tokens (prefill chunks + decodes) in one forward pass
    attention_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None       # CPU threads for torch; None leaves torch's choice
    compile: bool = False                # torch.compile the forward, attention opaque (models/compile.py)
    # With compile=True: Inductor's freezing, the weights compiled in as constants and, on CPU,
    # prepacked for oneDNN once instead of reordered on every matmul call. Costs a second copy of
    # the weights in memory (the model keeps its own for the eager paths).
    freeze_weights: bool = False
    # Results that do not depend on which other sequences share a step (vLLM's
    # VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference): the CPU kernels' loops take
    # every row count with one sum order per row, torch's matmuls see a fixed minimum number of
    # rows, attention runs each sequence on its own, and the fused decode step, whose norms sum in
    # another order than the steps that carry a prefill, stays off (models/batch_invariant.py).
    batch_invariant: bool = False
    # Hand-written matmuls for steps of few rows (kernels/cpu; 1-2 rows in bf16, up to 16-64 in
    # fp32): bf16 and fp32 layers, and INT8 / INT4 quantized ones. None (the
    # default): on where they can run (CPU, one process, not freeze_weights);
    # True: insist; False: torch's kernels.
    cpu_gemv: bool | None = None
    # A decode step or a speculative verification as one C++ call, every layer inside
    # (models/fused_decode.py): bf16 or fp32 activations over bf16, fp32, INT8 or INT4 weights, with the GEMV kernels (cpu_gemv) and
    # attention_backend="cpu"; other steps as before.
    # None (the default): on where all of that holds; True: insist; False: off.
    fused_decode: bool | None = None
    # Decode steps replayed from CUDA graphs captured at start for batch sizes 1, 2, 4, 8, 16, ...
    # up to max_num_seqs (models/cuda_graphs.py): device "cuda", the Triton attention backend.
    cuda_graphs: bool = False
    # The paged KV cache.
    block_size: int = 16                 # tokens per KV block
    num_kv_blocks: int | None = None     # size of the pool in blocks, or
    kv_cache_memory: int | None = None   # its size in bytes; neither: max_num_seqs full contexts
    kv_cache_layout: str = "paged"       # "contiguous" reserves max_model_len per sequence
    enable_prefix_caching: bool = False
    # Tiers below the pool for evicted prefix blocks (kv/tiers.py): bytes of CPU memory, bytes of
    # disk, and the disk tier's directory (a later engine with the same path reuses its files).
    kv_cpu_tier_bytes: int = 0
    kv_disk_tier_bytes: int = 0
    kv_disk_tier_path: str | None = None
    enable_chunked_prefill: bool = True
    # SLO-aware batching: a target decode step time in seconds (the TPOT a running request feels).
    # Steps that carry decodes and run over it halve the tokens prefill chunks may take; steps
    # well under it give some back (scheduler.py). None: a fixed budget, max_num_batched_tokens.
    tpot_slo: float | None = None
    preemption_mode: str = "recompute"   # or "swap" (to CPU memory)
    swap_space: int | None = None        # bytes of CPU memory for swapped blocks (default: pool size)
    record_block_tables: bool = False    # copy every sequence's block table into each StepRecord
    # Quantization (workbench/quant/).
    quantization: str | None = None      # None, "int8", "int4", "gptq", "awq", "smoothquant", "mixed"
    quantization_config: dict | None = None   # QuantConfig fields: group_size, quantize_lm_head...
    # "auto" (the model's dtype), "fp8" (e4m3), "int8", "int4", or a per-layer plan: a list of those
    # names, one per layer, or ranges such as "auto:0-5,int8:6-29" (quant/kv_plan.py)
    kv_cache_dtype: str | list[str] = "auto"
    # Pruning (workbench/compress/), applied before quantization when both are set.
    pruning: str | None = None           # None, "magnitude", "wanda", "sparsegpt"
    pruning_config: dict | None = None   # PruneConfig fields: sparsity, pattern ("2:4"), ...
    # Speculative decoding (workbench/spec/): {"method": ..., "num_speculative_tokens": k, ...}.
    speculative_config: dict | None = None
    # Parallelism (workbench/parallel/): worker processes on torch.distributed.
    tensor_parallel_size: int = 1        # Megatron splits of every layer, one all-reduce per half
    pipeline_parallel_size: int = 1      # consecutive layer stages, micro-batches in flight
    expert_parallel_size: int = 1        # experts of a moe_config model spread over ranks
    moe_config: dict | None = None       # {"num_experts": E, "top_k": k}: the MLPs cut into experts
    sequence_parallel: bool = False      # tokens split over the TP ranks between blocks (Megatron SP)
    # Weight offload (workbench/offload/): whole decoder layers, from the last one backwards.
    cpu_offload_gb: float = 0            # GiB of layer weights kept in the slow tier (vLLM's knob)
    weight_offload: str = "auto"         # the slow tier: "cpu" (pinned memory), "disk" (files)
    offload_dir: str | None = None       # where "disk" writes its files; None: a temporary dir
    offload_keep_page_cache: bool = False  # True: disk reads may hit the OS page cache

    def __post_init__(self) -> None:
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len, 2)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.quantization is not None:
            from .quant.apply import QuantConfig
            self.quant_config = QuantConfig.from_args(self.quantization, self.quantization_config)
        elif self.quantization_config:
            raise ValueError("quantization_config is set but quantization is None: choose a method")
        else:
            self.quant_config = None
        if self.pruning is not None:
            from .compress.pruning import PruneConfig
            self.prune_config = PruneConfig.from_args(self.pruning, self.pruning_config)
        elif self.pruning_config:
            raise ValueError("pruning_config is set but pruning is None: choose a method")
        else:
            self.prune_config = None
        self.spec_config = None
        if self.speculative_config is not None:
            from .spec.config import SpeculativeConfig
            self.spec_config = SpeculativeConfig.from_dict(self.speculative_config)
        self._check_parallel()
        self._check_kv_plan()
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r} is invalid: allowed are True, False")
        if not isinstance(self.freeze_weights, bool):
            raise ValueError(f"freeze_weights={self.freeze_weights!r} is invalid: allowed are True, "
                             "False")
        if self.freeze_weights and not self.compile:
            raise ValueError("freeze_weights=True is invalid with compile=False: freezing is a step "
                             "of compilation; set compile=True")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant={self.batch_invariant!r} is invalid: allowed are "
                             "True, False")
        if self.tpot_slo is not None:
            if isinstance(self.tpot_slo, bool) or not isinstance(self.tpot_slo, (int, float)) \
                    or not self.tpot_slo > 0:
                raise ValueError(f"tpot_slo={self.tpot_slo!r} is invalid: it must be a number of "
                                 "seconds > 0, or None")
            if self.batch_invariant:
                raise ValueError("tpot_slo is invalid with batch_invariant=True: its prefill "
                                 "chunks would depend on timing, and batch-invariant chunks "
                                 "must not")
        if self.batch_invariant and self.compile:
            raise ValueError("compile=True is invalid with batch_invariant=True: compiled kernels "
                             "may sum in another order for another token count; set compile=False")
        if self.freeze_weights and self.torch_device.type == "cpu" \
                and self.torch_dtype == torch.bfloat16:
            why_not = onednn_bf16_prepack_reason()
            if why_not:
                raise ValueError(f"freeze_weights=True is invalid here for bf16: {why_not}; use "
                                 "dtype='float32' or freeze_weights=False")
        if self.compile and self.world_size > 1:
            raise ValueError(f"compile=True is invalid with {self.world_size} worker processes: "
                             "compilation is for a single-process engine (tensor_parallel_size, "
                             "pipeline_parallel_size and expert_parallel_size must be 1)")
        self._resolve_attention_backend()
        self._check_kv_backend()
        self._check_cpu_gemv()
        self._resolve_weight_dtype()
        self._check_fused_decode()
        self._check_cuda_graphs()
        self._check_weight_offload()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an integer")
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("num_kv_blocks and kv_cache_memory are both set: give one of them")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory is not None:
            _positive_int("kv_cache_memory", self.kv_cache_memory)
        if self.swap_space is not None:
            _positive_int("swap_space", self.swap_space, 0)
        for name, allowed in (("kv_cache_layout", KV_CACHE_LAYOUTS),
                              ("preemption_mode", PREEMPTION_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: allowed values are "
                                 + ", ".join(allowed))
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be a bool")
        self._check_kv_tiers()

    @property
    def kv_tiers(self) -> bool:
        return bool(self.kv_cpu_tier_bytes or self.kv_disk_tier_bytes)

    def _check_kv_tiers(self) -> None:
        from .quant.kv_plan import is_mixed
        _positive_int("kv_cpu_tier_bytes", self.kv_cpu_tier_bytes, 0)
        _positive_int("kv_disk_tier_bytes", self.kv_disk_tier_bytes, 0)
        path = self.kv_disk_tier_path
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"kv_disk_tier_path={path!r} is invalid: it must be a directory path "
                             "(str) or None")
        if self.kv_disk_tier_bytes and path is None:
            raise ValueError(f"kv_disk_tier_path=None is invalid with kv_disk_tier_bytes="
                             f"{self.kv_disk_tier_bytes}: the disk tier needs a directory")
        if path is not None and not self.kv_disk_tier_bytes:
            raise ValueError(f"kv_disk_tier_path={str(path)!r} is set but kv_disk_tier_bytes is 0: "
                             "give the disk tier a size in bytes, or leave the path None")
        if not self.kv_tiers:
            return
        why_not = None
        if not self.enable_prefix_caching:
            why_not = ("tiers keep evicted prefix-cache blocks, and enable_prefix_caching=False; "
                       "set enable_prefix_caching=True")
        elif self.world_size > 1:
            why_not = "tiers are for a single-process engine; set the parallel sizes to 1"
        elif is_mixed(self.kv_cache_dtype):
            why_not = (f"kv_cache_dtype={self.kv_cache_dtype!r} gives layers different row "
                       "formats, and a tier stores a block of every layer in one; use one format")
        elif self.spec_config is not None and self.spec_config.method != "ngram":
            why_not = (f"speculative_config['method']={self.spec_config.method!r} keeps a draft "
                       "cache that loaded blocks would not fill; use 'ngram' or no speculation")
        if why_not:
            raise ValueError(f"kv_cpu_tier_bytes={self.kv_cpu_tier_bytes}, kv_disk_tier_bytes="
                             f"{self.kv_disk_tier_bytes} is invalid here: {why_not}")

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.moe_config is not None:
            if not isinstance(self.moe_config, dict) or set(self.moe_config) - {"num_experts",
                                                                                 "top_k"}:
                raise ValueError(f"moe_config={self.moe_config!r} is invalid: it is a dict with "
                                 "keys 'num_experts' and 'top_k'")
            for key in ("num_experts", "top_k"):
                _positive_int(f"moe_config['{key}']", self.moe_config.get(key))
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} is invalid: allowed "
                             "are True, False")
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
        if self.world_size > 1:
            for name, value in (("speculative_config", self.speculative_config),
                                ("quantization", self.quantization),
                                ("pruning", self.pruning)):
                if value is not None:
                    raise ValueError(f"{name}={value!r} is invalid with parallel workers: the "
                                     "parallel engine runs unquantized, unpruned models without "
                                     "speculation; set it to None or use one process")

    def _check_kv_plan(self) -> None:
        """A single format, or a per-layer plan; the plan's length is checked with the model."""
        from .quant.kv_plan import layer_kv_dtypes
        if layer_kv_dtypes(self.kv_cache_dtype) is None:
            return
        for name, value in (("speculative_config", self.speculative_config),
                            ("tensor_parallel_size", self.tensor_parallel_size),
                            ("pipeline_parallel_size", self.pipeline_parallel_size),
                            ("expert_parallel_size", self.expert_parallel_size)):
            if value not in (None, 1):
                raise ValueError(f"{name}={value!r} is invalid with a per-layer kv_cache_dtype "
                                 f"plan ({self.kv_cache_dtype!r}): drafters and parallel workers "
                                 "take one KV format; use a single format or a single process "
                                 "without speculation")

    def _check_kv_backend(self) -> None:
        """The Triton kernels read bf16, FP8 or INT8 rows of one format for all layers: INT4 rows
        and per-layer plans go to the torch backend ("auto" on CUDA) or are refused ("triton")."""
        from .quant.kv_plan import is_mixed, plan_formats
        why_not = None
        if "int4" in plan_formats(self.kv_cache_dtype):
            why_not = "the Triton kernels do not read INT4 rows"
        elif is_mixed(self.kv_cache_dtype):
            why_not = "the Triton kernels read one KV format for all layers"
        if why_not is None:
            return
        if self.attention_backend == "triton":
            raise ValueError(f"attention_backend='triton' is invalid with kv_cache_dtype="
                             f"{self.kv_cache_dtype!r}: {why_not}; use 'torch' or 'auto'")
        if self.attention_backend == "auto" and self.torch_device.type == "cuda":
            self.attention_backend = "torch"
            self.attention_reason = why_not

    def _check_cpu_gemv(self) -> None:
        """Resolve cpu_gemv: None becomes whether the kernels can run; True must be able to."""
        if self.cpu_gemv is not None and not isinstance(self.cpu_gemv, bool):
            raise ValueError(f"cpu_gemv={self.cpu_gemv!r} is invalid: allowed are None (auto), "
                             "True, False")
        why_not = None
        if self.torch_device.type != "cpu":
            why_not = f"they are CPU kernels and device is {self.torch_device.type}"
        elif self.torch_dtype not in (torch.bfloat16, torch.float32):
            why_not = f"they take bf16 or fp32 activations and dtype is {self.torch_dtype}"
        elif self.world_size > 1:
            why_not = "the parallel workers keep torch's kernels"
        elif self.freeze_weights and self.cpu_gemv is None:
            why_not = ("freeze_weights=True prepacks the matmuls for oneDNN, which the loops' "
                       "operators would hide from the compiler")
        if why_not is None and self.cpu_gemv is not False:
            from kernels.cpu import available
            ok, reason = available()
            why_not = None if ok else reason
        if self.cpu_gemv is True and why_not is not None:
            raise ValueError(f"cpu_gemv=True is invalid here: {why_not}; use None (auto) or False")
        self.cpu_gemv_reason = why_not or ("switched off" if self.cpu_gemv is False else "")
        self.use_cpu_gemv = self.cpu_gemv is not False and why_not is None

    def _resolve_weight_dtype(self) -> None:
        """dtype="auto" on a CPU without native bf16: fp32 activations over the GEMV layers'
        weights rounded to bf16 (models/cpu_gemv.py: store_weights_bf16). Decode reads half the
        bytes; the loops widen bf16 in registers (`python -m workbench.bench speed`: rows "engine
        default" and "engine fp32 weights")."""
        self.weight_dtype = self.torch_dtype
        if self.dtype == "auto" and self.use_cpu_gemv and self.torch_dtype == torch.float32:
            self.weight_dtype = torch.bfloat16

    def _resolve_attention_backend(self) -> None:
        """"auto" on CPU is the C++ paged decode kernel where kernels/cpu builds, else torch's;
        on CUDA the Triton kernels (attention/backends.py)."""
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is invalid: allowed "
                             f"values are {', '.join(ATTENTION_BACKENDS)}")
        self.attention_reason = ""
        if self.attention_backend == "auto" and self.torch_device.type == "cpu" \
                and self.world_size == 1:
            from kernels.cpu import available
            ok, reason = available()
            self.attention_backend = "cpu" if ok else "torch"
            self.attention_reason = "" if ok else f"no C++ decode kernel: {reason}"

    def _check_fused_decode(self) -> None:
        if self.fused_decode is not None and not isinstance(self.fused_decode, bool):
            raise ValueError(f"fused_decode={self.fused_decode!r} is invalid: allowed are None "
                             "(auto), True, False")
        why_not = None
        if not self.use_cpu_gemv:
            why_not = f"the GEMV kernels it runs are off (cpu_gemv: {self.cpu_gemv_reason})"
        elif self.batch_invariant:
            why_not = ("batch_invariant=True: its norms sum in another order than the layer-by-"
                       "layer steps that carry a prefill, so a sequence's numbers would depend on "
                       "what shares its step")
        elif self.attention_backend != "cpu":
            why_not = (f"it runs the C++ paged attention, and attention_backend="
                       f"{self.attention_backend!r}; use attention_backend='cpu'")
        elif self.quantization not in (None, "int8", "int4", "gptq", "awq", "mixed") \
                or self.moe_config is not None:
            why_not = (f"it takes bf16, INT8 or INT4 weight-only layers without experts, and "
                       f"quantization={self.quantization!r}, moe_config={self.moe_config!r}; "
                       "use quantization None, 'int8', 'int4', 'gptq' or 'awq' and moe_config=None")
        elif self.kv_cache_dtype != "auto":
            why_not = (f"it reads a cache in the model's dtype, and kv_cache_dtype="
                       f"{self.kv_cache_dtype!r}; use 'auto'")
        if self.fused_decode is True and why_not:
            raise ValueError(f"fused_decode=True is invalid here: {why_not}")
        # The engine may still turn an auto fused step off for a model it cannot take
        # (models/fused_decode.py: fused_decode_unsupported).
        self.fused_decode_reason = why_not or ("switched off" if self.fused_decode is False else "")
        self.use_fused_decode = self.fused_decode is not False and why_not is None

    def _check_cuda_graphs(self) -> None:
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r} is invalid: allowed are True, False")
        if not self.cuda_graphs:
            return
        why_not = None
        if self.torch_device.type != "cuda":
            why_not = (f"graphs record GPU kernel launches, and device is "
                       f"{self.torch_device.type!r}; use device='cuda'")
        elif self.attention_backend not in ("auto", "triton"):
            why_not = (f"the captured steps run the Triton kernels, and attention_backend="
                       f"{self.attention_backend!r}; use 'auto' or 'triton'")
        elif self.compile:
            why_not = "graphs capture the eager forward here, and compile=True; set compile=False"
        elif self.world_size > 1:
            why_not = "graphs are for a single-process engine; set the parallel sizes to 1"
        if why_not:
            raise ValueError(f"cuda_graphs=True is invalid here: {why_not}")

    def _check_weight_offload(self) -> None:
        """Resolve weight_offload ("auto": "cpu" on CUDA, "disk" on CPU) and refuse the paths that
        read every layer's weights at once or cache their addresses (workbench/offload/)."""
        gb = self.cpu_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 <= gb < float("inf"):
            raise ValueError(f"cpu_offload_gb={gb!r} is invalid: it must be a number of GiB >= 0")
        if self.weight_offload not in WEIGHT_OFFLOAD_TIERS:
            raise ValueError(f"weight_offload={self.weight_offload!r} is invalid: allowed values "
                             "are " + ", ".join(WEIGHT_OFFLOAD_TIERS))
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            raise ValueError(f"offload_dir={self.offload_dir!r} is invalid: it must be a directory "
                             "path (str) or None")
        if not isinstance(self.offload_keep_page_cache, bool):
            raise ValueError(f"offload_keep_page_cache={self.offload_keep_page_cache!r} is "
                             "invalid: allowed are True, False")
        self.offload_tier = self.weight_offload
        if self.weight_offload == "auto":
            self.offload_tier = "cpu" if self.torch_device.type == "cuda" else "disk"
        self.use_weight_offload = gb > 0
        if not self.use_weight_offload:
            return
        why_not = None
        if self.world_size > 1:
            why_not = "the parallel workers load their own shards; set the parallel sizes to 1"
        elif self.compile:
            why_not = ("the compiled forward does not call the layers' hooks that bring their "
                       "weights in; set compile=False")
        elif self.cuda_graphs:
            why_not = ("a graph replays the addresses it captured, and offloaded layers read a "
                       "different buffer each step; set cuda_graphs=False")
        elif self.fused_decode is True:
            why_not = ("the fused step reads every layer's weights in one call, and only two "
                       "offloaded layers fit the resident buffers; set fused_decode=None or False")
        elif self.quantization is not None:
            why_not = (f"quantization={self.quantization!r} keeps packed codes and caches their "
                       "aten layout per layer, which the swap does not move; use None")
        elif self.prune_config is not None and getattr(self.prune_config, "semi_structured",
                                                       False):
            why_not = ("semi-structured weights are sparse tensor subclasses; set "
                       "pruning_config['semi_structured']=False")
        elif self.speculative_config is not None:
            why_not = ("a quantized_self drafter copies the model, whose offloaded layers hold "
                       "empty parameters, and a draft model would need an offload of its own; "
                       "use None")
        if why_not:
            raise ValueError(f"cpu_offload_gb={gb!r} is invalid here: {why_not}")
        if self.use_fused_decode:
            # auto fused step off: it would need every offloaded layer resident at once
            self.use_fused_decode = False
            self.fused_decode_reason = ("weight offload brings layers in one at a time, and the "
                                        "fused step reads all of them in one call")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.expert_parallel_size

    def finalize(self, model_max_len: int, kv_bytes_per_token: int) -> None:
        """Clamp to the model's context and size the KV pool, once both are known."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, DEFAULT_MAX_MODEL_LEN)
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid: the model's context "
                             f"is {model_max_len} tokens")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunked prefill a whole prompt must fit in one step.
            self.max_num_batched_tokens = self.max_model_len
        block_bytes = kv_bytes_per_token * self.block_size
        if self.kv_cache_memory is not None:
            self.num_kv_blocks = self.kv_cache_memory // block_bytes
            if self.num_kv_blocks < 1:
                raise ValueError(f"kv_cache_memory={self.kv_cache_memory} is invalid: one block of "
                                 f"{self.block_size} tokens needs {block_bytes} bytes")
        elif self.num_kv_blocks is None:
            self.num_kv_blocks = self.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.swap_space is None:
            self.num_cpu_blocks = self.num_kv_blocks if self.preemption_mode == "swap" else 0
        else:
            self.num_cpu_blocks = self.swap_space // block_bytes
        self.num_cpu_tier_blocks = self.kv_cpu_tier_bytes // block_bytes
        for name in ("kv_cpu_tier_bytes", "kv_disk_tier_bytes"):
            if 0 < getattr(self, name) < block_bytes:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: one block of "
                                 f"{self.block_size} tokens needs {block_bytes} bytes; give at "
                                 "least that, or 0 for no tier")
