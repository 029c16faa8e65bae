"""PagedKVCache: the tensors that hold keys and values, and the block copies the manager asks for.

Per layer, K and V are each one flat tensor of `num_blocks * block_size` slots of shape
(kv_heads, head_dim), or, with kv_cache_dtype "fp8"/"int8"/"int4", (kv_heads, row bytes) of codes
and a scale (layers/kv_formats.py). A per-layer plan (config/kv_plan.py) gives each layer its own format.
Block b owns slots [b * block_size, (b + 1) * block_size). Attention backends see only slot numbers
(or block tables), never the allocator. A second, smaller set of tensors in CPU memory receives
swapped-out blocks. With tiers, `tier_store` (tier_store.py) holds the CPU and disk
tiers' data and performs their spills and loads.
"""
from __future__ import annotations

import torch

from workbench.models.llama import LlamaArgs
from workbench.layers.kv_formats import is_quantized, row_bytes
from workbench.config.kv_plan import resolve
from workbench.kv.block_manager import BlockOps


def layer_formats(args: LlamaArgs, kv_cache_dtype) -> tuple[str, ...]:
    """The format of each layer's rows, from a single name or a per-layer plan."""
    resolved = resolve(kv_cache_dtype, args.num_hidden_layers)
    return (resolved,) * args.num_hidden_layers if isinstance(resolved, str) else resolved


def kv_bytes_per_token(args: LlamaArgs, dtype: torch.dtype, kv_cache_dtype="auto") -> int:
    """Bytes of K and V that one token occupies in the cache, summed over the layers."""
    return sum(2 * args.num_key_value_heads * row_bytes(args.head_dim, fmt, dtype)
               for fmt in layer_formats(args, kv_cache_dtype))


def layer_shape(args: LlamaArgs, slots: int, fmt: str) -> tuple[int, int, int]:
    """One layer's K (or V) tensor: float rows of head_dim, or quantized rows as bytes."""
    width = row_bytes(args.head_dim, fmt, torch.uint8) if is_quantized(fmt) else args.head_dim
    return (slots, args.num_key_value_heads, width)


class PagedKVCache:
    def __init__(self, args: LlamaArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_cpu_blocks: int = 0, kv_cache_dtype="auto"):
        self.num_blocks, self.block_size = num_blocks, block_size
        # a single name, or a tuple of one per layer when the plan mixes formats
        self.kv_cache_dtype = resolve(kv_cache_dtype, args.num_hidden_layers)
        self.layer_kv_dtypes = layer_formats(args, kv_cache_dtype)
        pin = device.type == "cuda"
        self.kv_caches, self.cpu_caches = [], []
        for fmt in self.layer_kv_dtypes:
            # quantized rows are codes + scale as bytes (layers/kv_formats.py)
            t_dtype = torch.uint8 if is_quantized(fmt) else dtype
            shape = layer_shape(args, num_blocks * block_size, fmt)
            # torch.zeros, not empty: memory is committed now, so what the engine reports is real.
            self.kv_caches.append((torch.zeros(shape, dtype=t_dtype, device=device),
                                   torch.zeros(shape, dtype=t_dtype, device=device)))
            if num_cpu_blocks:
                cpu_shape = layer_shape(args, num_cpu_blocks * block_size, fmt)
                self.cpu_caches.append((torch.zeros(cpu_shape, dtype=t_dtype, pin_memory=pin),
                                        torch.zeros(cpu_shape, dtype=t_dtype, pin_memory=pin)))
        self.bytes_per_token = kv_bytes_per_token(args, dtype, kv_cache_dtype)
        self.device = device
        self.tier_store = None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    def _slots(self, blocks: list[int], device) -> torch.Tensor:
        base = torch.tensor(blocks, device=device)[:, None] * self.block_size
        return (base + torch.arange(self.block_size, device=device)).flatten()

    def apply(self, ops: BlockOps) -> None:
        """Swap out, then the tiers' spills and loads, then swap in, then copy-on-write: a block
        swapped out or spilled this step may be reused by a load, a swap-in or a copy in the same
        step, so its old contents must leave first."""
        if ops.swap_out:
            src = self._slots([d for d, _ in ops.swap_out], self.device)
            dst = self._slots([c for _, c in ops.swap_out], "cpu")
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches):
                ck[dst] = k[src].cpu()
                cv[dst] = v[src].cpu()
        if ops.tier:
            self.tier_store.apply(ops.tier, self.kv_caches)
        if ops.swap_in:
            src = self._slots([c for c, _ in ops.swap_in], "cpu")
            dst = self._slots([d for _, d in ops.swap_in], self.device)
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches):
                k[dst] = ck[src].to(self.device)
                v[dst] = cv[src].to(self.device)
        if ops.copy:
            src = self._slots([s for s, _ in ops.copy], self.device)
            dst = self._slots([d for _, d in ops.copy], self.device)
            for k, v in self.kv_caches:
                k[dst] = k[src]
                v[dst] = v[src]
