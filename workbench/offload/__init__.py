"""Weight offload (FlexGen, vLLM's cpu_offload_gb): decoder layers kept in a slow tier (pinned CPU
memory or files on disk) and copied into a ring of resident buffers while the layer before them
computes. weights.py (the layers and hooks), prefetch.py (the ring), tiers.py (disk, CPU); the
FlexGen-style cost model and its measured curve are in experiments/offload_cost.py."""
from __future__ import annotations

from workbench.offload.tiers import CpuTier, DiskTier, make_tier
from workbench.offload.weights import LayerLayout, WeightOffload, choose_offloaded_layers, layer_bytes


def offload_model(model, tier: str, device, gib: float, offload_dir: str | None = None,
                  keep_page_cache: bool = False) -> WeightOffload:
    """The engine's entry point: `gib` GiB of the last layers into the tier named `tier`."""
    return WeightOffload(model, make_tier(tier, device, offload_dir, keep_page_cache),
                         gib * 2**30, device)


__all__ = ["CpuTier", "DiskTier", "LayerLayout", "WeightOffload", "choose_offloaded_layers",
           "layer_bytes", "make_tier", "offload_model"]
