"""TierStore: the tiers' data, and the spills and loads that tiers.py records, performed in order.

The CPU tier is one tensor of block slots, each slot a whole block for every layer, contiguous
(layers, 2, block_size, kv_heads, row), so that one block moves in one copy; on CUDA it is pinned
and device-to-host copies are non_blocking (one stream orders them before any later overwrite of
the device block; the host waits only before it reads a slot itself, to write it to disk).
Consecutive ops of one kind move together, one gather or scatter per layer.
"""
from __future__ import annotations

from itertools import groupby
from pathlib import Path

import torch

from workbench.kv import disk_tier


class TierStore:
    def __init__(self, kv_caches: list, block_size: int, device: torch.device,
                 num_cpu_blocks: int, disk_dir: str | Path | None, drop_page_cache: bool = True):
        k0 = kv_caches[0][0]
        self.block_size, self.device, self.dtype = block_size, device, k0.dtype
        self.block_shape = (len(kv_caches), 2, block_size) + tuple(k0.shape[1:])
        self.cpu = torch.zeros((num_cpu_blocks,) + self.block_shape, dtype=k0.dtype,
                               pin_memory=device.type == "cuda")
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.drop_page_cache = drop_page_cache   # False: later reads may come from the page cache
        self._pending = False                    # non_blocking copies into self.cpu in flight

    def apply(self, ops: list[tuple], kv_caches: list) -> None:
        for kind, run in groupby(ops, key=lambda op: op[0]):
            getattr(self, "_" + kind)([op[1:] for op in run], kv_caches)

    # ------------------------------------------------------------------ moves
    def _spill(self, pairs, kv_caches) -> None:
        data = self._gather(kv_caches, [b for b, _ in pairs])
        for (_, slot), block in zip(pairs, data):
            self.cpu[slot].copy_(block, non_blocking=True)
        self._pending = self.device.type == "cuda"

    def _spill_disk(self, pairs, kv_caches) -> None:
        data = self._gather(kv_caches, [b for b, _ in pairs]).cpu()
        for (_, block_hash), block in zip(pairs, data):
            disk_tier.write_block(self.disk_dir, block_hash, block, self.drop_page_cache)

    def _demote(self, pairs, kv_caches) -> None:
        self._wait()
        for slot, block_hash in pairs:
            disk_tier.write_block(self.disk_dir, block_hash, self.cpu[slot], self.drop_page_cache)

    def _delete(self, hashes, kv_caches) -> None:
        for (block_hash,) in hashes:
            disk_tier.delete_block(self.disk_dir, block_hash)

    def _load(self, pairs, kv_caches) -> None:
        data = torch.stack([self.cpu[slot].to(self.device, non_blocking=True)
                            for slot, _ in pairs])
        self._scatter(kv_caches, [b for _, b in pairs], data)

    def _load_disk(self, pairs, kv_caches) -> None:
        data = torch.stack([disk_tier.read_block(self.disk_dir, h, self.block_shape, self.dtype)
                            for h, _ in pairs]).to(self.device)
        self._scatter(kv_caches, [b for _, b in pairs], data)
        for block_hash, _ in pairs:               # the block lives on the device now
            disk_tier.delete_block(self.disk_dir, block_hash)

    # ------------------------------------------------------------------ layout
    def _wait(self) -> None:
        if self._pending:
            torch.cuda.synchronize(self.device)
            self._pending = False

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        base = torch.tensor(blocks, device=self.device)[:, None] * self.block_size
        return (base + torch.arange(self.block_size, device=self.device)).flatten()

    def _gather(self, kv_caches, blocks: list[int]) -> torch.Tensor:
        """(n, layers, 2, block_size, kv_heads, row) copies of device blocks."""
        slots = self._slots(blocks)
        data = torch.stack([torch.stack((k[slots], v[slots])) for k, v in kv_caches])
        n, rest = len(blocks), tuple(data.shape[3:])
        return data.view(data.shape[0], 2, n, self.block_size, *rest) \
            .permute(2, 0, 1, 3, 4, 5).contiguous()

    def _scatter(self, kv_caches, blocks: list[int], data: torch.Tensor) -> None:
        slots = self._slots(blocks)
        rows = data.permute(1, 2, 0, 3, 4, 5).reshape(
            data.shape[1], 2, len(blocks) * self.block_size, *data.shape[4:])
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, slots, rows[layer, 0])
            v.index_copy_(0, slots, rows[layer, 1])
