"""The tier cost model: the prefill fit recovers known coefficients, a block move splits into a
fixed cost and a bandwidth, and the crossover is where the predicted TTFTs cross."""
from __future__ import annotations

import math

import pytest

from workbench.experiments.kv_tier_model import Move, Prefill, TierModel, fit_move, fit_prefill


def test_fit_prefill_recovers_a_quadratic_and_keeps_attention_non_negative():
    truth = Prefill(a=0.01, b=2e-4, c=5e-8)
    samples = [(m, truth.seconds(m)) for m in (16, 64, 256, 271, 16, 64)]
    fit = fit_prefill(samples)
    for got, want in ((fit.a, truth.a), (fit.b, truth.b), (fit.c, truth.c)):
        assert got == pytest.approx(want, rel=1e-6)
    # a prefill that gets cheaper per token at length fits a line instead of a negative c
    concave = fit_prefill([(16, 0.010), (128, 0.030), (512, 0.080), (1024, 0.120)])
    assert concave.c == 0.0 and concave.b > 0
    line = fit_prefill([(16, 0.0132), (256, 0.0612)])       # two lengths: a line through them
    assert line.c == 0.0 and line.b == pytest.approx(2e-4) and line.a == pytest.approx(0.01)
    with pytest.raises(ValueError, match="two or more distinct lengths"):
        fit_prefill([(64, 0.02), (64, 0.021)])


def test_prefill_after_cached_tokens_pays_only_their_attention():
    p = Prefill(a=0.01, b=2e-4, c=5e-8)
    assert p.seconds(16, cached=0) == p.seconds(16)
    assert p.seconds(16, cached=1000) - p.seconds(16) == pytest.approx(5e-8 * (1016 ** 2 - 1000 ** 2 - 16 ** 2))


def test_fit_move_splits_a_call_into_fixed_cost_and_bandwidth():
    move = fit_move(one_block_s=1.1e-3, group_s=1.8e-3, group_blocks=8, block_bytes=368_640)
    assert move.fixed_s == pytest.approx(1e-3) and move.bandwidth == pytest.approx(368_640 / 1e-4)
    assert move.seconds(3, 368_640) == pytest.approx(3 * 1.1e-3)
    noisy = fit_move(one_block_s=1e-3, group_s=0.9e-3, group_blocks=8, block_bytes=1000)
    assert noisy.seconds(1, 1000) == pytest.approx(1e-3)           # a block still costs one call
    with pytest.raises(ValueError, match="group_blocks=1"):
        fit_move(1e-3, 1e-3, 1, 1000)


def _model(load_s: float, spill_s: float, c: float) -> TierModel:
    moves = {"t": {"load": Move(load_s, 1e30), "spill": Move(spill_s, 1e30)}}
    return TierModel(Prefill(a=0.01, b=1e-4, c=c), moves, block_size=16, block_bytes=1000,
                     turn_tokens=16)


def test_the_crossover_is_where_recompute_and_load_cross():
    model = _model(load_s=1.6e-3, spill_s=1.6e-3, c=1e-4 / 1024)   # 2e-4 s per token vs b = 1e-4
    assert model.crossover("t") == pytest.approx(1024)
    for n in (256, 512):                                          # below it, recomputing wins
        assert model.recompute_s(n) < model.load_s("t", n)
    for n in (1024 + 16, 2048):                                   # above it, loading wins
        assert model.load_s("t", n) < model.recompute_s(n)
    assert model.load_s("t", 1024) == pytest.approx(model.recompute_s(1024))
    assert _model(load_s=0.4e-3, spill_s=0.4e-3, c=1e-7).crossover("t") == 0.0    # cheaper from the start
    assert _model(load_s=1.6e-3, spill_s=1.6e-3, c=0.0).crossover("t") == math.inf


def test_load_counts_the_blocks_the_turn_really_moved():
    model = _model(load_s=1e-3, spill_s=2e-3, c=0.0)
    assert model.load_s("t", 160) == pytest.approx(model.prefill.seconds(16, cached=160) + 10 * 3e-3)
    assert model.load_s("t", 160, loads=10, spills=11) == pytest.approx(model.load_s("t", 160) + 2e-3)
