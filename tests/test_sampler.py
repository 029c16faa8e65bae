"""The sampler, tested the way vLLM tests its own: exact masks, and distributions that converge."""
import math

import torch
from hypothesis import given, settings, strategies as st

from workbench import SamplingParams
from workbench.sample.sampler import Sampler, apply_top_k_top_p


def empirical(logits, params, n=20000, seed=0):
    sampler = Sampler(seed)
    rows = logits.expand(n, -1)
    tokens = sampler(rows, [params] * n, [None] * n).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n


def total_variation(p, q):
    return 0.5 * (p - q).abs().sum().item()


def test_sampling_converges_to_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    for temperature in (0.5, 1.0, 2.0):
        target = torch.softmax(logits[0] / temperature, -1)
        freq = empirical(logits, SamplingParams(temperature=temperature))
        # With 20k draws the total variation of a 6-way distribution is ~0.01; 0.03 is 3x that.
        assert total_variation(freq, target) < 0.03


def test_top_k_and_top_p_sample_only_from_the_kept_renormalized_set():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0]])
    freq = empirical(logits, SamplingParams(temperature=1.0, top_k=3))
    target = torch.softmax(logits[0, :3], -1)
    assert freq[3:].sum() == 0 and total_variation(freq[:3], target) < 0.03
    probs = torch.softmax(logits[0], -1)  # 0.44, 0.27, 0.16, ...: top_p=0.6 keeps exactly 2
    freq = empirical(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert freq[2:].sum() == 0
    assert total_variation(freq[:2], probs[:2] / probs[:2].sum()) < 0.03


def test_greedy_is_argmax_and_ignores_seeded_generators():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    result = Sampler(0)(logits, [SamplingParams(temperature=0)] * 5, gens)
    assert result.token_ids == logits.argmax(-1).tolist()


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 64), top_k=st.integers(-1, 70),
       top_p=st.floats(0.01, 1.0), seed=st.integers(0, 10**6))
def test_masks_keep_the_argmax_and_the_right_amount_of_mass(vocab, top_k, top_p, seed):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    masked = apply_top_k_top_p(logits, top_k, top_p)
    kept = torch.isfinite(masked)
    assert kept[logits.argmax()]                       # the most likely token always survives
    assert torch.equal(masked[kept], logits[kept])     # survivors are untouched
    if 0 < top_k < vocab:
        assert kept.sum() <= top_k
    if top_p < 1.0 and top_k <= 0:
        probs = torch.softmax(logits, -1)
        kept_mass = probs[kept].sum().item()
        assert kept_mass >= top_p - 1e-6 or math.isclose(kept_mass, 1.0)
        # Minimal: dropping the least likely survivor would fall below top_p.
        if kept.sum() > 1:
            assert kept_mass - probs[kept].min().item() < top_p + 1e-6


def test_logprobs_are_log_softmax_of_the_raw_logits_with_ranks():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    result = Sampler(0)(logits, [SamplingParams(temperature=0, logprobs=2)], [None])
    chosen_lp, rank, top = result.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert result.token_ids == [1] and rank == 1
    assert math.isclose(chosen_lp, ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in top] == [1, 2]
