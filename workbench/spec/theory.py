"""The arithmetic of speculative decoding, free of the engine and of plotting.

    from workbench.spec.theory import expected_speedup, fit_alpha
    alpha = fit_alpha(mean_accepted=2.4, k=4)       # the i.i.d. acceptance that explains it
    expected_speedup(alpha, k=4, c=0.1)

Leviathan et al. (arXiv 2211.17192, Section 3): tokens per verification step and the expected
speedup for an acceptance rate alpha, k drafts and a draft/target cost ratio c; the acceptance
probability and the residual distribution of the rejection sampler (rejection.py applies the same
rule inline), and the total-variation distance that measures how far the emitted tokens are from p.
"""
from __future__ import annotations

import torch


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one verification step emits when each draft is accepted independently with
    probability alpha: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"alpha={alpha!r}, k={k!r} is invalid: alpha must be in [0, 1], k >= 0")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.'s expected walltime improvement (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)):
    tokens per step over the step's cost in target steps (k drafts at c each, plus the
    verification). `verify_cost` generalises the "+ 1": the cost of scoring k + 1 tokens in one
    pass, in plain steps (1 when decoding is purely memory-bound)."""
    return expected_tokens_per_step(alpha, k) / (k * c + verify_cost)


def fit_alpha(mean_accepted: float, k: int) -> float:
    """The i.i.d. acceptance rate alpha with alpha + alpha^2 + ... + alpha^k = mean_accepted (the
    measured accepted drafts per verification step), by bisection."""
    if not 0 <= mean_accepted <= k:
        raise ValueError(f"mean_accepted={mean_accepted!r} is invalid: it must be in [0, k={k}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) - 1 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance between two distributions: half the L1 distance."""
    return 0.5 * (a.double() - b.double()).abs().sum().item()


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> float:
    """Probability that a draft x ~ q passes the test u < p(x)/q(x): sum_x min(p(x), q(x))
    = 1 - TV(p, q)."""
    return torch.minimum(p.double(), q.double()).sum().item()


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where the rejection sampler draws after a rejection (p itself when
    p == q, where rejection never happens)."""
    r = (p.double() - q.double()).clamp(min=0)
    return (r / r.sum() if r.sum() > 0 else p.double()).to(p.dtype)
