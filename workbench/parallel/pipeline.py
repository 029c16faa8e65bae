"""Pipeline parallelism (GPipe, Huang et al. 2019, as inference engines run it): the layers are cut
into consecutive stages, one process each. Stage s receives the hidden states of a micro-batch
from stage s - 1, runs its layers on them (its KV cache holds only its layers), and sends them on;
the last stage applies the final norm and the LM head.

With one batch at a time, P - 1 of P stages sit idle. The engine therefore keeps up to P
micro-batches in flight (vLLM's "virtual engines": one scheduler per micro-batch slot, requests
spread over them): while stage 1 runs micro-batch 0, stage 0 already runs micro-batch 1.
"""
from __future__ import annotations

import time

import torch

from workbench.parallel.comm import Comm


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Consecutive layer ranges, as even as possible, the earlier stages taking the remainder."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} is invalid for this model: it has "
                         f"only {num_layers} layers, and every stage needs at least one")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle share of a GPipe schedule with equal stage times: (P - 1) / (M + P - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class Stage:
    """One stage's part of the forward: its layers, plus the embedding (first stage) or the final
    norm (last stage). Hidden states and the residual stream cross each boundary."""

    def __init__(self, model, layers: range, index: int, num_stages: int, comm: Comm,
                 prev_rank: int | None, next_rank: int | None, split=None):
        self.model, self.layers, self.index = model, layers, index
        self.first, self.last = index == 0, index == num_stages - 1
        self.comm, self.prev_rank, self.next_rank = comm, prev_rank, next_rank
        self.split = split        # a sequence.TokenSplit when the layers are sequence-parallel
        self.work_start = 0.0     # when the last forward had its inputs (after waiting in recv)
        self.residual_bytes = 0   # hidden states + residual stream this rank held between layers
        # Drop the layers of the other stages; the KV cache is built for these only.
        model.layers = torch.nn.ModuleList(model.layers[i] for i in layers)

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        """The final hidden states on the last stage; None elsewhere (sent on instead)."""
        model = self.model
        n, h = input_ids.shape[0], model.args.hidden_size
        dtype = model.norm.weight.dtype
        rows = n
        if self.split is not None:
            self.split.tokens = n
            rows = self.split.local       # a peer in the next stage holds the same token slice
        if self.first:
            self.work_start = time.monotonic()
            x, residual = model.embed_tokens(input_ids), None
        else:
            x = self.comm.recv((rows, h), dtype, self.prev_rank, input_ids.device)
            residual = self.comm.recv((rows, h), dtype, self.prev_rank, input_ids.device)
        self.work_start = time.monotonic()
        rope = backend.ops.rope_inputs(model.rotary, positions, dtype)
        for layer, kv_cache in zip(model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta, backend)
        self.residual_bytes = sum(t.numel() * t.element_size() for t in (x, residual))
        if not self.last:
            self.comm.send(x, self.next_rank)
            self.comm.send(residual, self.next_rank)
            return None
        hidden = backend.ops.rms_norm(x, model.norm.weight, model.norm.eps, residual)[0]
        return hidden if self.split is None else self.split.gather(hidden)


def gpipe_schedule(num_stages: int, num_microbatches: int) -> list[tuple[int, int, int]]:
    """(stage, micro-batch, time slot) of a forward-only GPipe schedule with equal stage times:
    micro-batch m runs on stage s in slot s + m."""
    return [(s, m, s + m) for s in range(num_stages) for m in range(num_microbatches)]
