"""The rejection sampler on its own: exact cases, and the distribution it emits.

Speculative sampling is lossless: every emitted token must be distributed as the target's own
sample, whatever the draft proposed. On a small vocabulary we draw drafts from q, verify them
against p, and test the emitted tokens with a chi-square test at a fixed seed, and the way vLLM
tests its sampler: as the number of samples grows, the empirical distribution converges to p, and
it is far closer to p than to q or to random distributions.
"""
import pytest
import torch

from workbench import SamplingParams
from workbench.sample.rejection import processed_probs, verify, verify_greedy, verify_sampled

V, K = 6, 3


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= statistic) with len(probs) - 1 degrees of freedom (gammaincc is the
    chi-square survival function: Q(df / 2, x / 2))."""
    n = counts.sum()
    expected = n * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


def random_dists(gen, rows, vocab=V, sharp=1.0):
    return torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * sharp, -1)


def run_many(p, q, n, seed, one_hot_drafts=None):
    """Emit n rounds; returns per position the counts of emitted tokens there, and how many
    drafts each round accepted."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(K + 1, V, dtype=torch.float64)
    accepted = []
    for _ in range(n):
        if one_hot_drafts is None:
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(K)]
            v = verify_sampled(p, drafts, q, gen)
        else:
            v = verify_sampled(p, one_hot_drafts, None, gen)
        for pos, tok in enumerate(v.token_ids):
            counts[pos, tok] += 1
        accepted.append(v.num_accepted)
    return counts, accepted


def test_greedy_accepts_the_longest_matching_prefix_then_the_argmax():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 7, 1, 9]):
        logits[row, best] = 5.0
    assert verify_greedy(logits, [3, 7, 1]).token_ids == [3, 7, 1, 9]       # all + bonus
    assert verify_greedy(logits, [3, 7, 1]).num_accepted == 3
    assert verify_greedy(logits, [3, 2, 1]).token_ids == [3, 7]             # first mismatch
    assert verify_greedy(logits, [0, 7, 1]).token_ids == [3]
    assert verify_greedy(logits[:1], []).token_ids == [3]


def test_a_draft_equal_to_the_target_is_always_accepted():
    gen = torch.Generator().manual_seed(0)
    p = random_dists(gen, K + 1)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(K)]
        assert verify_sampled(p, drafts, p[:K], gen).num_accepted == K


def test_a_draft_the_target_rules_out_is_always_rejected():
    gen = torch.Generator().manual_seed(1)
    p = random_dists(gen, K + 1)
    p[0, 2] = 0.0
    p[0] /= p[0].sum()
    for _ in range(200):
        v = verify_sampled(p, [2, 0, 0], None, gen)
        assert v.num_accepted == 0 and v.token_ids[0] != 2


@pytest.mark.parametrize("draft", ["sampled", "one_hot"])
def test_every_emitted_position_has_the_target_distribution(draft):
    gen = torch.Generator().manual_seed(2)
    p = random_dists(gen, K + 1)
    q = random_dists(gen, K, sharp=2.0)          # a poor draft: acceptance well below 1
    n = 8000
    likely = p[:K].argmax(-1).tolist()            # an n-gram draft that guesses well
    counts, accepted = run_many(p, q, n, seed=3,
                                one_hot_drafts=likely if draft == "one_hot" else None)
    rate = sum(accepted) / (K * n)
    print(f"\n{draft}: acceptance {rate:.3f}")
    assert 0.1 < rate < 0.9                       # both paths (accept, reject) are exercised
    for pos in range(K + 1):
        if counts[pos].sum() < 500:
            continue
        pv = chi2_pvalue(counts[pos], p[pos])
        print(f"position {pos}: {int(counts[pos].sum())} tokens, chi-square p-value {pv:.3f}")
        assert pv > 1e-3, (pos, counts[pos] / counts[pos].sum(), p[pos])
    # The acceptance probability of draft i is sum_x min(p_i(x), q_i(x)) (Leviathan et al.).
    if draft == "sampled":
        first = sum(a >= 1 for a in accepted) / n
        expected = torch.minimum(p[0], q[0]).sum().item()
        assert abs(first - expected) < 4 * (expected * (1 - expected) / n) ** 0.5


def test_empirical_distribution_converges_to_the_target_not_to_the_draft():
    """vLLM's style: the distance to p shrinks as samples grow, and at the largest n the
    empirical distribution is much closer to p than to q or to any of 50 random distributions."""
    gen = torch.Generator().manual_seed(4)
    p = random_dists(gen, K + 1)
    q = random_dists(gen, K, sharp=2.0)
    distances = []
    for n in (100, 1000, 8000):
        counts, _ = run_many(p, q, n, seed=n)
        emp = counts[0] / counts[0].sum()
        distances.append((emp - p[0]).abs().sum().item() / 2)
    assert distances[0] > distances[2] and distances[2] < 0.03
    to_q = (emp - q[0]).abs().sum().item() / 2
    to_random = min((emp - r).abs().sum().item() / 2 for r in random_dists(gen, 50))
    assert distances[2] < to_q / 3 and distances[2] < to_random / 3


def test_top_k_and_temperature_shape_the_target_distribution():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 2)
    params = SamplingParams(temperature=0.5, top_k=2)
    p = processed_probs(logits, params)
    assert torch.allclose(p[0, :2], torch.softmax(torch.tensor([8.0, 6.0]), -1))
    assert p[0, 2:].sum() == 0
    gen = torch.Generator().manual_seed(5)
    for _ in range(100):   # a draft outside the top-k is never kept, and never replaced by one
        v = verify(logits, [4], None, params, gen)
        assert v.num_accepted == 0 and v.token_ids[0] in (0, 1)
