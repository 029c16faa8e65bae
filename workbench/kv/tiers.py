"""KVTiers: where prefix blocks go when the device pool evicts them, and where a lookup finds them.

Below the device pool (LMCache and Mooncake's design) sit two bounded tiers: a CPU tier, a second
pool of block slots (pinned memory on CUDA), and a disk tier, one file per block. When the pool
evicts a cached block, its contents spill to the CPU tier under its chained hash; the CPU tier's
least recently spilled entry moves on to disk when it is full, and the disk tier deletes its
least recently written files beyond its byte bound. A prefix lookup that misses the device index
continues the chain here; each hit is loaded into a fresh device block and indexed there.

Tiers are exclusive: each hash lives in at most one place among the device index, the CPU tier and
the disk tier. A block moves down on eviction and up on a hit, and a hash that the device indexes
after computing it again is dropped from the tiers, so no tier holds a copy that could go stale
or be counted twice against its bound.

This class keeps the books at scheduling time and records the data movements as ops; the runner
performs them, in the recorded order, before the step's forward pass (tier_store.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Ops, in the order recorded (tier_store.py performs them):
#   ("spill", device block, cpu slot)      ("spill_disk", device block, hash)
#   ("demote", cpu slot, hash)             ("delete", hash)
#   ("load", cpu slot, device block)       ("load_disk", hash, device block): read, then delete


@dataclass(frozen=True)
class TierHit:
    """A prefix block found below the device pool; allocation loads it into a device block."""
    block_hash: bytes
    tier: str                             # "cpu" or "disk"


class KVTiers:
    def __init__(self, num_cpu_blocks: int, disk_bytes: int, block_bytes: int,
                 disk_files: list[tuple[bytes, int]] = ()):
        self.num_cpu_blocks, self.disk_capacity, self.block_bytes = \
            num_cpu_blocks, disk_bytes, block_bytes
        self.cpu: OrderedDict[bytes, int] = OrderedDict()      # hash -> slot, oldest first
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))   # lowest slot first
        self.disk: OrderedDict[bytes, int] = OrderedDict()     # hash -> file bytes, oldest first
        self.disk_bytes = 0       # files on disk, claimed ones included until they are read
        self._claimed: dict[bytes, tuple[str, int]] = {}
        self.ops: list[tuple] = []
        self.bytes_moved = {"device_to_cpu": 0, "cpu_to_disk": 0, "device_to_disk": 0,
                            "cpu_to_device": 0, "disk_to_device": 0}
        for block_hash, size in disk_files:          # files an earlier engine left, oldest first
            self.disk[block_hash] = size
            self.disk_bytes += size
        while self.disk_bytes > self.disk_capacity:
            self._evict_disk()

    def take_ops(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def lookup(self, block_hash: bytes) -> str | None:
        if block_hash in self.cpu:
            return "cpu"
        return "disk" if block_hash in self.disk else None

    # ------------------------------------------------------------------ down: eviction
    def spill(self, block: int, block_hash: bytes) -> None:
        """The device pool evicts `block`, which holds `block_hash`: keep its contents below."""
        assert self.lookup(block_hash) is None and block_hash not in self._claimed
        slot = self._cpu_slot()
        if slot is not None:
            self.cpu[block_hash] = slot
            self.ops.append(("spill", block, slot))
            self.bytes_moved["device_to_cpu"] += self.block_bytes
        elif self._disk_room():
            self._add_disk(block_hash, ("spill_disk", block, block_hash), "device_to_disk")

    def _cpu_slot(self) -> int | None:
        """A free CPU slot, moving the least recently spilled entry to disk if none is free."""
        if self._cpu_free:
            return self._cpu_free.pop()
        if not self.cpu:
            return None               # no CPU tier, or every slot is being loaded this step
        old_hash, slot = self.cpu.popitem(last=False)
        if self._disk_room():
            self._add_disk(old_hash, ("demote", slot, old_hash), "cpu_to_disk")
        return slot

    def _disk_room(self) -> bool:
        """Evict disk files, oldest first, until one more block fits; False if it cannot."""
        if self.disk_capacity < self.block_bytes:
            return False
        while self.disk_bytes + self.block_bytes > self.disk_capacity and self.disk:
            self._evict_disk()
        return self.disk_bytes + self.block_bytes <= self.disk_capacity

    def _evict_disk(self) -> None:
        block_hash, size = self.disk.popitem(last=False)
        self.disk_bytes -= size
        self.ops.append(("delete", block_hash))

    def _add_disk(self, block_hash: bytes, op: tuple, direction: str) -> None:
        self.disk[block_hash] = self.block_bytes
        self.disk_bytes += self.block_bytes
        self.ops.append(op)
        self.bytes_moved[direction] += self.block_bytes

    # ------------------------------------------------------------------ up: hits
    def claim(self, block_hash: bytes) -> str:
        """Take a hit out of its tier's LRU order before device blocks are allocated for it, so
        that the evictions those allocations cause cannot push it out; load() completes it."""
        if block_hash in self.cpu:
            self._claimed[block_hash] = ("cpu", self.cpu.pop(block_hash))
        else:
            self._claimed[block_hash] = ("disk", self.disk.pop(block_hash))
        return self._claimed[block_hash][0]

    def load(self, block_hash: bytes, block: int) -> None:
        """Record the copy of a claimed hit into device `block`; its place below is freed."""
        tier, where = self._claimed.pop(block_hash)
        if tier == "cpu":
            self.ops.append(("load", where, block))
            self._cpu_free.append(where)
            self.bytes_moved["cpu_to_device"] += self.block_bytes
        else:
            self.ops.append(("load_disk", block_hash, block))
            self.disk_bytes -= where
            self.bytes_moved["disk_to_device"] += where

    def discard(self, block_hash: bytes) -> None:
        """The device indexes `block_hash` again (it was computed anew): drop the copy below."""
        if block_hash in self.cpu:
            self._cpu_free.append(self.cpu.pop(block_hash))
        elif block_hash in self.disk:
            self.disk_bytes -= self.disk.pop(block_hash)
            self.ops.append(("delete", block_hash))

    def check_invariants(self, device_hashes) -> None:
        """Raise if the books are inconsistent (tests call it after every operation)."""
        assert not self._claimed, "claims are completed within one allocation"
        slots = list(self.cpu.values()) + self._cpu_free
        assert sorted(slots) == list(range(self.num_cpu_blocks)), "each CPU slot once"
        assert self.disk_bytes == sum(self.disk.values()) <= max(self.disk_capacity, 0)
        device = set(device_hashes)
        assert not (set(self.cpu) & set(self.disk)), "a hash in the CPU and the disk tier"
        assert not (device & (set(self.cpu) | set(self.disk))), "a hash on device and below"
