"""Weight offload (FlexGen, vLLM's cpu_offload_gb): decoder layers kept in a slow tier (pinned CPU
memory or files on disk) and copied into a ring of resident buffers while the layer before them
computes. weights.py (the layers and hooks), prefetch.py (the ring), tiers.py (disk, CPU),
cost_model.py (the FlexGen-style prediction and the measured curve)."""
from __future__ import annotations

from .tiers import CpuTier, DiskTier, make_tier
from .weights import LayerLayout, WeightOffload, choose_offloaded_layers, layer_bytes


def offload_model(model, config) -> WeightOffload:
    """The engine's entry point: the tier and budget from an EngineConfig."""
    tier = make_tier(config.offload_tier, config.torch_device, config.offload_dir,
                     config.offload_keep_page_cache)
    return WeightOffload(model, tier, config.cpu_offload_gb * 2**30, config.torch_device)


__all__ = ["CpuTier", "DiskTier", "LayerLayout", "WeightOffload", "choose_offloaded_layers",
           "layer_bytes", "make_tier", "offload_model"]
