"""A ring of resident buffers and the prefetcher that fills them.

`slots` buffers (two: the layer computing and the next one arriving), each large enough for the
biggest offloaded layer, live in the fast memory. `start(i)` begins copying layer i from the slow
tier into a buffer that no layer is computing in: on CPU in a background thread (the disk read and
torch's copy release the GIL), on CUDA from pinned memory on a side stream, ordered after the
compute that last used the buffer by an event. `acquire(i)` waits for that copy (the wait is the
stall time) and marks the buffer in use; `release` recycles it, so every step loads every
offloaded layer again.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Prefetcher:
    def __init__(self, tier, sizes: dict[int, int], device: torch.device, slots: int = 2):
        if slots < 1:
            raise ValueError(f"slots={slots} is invalid: the ring needs at least one buffer")
        self.tier, self.sizes, self.device = tier, sizes, device
        width = max(sizes.values())
        self.buffers = [torch.empty(width, dtype=torch.uint8, device=device)
                        for _ in range(slots)]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            # the disk tier reads into pinned staging first; the DMA goes from there
            self.staging = [torch.empty(width, dtype=torch.uint8, pin_memory=True)
                            for _ in range(slots)] if tier.name == "disk" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="workbench-offload")
        self.layer = [None] * slots            # which layer each buffer holds or is receiving
        self.pending: list[Future | None] = [None] * slots
        self.in_use = [False] * slots
        self.freed = [None] * slots            # CUDA: the compute's last use of the buffer
        self.copied = [None] * slots           # CUDA: the DMA into the buffer
        self.bytes_moved = self.loads = self.sync_loads = 0
        self.stall_s = 0.0

    def _copy(self, slot: int, index: int):
        """The background half: the slow tier into buffer `slot` (CUDA: returns the copy's event)."""
        n = self.sizes[index]
        dest = self.buffers[slot][:n]
        if not self.cuda:
            self.tier.read_into(index, dest)
            return None
        if self.staging is not None:
            if self.copied[slot] is not None:
                self.copied[slot].synchronize()      # the last DMA out of this staging buffer
            src = self.staging[slot][:n]
            self.tier.read_into(index, src)
        else:
            src = self.tier.tensors[index]
        with torch.cuda.stream(self.stream):
            if self.freed[slot] is not None:
                self.stream.wait_event(self.freed[slot])
            dest.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[slot] = event
        return event

    def _settle(self, slot: int) -> float:
        """Wait for the copy into `slot`, if one is under way; returns the seconds waited."""
        future = self.pending[slot]
        if future is None:
            return 0.0
        t0 = time.perf_counter()
        event = future.result()
        if event is not None:
            event.synchronize()
        self.pending[slot] = None
        return time.perf_counter() - t0

    def start(self, index: int) -> None:
        """Begin loading layer `index` unless a buffer holds it already; an empty buffer is taken
        first, else one holding a prefetched layer that nothing computes in. No-op if both are
        in use."""
        if index in self.layer:
            return
        free = [s for s in range(len(self.buffers)) if not self.in_use[s]]
        if not free:
            return
        slot = next((s for s in free if self.layer[s] is None), free[0])
        self._settle(slot)
        self.layer[slot] = index
        self.pending[slot] = self._pool.submit(self._copy, slot, index)
        self.bytes_moved += self.sizes[index]
        self.loads += 1

    def acquire(self, index: int) -> int:
        """The buffer holding layer `index`, once its copy is complete, marked in use."""
        if index not in self.layer:
            self.sync_loads += 1              # not prefetched: the whole copy is a stall
            self.start(index)
        slot = self.layer.index(index)
        self.stall_s += self._settle(slot)
        self.in_use[slot] = True
        return slot

    def release(self, slot: int) -> None:
        """The layer in `slot` is done: the buffer is free for the next load."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.freed[slot] = event
        self.in_use[slot] = False
        self.layer[slot] = None

    def close(self) -> None:
        for slot in range(len(self.buffers)):
            self._settle(slot)
        self._pool.shutdown(wait=True)
