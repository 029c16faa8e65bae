"""How far one next-token distribution is from another: KL divergence and negative log-likelihood
over log-probability rows, the measures every compression method and its evaluation share."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def kl_divergence(ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor,
                  chunk: int = 64) -> torch.Tensor:
    """KL(ref || cand) per row, float64, from log-probabilities (..., vocab).
    Computed in float64 so that the sum over 49k terms of nearly cancelling differences keeps its
    digits; rows go `chunk` at a time to bound the float64 temporaries."""
    if ref_logprobs.shape != cand_logprobs.shape:
        raise ValueError(f"log-probability shapes differ: {tuple(ref_logprobs.shape)} vs "
                         f"{tuple(cand_logprobs.shape)}")
    ref2 = ref_logprobs.reshape(-1, ref_logprobs.shape[-1])
    cand2 = cand_logprobs.reshape(-1, cand_logprobs.shape[-1])
    out = torch.empty(ref2.shape[0], dtype=torch.float64)
    for i in range(0, ref2.shape[0], chunk):
        lr, lc = ref2[i:i + chunk].double(), cand2[i:i + chunk].double()
        p = lr.exp()
        # 0 * log 0 is 0: tokens the reference rules out contribute nothing, even where -inf.
        zero = torch.zeros((), dtype=lr.dtype)
        out[i:i + chunk] = torch.where(p > 0, p * (lr - lc), zero).sum(-1)
    return out.reshape(ref_logprobs.shape[:-1])


def nll(logprobs: torch.Tensor, window: Sequence[int]) -> torch.Tensor:
    """Negative log-likelihood (float64) of window[1:], from rows 0..n-2 of window_logprobs."""
    targets = torch.tensor(list(window[1:]))
    return -logprobs[:-1].double().gather(1, targets[:, None])[:, 0]
