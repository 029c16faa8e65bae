"""Comm: the collectives one worker uses, on torch.distributed process groups, each one timed and
counted so that every step can say how many bytes it moved and how long it waited for them.

`bytes` is the payload handed to the collective (the tensor this rank contributes, or sends).
What crosses the wire depends on the algorithm: a ring all-reduce of S bytes over N ranks sends
2 (N - 1) / N * S per rank; chapter 07 derives it and compares. `sent` counts, per collective
kind, the bytes this rank puts on the wire with the algorithm used, and what a ring algorithm
would send for the unpadded tensor: all-reduce 2 (N - 1) / N * S, reduce-scatter and
all-gather (N - 1) / N * S each (sequence parallelism, sequence.py).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """One group of ranks (a tensor-parallel group, an expert-parallel group, or the whole world
    for pipeline send/recv). Collectives over a group of one rank are free and skipped."""

    def __init__(self, group, ranks: list[int], rank: int | None = None):
        self.group, self.ranks = group, list(ranks)
        self.size = len(ranks)
        if rank is None:
            rank = ranks.index(dist.get_rank()) if self.size > 1 else 0
        self.rank = rank
        self.stats: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])   # calls, bytes, seconds
        self.sent: dict[str, list] = defaultdict(lambda: [0, 0])   # algorithm bytes, ring bytes

    @classmethod
    def offline(cls, rank: int, size: int) -> "Comm":
        """A Comm for looking at one rank's shard in this process (chapter 07 draws the splits);
        its collectives need a process group, so it cannot run a forward with size > 1."""
        return cls(None, list(range(size)), rank)

    def _record(self, name: str, nbytes: int, t0: float) -> None:
        s = self.stats[name]
        s[0] += 1
        s[1] += nbytes
        s[2] += time.perf_counter() - t0

    def _record_sent(self, name: str, algorithm: int, ring: int) -> None:
        s = self.sent[name]
        s[0] += algorithm
        s[1] += ring

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (the row-parallel layers' partial sums)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._record("all_reduce", _nbytes(t), t0)
        ring = 2 * (self.size - 1) * _nbytes(t) // self.size    # gloo's and NCCL's default: a ring
        self._record_sent("all_reduce", ring, ring)
        return t

    def reduce_scatter(self, t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Sum over the group of t (size * n rows), of which this rank keeps rows
        [rank * n, (rank + 1) * n). rows: how many leading rows are real, the rest padding (the
        ring-ideal count is for those). An all-to-all of the n-row chunks, then a local sum in
        rank order: torch's gloo reduce_scatter_tensor runs a whole all-reduce and keeps one
        chunk, sending twice the bytes; this sends (size - 1) chunks, the ring's amount."""
        if self.size == 1:
            return t
        if t.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: {t.shape[0]} rows do not split over {self.size} "
                             "ranks; pad them to a multiple first")
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = torch.empty_like(t)
        dist.all_to_all_single(parts, t, group=self.group)
        out = parts.view(self.size, t.shape[0] // self.size, *t.shape[1:]).sum(0)
        self._record("reduce_scatter", _nbytes(t), t0)
        self._record_sent("reduce_scatter", (self.size - 1) * _nbytes(t) // self.size,
                          self._ring_share(t, rows))
        return out

    def all_gather_rows(self, t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Every rank's t (n rows each), stacked in rank order: size * n rows. rows: how many
        leading rows of the result are real (for the ring-ideal count)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        t = t.contiguous()
        out = t.new_empty((self.size * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_single(out, t, group=self.group)
        self._record("all_gather_tokens", _nbytes(t), t0)
        self._record_sent("all_gather_tokens", (self.size - 1) * _nbytes(t),
                          self._ring_share(out, rows))
        return out

    def _ring_share(self, full: torch.Tensor, rows: int | None) -> int:
        """(size - 1) / size of the real rows' bytes: a ring reduce-scatter or all-gather."""
        real = _nbytes(full) if rows is None else rows * _nbytes(full[:1])
        return (self.size - 1) * real // self.size

    def all_gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t, concatenated along dim in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        self._record("all_gather", _nbytes(t), t0)
        self._record_sent("all_gather", (self.size - 1) * _nbytes(t), (self.size - 1) * _nbytes(t))
        return torch.cat(parts, dim=dim)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out_splits: list[int]
                   ) -> torch.Tensor:
        """Rows [sum(in_splits[:r]), ...) go to rank r; out_splits[r] rows arrive from rank r."""
        t0 = time.perf_counter()
        out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:]))
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group)
        row = _nbytes(inp[:1]) if inp.shape[0] else 0
        sent = row * (inp.shape[0] - in_splits[self.rank])
        self._record("all_to_all", sent, t0)
        self._record_sent("all_to_all", sent, sent)
        return out

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Point to point, to the global rank dst (pipeline stage boundaries)."""
        t0 = time.perf_counter()
        dist.send(t.contiguous(), dst)
        self._record("send", _nbytes(t), t0)
        self._record_sent("send", _nbytes(t), _nbytes(t))

    def recv(self, shape, dtype: torch.dtype, src: int, device=None) -> torch.Tensor:
        t0 = time.perf_counter()
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        self._record("recv", 0, t0)          # bytes are counted once, by the sender
        return t

    def take_stats(self) -> dict[str, tuple[int, int, float]]:
        """The counts since the last call, and reset."""
        out = {k: tuple(v) for k, v in self.stats.items()}
        self.stats.clear()
        return out

    def take_sent(self) -> dict[str, tuple[int, int]]:
        """Bytes sent since the last call, per collective: (algorithm used, ring ideal); reset."""
        out = {k: tuple(v) for k, v in self.sent.items()}
        self.sent.clear()
        return out


def merge_stats(*stats: dict) -> dict[str, tuple]:
    """Element-wise sums per key: of take_stats' (calls, bytes, seconds) or take_sent's pairs."""
    total: dict[str, list] = {}
    for s in stats:
        for k, values in s.items():
            t = total.setdefault(k, [0] * len(values))
            for i, v in enumerate(values):
                t[i] += v
    return {k: tuple(v) for k, v in total.items()}
