"""The engine's configuration: what the user asks for (EngineConfig, flat, with vLLM's argument
names), its groups, each checking its own fields (groups.py; quant.py, pruning.py and
speculative.py for the methods' options), and the plan resolved from it once, every decision with
its reason (resolve.py, plan.py).

    config = EngineConfig(max_num_seqs=8, quantization="int4")
    kernels = plan_kernels(config)                   # what runs where on this machine
    plan = resolve(config, kernels, facts)           # + context length and KV pool for the model
"""
from workbench.config.engine import GROUPS, METHOD_FIELDS, EngineConfig
from workbench.config.groups import (CacheConfig, KernelConfig, ModelConfig, OffloadConfig,
                                     ParallelConfig, SchedulerConfig)
from workbench.config.plan import EnginePlan, KernelPlan, ModelFacts
from workbench.config.platform import (DTYPES, cpu_has_native_bf16, onednn_bf16_prepack_reason,
                                       resolve_device, resolve_dtype)
from workbench.config.pruning import PruneConfig
from workbench.config.quant import QuantConfig
from workbench.config.resolve import DEFAULT_MAX_MODEL_LEN, after_build, plan_kernels, resolve
from workbench.config.speculative import SpeculativeConfig

__all__ = ["CacheConfig", "DEFAULT_MAX_MODEL_LEN", "DTYPES", "EngineConfig", "EnginePlan",
           "GROUPS", "KernelConfig", "KernelPlan", "METHOD_FIELDS", "ModelConfig", "ModelFacts",
           "OffloadConfig", "ParallelConfig", "PruneConfig", "QuantConfig", "SchedulerConfig",
           "SpeculativeConfig", "after_build", "cpu_has_native_bf16", "onednn_bf16_prepack_reason",
           "plan_kernels", "resolve", "resolve_device", "resolve_dtype"]
