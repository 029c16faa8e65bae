"""The next turn's time to first token, predicted: recompute an evicted prefix, or load it.

A conversation of n context tokens returns with t new tokens after its blocks left the device
pool. With every term measured on the machine (tier_bench.py):

    recompute(n) = P(n + t)                     the prefill of the whole prompt
    load(n)      = P(t | n) + k l + k' s        the t new tokens over n cached ones, plus k block
                                                loads and the k' spills that make room for them

P(m) = a + b m + c m² is the wall time of a fresh prefill of m tokens with one token out (a: the
fixed cost of a step, b: the work per token, c: attention's growth with the context), fitted to
prefills timed on this machine; P(t | n) = a + b t + c ((n + t)² - n²) is the same prefill of t
tokens after n cached ones. A tier moves blocks in calls of a fixed cost F plus bytes / bandwidth;
a turn loads each context block into a device block and the full pool spills one block for each,
one call per block (tier_store.py groups only consecutive moves of one kind), so a block costs
l = F_load + B / BW_load to load and s = F_spill + B / BW_spill to spill.

With k = k' = n / block_size, recompute(n) - load(n) = n (b + c n - (l + s) / block_size): loading
wins once the prefill work it saves per token, b + c n, exceeds what the tier costs per token,
that is above the crossover n* = ((l + s) / block_size - b) / c tokens of context (0 if the tier
is cheaper than b from the first token on; never if it is not and c = 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Prefill:
    """P(m) = a + b m + c m², seconds for a prefill of m tokens."""
    a: float
    b: float
    c: float

    def seconds(self, tokens: int, cached: int = 0) -> float:
        """A prefill of `tokens` new tokens after `cached` tokens already in the cache."""
        return self.a + self.b * tokens + self.c * ((cached + tokens) ** 2 - cached ** 2)


def fit_prefill(samples) -> Prefill:
    """Least squares in relative error over (tokens, seconds) samples, so that short prefills fit
    as well as long ones; c is fitted only with 3 or more distinct lengths, and kept >= 0 (an
    attention that got cheaper with context would be noise)."""
    m = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    if len(set(m)) < 2 or (y <= 0).any():
        raise ValueError(f"samples={list(samples)!r} are invalid: positive times at two or more "
                         "distinct lengths are needed")
    columns = [np.ones_like(m), m, m ** 2]
    for width in ((3, 2) if len(set(m)) >= 3 else (2,)):
        coef, *_ = np.linalg.lstsq(np.stack(columns[:width], 1) / y[:, None], np.ones_like(y),
                                   rcond=None)
        if width == 2 or coef[2] >= 0:
            break
    a, b, c = (list(coef) + [0.0])[:3]
    return Prefill(float(a), float(b), float(c))


@dataclass(frozen=True)
class Move:
    """One kind of block move in one tier: a call costs fixed_s plus bytes / bandwidth."""
    fixed_s: float
    bandwidth: float          # bytes per second

    def seconds(self, blocks: int, block_bytes: int) -> float:
        """`blocks` moved one call each, as a turn moves them."""
        return blocks * (self.fixed_s + block_bytes / self.bandwidth)


def fit_move(one_block_s: float, group_s: float, group_blocks: int, block_bytes: int) -> Move:
    """From a call that moves one block and one that moves `group_blocks`: the marginal time of
    a block gives the bandwidth, the rest of a one-block call is its fixed cost. The marginal time
    is kept within (0, one_block_s], so that one block still costs one_block_s."""
    if group_blocks < 2 or one_block_s <= 0 or group_s <= 0:
        raise ValueError(f"one_block_s={one_block_s!r}, group_s={group_s!r}, "
                         f"group_blocks={group_blocks!r} are invalid: positive times and a group "
                         "of 2 or more blocks are needed")
    marginal = min(max((group_s - one_block_s) / (group_blocks - 1), 1e-9), one_block_s)
    return Move(fixed_s=one_block_s - marginal, bandwidth=block_bytes / marginal)


@dataclass(frozen=True)
class TierModel:
    prefill: Prefill
    moves: dict               # tier -> {"load": Move, "spill": Move}
    block_size: int
    block_bytes: int
    turn_tokens: int

    def recompute_s(self, context: int) -> float:
        return self.prefill.seconds(context + self.turn_tokens)

    def block_s(self, tier: str) -> float:
        """Seconds a turn spends per context block in `tier`: one load and one spill."""
        return sum(self.moves[tier][kind].seconds(1, self.block_bytes) for kind in ("load", "spill"))

    def load_s(self, tier: str, context: int, loads: int | None = None,
               spills: int | None = None) -> float:
        """The turn with its `context` tokens loaded from `tier`; `loads` and `spills` default to
        one per context block."""
        k = context // self.block_size
        moves = self.moves[tier]
        return (self.prefill.seconds(self.turn_tokens, cached=context)
                + moves["load"].seconds(k if loads is None else loads, self.block_bytes)
                + moves["spill"].seconds(k if spills is None else spills, self.block_bytes))

    def crossover(self, tier: str) -> float:
        """Context tokens above which loading from `tier` beats recomputing (0: from the first
        block on; inf: never)."""
        excess = self.block_s(tier) / self.block_size - self.prefill.b
        if excess <= 0:
            return 0.0
        return excess / self.prefill.c if self.prefill.c > 0 else math.inf
