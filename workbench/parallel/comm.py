"""Comm: the collectives one worker uses, on torch.distributed process groups, each one timed and
counted so that every step can say how many bytes it moved and how long it waited for them.

`bytes` is the payload handed to the collective (the tensor this rank contributes, or sends).
What crosses the wire depends on the algorithm: a ring all-reduce of S bytes over N ranks sends
2 (N - 1) / N * S per rank; chapter 07 derives it and compares.
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

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (the row-parallel layers' partial sums)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._record("all_reduce", _nbytes(t), t0)
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t, concatenated along dim in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        self._record("all_gather", _nbytes(t), t0)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out_splits: list[int]
                   ) -> torch.Tensor:
        """Rows [sum(in_splits[:r]), ...) go to rank r; out_splits[r] rows arrive from rank r."""
        t0 = time.perf_counter()
        out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:]))
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group)
        row = _nbytes(inp[:1]) if inp.shape[0] else 0
        self._record("all_to_all", row * (inp.shape[0] - in_splits[self.rank]), t0)
        return out

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Point to point, to the global rank dst (pipeline stage boundaries)."""
        t0 = time.perf_counter()
        dist.send(t.contiguous(), dst)
        self._record("send", _nbytes(t), t0)

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


def merge_stats(*stats: dict) -> dict[str, tuple[int, int, float]]:
    total: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
    for s in stats:
        for k, (calls, nbytes, secs) in s.items():
            t = total[k]
            t[0] += calls
            t[1] += nbytes
            t[2] += secs
    return {k: tuple(v) for k, v in total.items()}
