"""Which weights a pruning method keeps: masks from scores (unstructured or N:M), Wanda's score and
the input statistics it needs, and whether a weight follows an N:M pattern."""
from __future__ import annotations

import torch


def keep_mask(score: torch.Tensor, sparsity: float, n_m: tuple[int, int] | None) -> torch.Tensor:
    """The (N, K) bool mask of weights kept: per row, the round(sparsity * K) lowest scores
    dropped (unstructured), or the N highest of every M consecutive scores kept (N:M)."""
    rows, k = score.shape
    if n_m is None:
        mask = torch.ones_like(score, dtype=torch.bool)
        drop = round(sparsity * k)
        if drop:
            mask.scatter_(1, score.topk(drop, dim=1, largest=False).indices, False)
        return mask
    n, m = n_m
    if k % m:
        raise ValueError(f"pattern '{n}:{m}' needs in_features divisible by {m}; this layer has "
                         f"{k}")
    groups = score.reshape(rows, k // m, m)
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(2, groups.topk(n, dim=2).indices, True)
    return mask.reshape(rows, k)


def wanda_score(weight: torch.Tensor, input_sq_sums: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2, from the per-column sums of squared inputs (K,)."""
    return weight.detach().float().abs() * input_sq_sums.float().sqrt()


def squared_sums_accumulator(k: int):
    """(sums, add): add(x) accumulates the column sums of x^2 of (tokens, K) inputs (float64)."""
    sums = torch.zeros(k, dtype=torch.float64)

    def add(x: torch.Tensor) -> None:
        sums.add_(x.float().pow(2).sum(0).double())
    return sums, add


def follows_pattern(weight: torch.Tensor, pattern: str) -> bool:
    """Whether every group of M consecutive weights of every row of `weight` holds at most N
    nonzeros, for pattern 'N:M' (GPTQ after a mask, for one, fills the zeros in)."""
    n, m = map(int, pattern.split(":"))
    rows, k = weight.shape
    return k % m == 0 and int((weight != 0).reshape(rows, k // m, m).sum(-1).max()) <= n
