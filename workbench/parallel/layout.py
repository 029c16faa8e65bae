"""Which rank does what: world = pipeline stages x tensor-parallel ranks (or expert-parallel ranks,
which replicate everything but the experts). Rank r is stage r // tp, tensor rank r % tp."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.expert

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def stage_of(self, rank: int) -> int:
        return rank // (self.tensor * self.expert)

    def group_rank(self, rank: int) -> int:
        """The rank's index inside its stage's tensor- (or expert-) parallel group."""
        return rank % (self.tensor * self.expert)

    def stage_ranks(self, stage: int) -> list[int]:
        width = self.tensor * self.expert
        return list(range(stage * width, (stage + 1) * width))

    def peer(self, rank: int, stage: int) -> int:
        """The rank holding the same tensor slice in another stage (pipeline send/recv)."""
        return self.stage_ranks(stage)[self.group_rank(rank)]

    def describe(self) -> str:
        parts = [f"{n}={v}" for n, v in (("tp", self.tensor), ("pp", self.pipeline),
                                          ("ep", self.expert)) if v > 1]
        return f"{self.world_size} workers ({' x '.join(parts)})"
