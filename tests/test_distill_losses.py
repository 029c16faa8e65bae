"""The distillation losses against their definitions and their known limits, and the shared
training loop's resumption."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from workbench.compress import losses as L
from workbench.compress.trainer import LoopConfig, lr_factor, train


def _pair(seed=0, n=6, vocab=11):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    teacher = torch.randn(n, vocab, generator=g, dtype=torch.float64).log_softmax(-1)
    return student, teacher


def test_forward_kl_is_torchs_kl_div_and_scales_with_t_squared():
    s, t = _pair()
    ref = F.kl_div(s.log_softmax(-1), t, log_target=True, reduction="batchmean")
    torch.testing.assert_close(L.forward_kl(s, t), ref)
    soft = F.kl_div((s / 2).log_softmax(-1), (t / 2).log_softmax(-1), log_target=True,
                    reduction="batchmean")
    torch.testing.assert_close(L.forward_kl(s, t, temperature=2.0), 4 * soft)


def test_reverse_kl_swaps_the_arguments():
    s, t = _pair(1)
    ref = F.kl_div(t, s.log_softmax(-1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(L.reverse_kl(s, t), ref)
    assert abs(L.reverse_kl(s, t) - L.forward_kl(s, t)) > 0.01   # not symmetric


def test_generalized_jsd_tends_to_forward_and_reverse_kl_at_its_ends():
    s, t = _pair(2)
    eps = 1e-4
    torch.testing.assert_close(L.generalized_jsd(s, t, eps) / eps, L.forward_kl(s, t), rtol=2e-3, atol=0)
    torch.testing.assert_close(L.generalized_jsd(s, t, 1 - eps) / eps, L.reverse_kl(s, t),
                               rtol=2e-3, atol=0)


def test_generalized_jsd_is_bounded_zero_at_equality_and_symmetric_at_one_half():
    s, t = _pair(3)
    far = 30 * s
    assert 0 < L.generalized_jsd(far, t) <= math.log(2) + 1e-6
    assert L.generalized_jsd(t.clone(), t).abs() < 1e-6
    # at beta = 1/2 swapping the two distributions leaves it unchanged
    torch.testing.assert_close(L.generalized_jsd(s, t), L.generalized_jsd(t, s.log_softmax(-1)))


def test_gradients_reach_the_student_only():
    s, t = _pair(4)
    for fn in (L.forward_kl, L.reverse_kl, L.generalized_jsd):
        x = s.clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda z: fn(z, t), (x,))


def test_a_bad_beta_is_named():
    s, t = _pair()
    with pytest.raises(ValueError, match="^beta=1.0 "):
        L.generalized_jsd(s, t, 1.0)


def test_the_learning_rate_warms_up_then_decays_to_a_tenth():
    steps = 100
    factors = [lr_factor(s, steps) for s in range(steps + 1)]
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0, abs=0.01)
    assert all(a >= b for a, b in zip(factors[5:], factors[6:]))
    assert factors[-1] == pytest.approx(0.1)


def _toy_run(tmp_path, steps, stop_at=None, resume=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 4, generator=g), torch.randn(10, 1, generator=g)

    def batch_loss(batch, step):
        if step == stop_at:
            raise KeyboardInterrupt
        return F.mse_loss(model(x[batch]), y[batch]), len(batch)

    cfg = LoopConfig(steps=steps, batch_size=3, lr=0.05, eval_every=2, seed=5, checkpoint_every=2)
    history = train(model, [{"params": list(model.parameters())}], len(x), batch_loss,
                    lambda: {"mse": F.mse_loss(model(x), y).item()}, cfg, log=lambda m: None,
                    checkpoint=tmp_path / "state.pt", resume=resume)
    return model, history


def test_an_interrupted_run_resumes_to_the_same_weights_and_history(tmp_path):
    straight, history = _toy_run(tmp_path / "a", 7)
    with pytest.raises(KeyboardInterrupt):
        _toy_run(tmp_path / "b", 7, stop_at=5)        # the last checkpoint is step 4's
    resumed, history_b = _toy_run(tmp_path / "b", 7, resume=True)
    assert torch.equal(straight.weight, resumed.weight) and torch.equal(straight.bias, resumed.bias)
    assert history == history_b and [h["step"] for h in history] == [0, 2, 4, 6, 7]
    assert history[-1]["mse"] < history[0]["mse"]
