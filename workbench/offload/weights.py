"""Weight offload: whole decoder layers kept in a slow tier and brought in one at a time.

    WeightOffload(model, tier, budget_bytes, device)
      choose_offloaded_layers: from the last layer backwards until their bytes reach the budget
      each chosen layer: its parameters packed into one flat byte array (LayerLayout) and stored
        in the tier (tiers.py); the parameters themselves point at empty tensors from then on
      a forward pre-hook on each chosen layer: wait for its bytes in a ring buffer (prefetch.py),
        point its parameters at views of that buffer, and start the next offloaded layer's load
        (after the last one: the first, for the next step) into the other buffer
      a forward hook: parameters back to the empty tensors, the buffer recycled

Every path that calls the layers as modules (eager prefill, decode, the CPU GEMV layers, which
read `self.weight` on each call) sees ordinary parameters. Paths that read every layer's weights
at once or keep their addresses (the fused decode step, CUDA graphs, compilation) are refused or
turned off by config.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from workbench.offload.prefetch import Prefetcher

log = logging.getLogger("workbench.offload")
ALIGN = 64          # byte offset of every parameter in a layer's flat array: any dtype views it


@dataclass
class LayerLayout:
    """Where each parameter of one layer sits in its flat byte array."""
    index: int
    params: list[tuple[nn.Parameter, int, int]]   # (parameter, byte offset, bytes)
    weight_bytes: int                             # the parameters' bytes
    span: int                                     # the flat array's length (aligned offsets)

    @classmethod
    def of(cls, index: int, layer: nn.Module) -> "LayerLayout":
        params, offset, total = [], 0, 0
        for p in layer.parameters():
            n = p.numel() * p.element_size()
            params.append((p, offset, n))
            total += n
            offset += -(-n // ALIGN) * ALIGN
        return cls(index, params, total, offset)

    def pack(self) -> torch.Tensor:
        """The layer's bytes as one CPU uint8 tensor, parameters at their offsets."""
        flat = torch.zeros(self.span, dtype=torch.uint8)
        for p, offset, n in self.params:
            flat[offset:offset + n] = p.detach().reshape(-1).view(torch.uint8).cpu()
        return flat

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's tensor inside `buffer` (a uint8 ring buffer)."""
        return [buffer[offset:offset + n].view(p.dtype).view(p.shape)
                for p, offset, n in self.params]


def layer_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def choose_offloaded_layers(sizes: list[int], budget_bytes: float) -> list[int]:
    """Layers from the last backwards until their bytes add up to at least `budget_bytes` (all of
    them if the budget is larger than the model); ascending indices."""
    chosen, total = [], 0
    for i in reversed(range(len(sizes))):
        if total >= budget_bytes:
            break
        chosen.append(i)
        total += sizes[i]
    return sorted(chosen)


class WeightOffload:
    """The offloaded layers of one model: their layouts, the tier, the ring and the hooks."""

    def __init__(self, model: nn.Module, tier, budget_bytes: float, device: torch.device,
                 slots: int = 2):
        self.tier, self.device = tier, device
        layers = model.layers
        self.layers = choose_offloaded_layers([layer_bytes(l) for l in layers], budget_bytes)
        self.layouts = {i: LayerLayout.of(i, layers[i]) for i in self.layers}
        for i in self.layers:
            tier.store(i, self.layouts[i].pack())
        self.prefetcher = Prefetcher(tier, {i: lay.span for i, lay in self.layouts.items()},
                                     device, slots)
        # views made once, outside inference mode, so binding a layer is only pointer swaps
        self._views = {i: [lay.views(buf) for buf in self.prefetcher.buffers]
                       for i, lay in self.layouts.items()}
        self._empty = {i: [torch.empty(0, dtype=p.dtype, device=device) for p, _, _ in lay.params]
                       for i, lay in self.layouts.items()}
        for i in self.layers:
            self._point(i, self._empty[i])
        self._slot: dict[int, int] = {}
        self._next = {i: self.layers[(k + 1) % len(self.layers)] for k, i in enumerate(self.layers)}
        self._hooks = []
        for i in self.layers:
            self._hooks.append(layers[i].register_forward_pre_hook(self._pre_hook(i)))
            self._hooks.append(layers[i].register_forward_hook(self._post_hook(i),
                                                               always_call=True))
        if self.layers:
            log.info("weight offload: layers %s (%d of %d, %.1f MiB) in the %s tier",
                     self.describe_layers(), len(self.layers), len(layers),
                     self.offloaded_bytes / 2**20, tier.name)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes read from the slow tier per step: every offloaded layer's flat array once."""
        return sum(lay.span for lay in self.layouts.values())

    def describe_layers(self) -> str:
        if not self.layers:
            return "none"
        a, b = self.layers[0], self.layers[-1]
        if a == b:
            return str(a)
        return f"{a}-{b}" if b - a + 1 == len(self.layers) else ", ".join(map(str, self.layers))

    def _point(self, index: int, tensors: list[torch.Tensor]) -> None:
        for (p, _, _), t in zip(self.layouts[index].params, tensors):
            p.data = t

    def _pre_hook(self, index: int):
        def bring_in(module, args):
            slot = self.prefetcher.acquire(index)
            self._slot[index] = slot
            self._point(index, self._views[index][slot])
            self.prefetcher.start(self._next[index])
        return bring_in

    def _post_hook(self, index: int):
        def give_back(module, args, output):
            self._point(index, self._empty[index])
            slot = self._slot.pop(index, None)
            if slot is not None:
                self.prefetcher.release(slot)
            self.prefetcher.start(self._next[index])
        return give_back

    def stats(self) -> dict:
        p = self.prefetcher
        return {"offload_tier": self.tier.name, "offloaded_layers": list(self.layers),
                "offloaded_bytes": self.offloaded_bytes, "offload_bytes_moved": p.bytes_moved,
                "offload_loads": p.loads, "offload_sync_loads": p.sync_loads,
                "offload_stall_s": p.stall_s}

    def close(self) -> None:
        """Stop the prefetch thread and delete the tier's files (a temporary directory too)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.prefetcher.close()
        self.tier.close()
