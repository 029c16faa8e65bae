"""Lab 06 (speculative decoding): verify drafted tokens, greedily and by rejection sampling.

The references are the engine's own: `verify_greedy` and `verify_sampled` in
`workbench/sample/rejection.py`, and the residual distribution the sampler draws from after a
rejection (`workbench/spec/theory.py: residual`, the rule `verify_sampled` applies inline). Greedy
verification and the residual are compared exactly. Rejection sampling is random, so it is checked
on cases whose outcome is forced (probabilities 0 or 1) against `verify_sampled`, and otherwise by
what makes it correct: the emitted tokens follow the target's distribution p (a chi-square test),
and drafts pass at the rate sum_x min(p(x), q(x)) (a binomial test), both on a small vocabulary
with a seeded generator.
"""
from __future__ import annotations

import math
import random

import torch

from workbench.course.labs.core import Mismatch, call, exercise, expect_close, expect_equal
from workbench.sample.rejection import verify_greedy, verify_sampled
from workbench.spec.theory import residual as reference

CHAPTER = "06_speculative_decoding"


def _tokens(got, what: str) -> list[int]:
    """The learner's answer as a list of Python ints, or a Mismatch saying what to return."""
    if isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: returned a tensor {got!r:.80}; return a list of Python ints "
                       "(tensor.tolist() gives one)")
    if not isinstance(got, (list, tuple)):
        raise Mismatch(f"{what}: returned {type(got).__name__} {got!r:.80}; return a list of "
                       "token ids (Python ints)")
    out = []
    for t in got:
        if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_floating_point():
            t = int(t.item())        # a 0-d integer tensor is a token id too
        if isinstance(t, bool) or not isinstance(t, int):
            raise Mismatch(f"{what}: the answer holds {t!r:.60} ({type(t).__name__}); token ids "
                           "are Python ints (use int(...) or .item())")
        out.append(t)
    return out


# --------------------------------------------------------------------------- exercise 1
def _greedy_cases() -> list[tuple[torch.Tensor, list[int]]]:
    def one_hot_rows(best: list[int], vocab: int = 10) -> torch.Tensor:
        logits = torch.full((len(best), vocab), -5.0)
        for row, b in enumerate(best):
            logits[row, b] = 5.0
        return logits

    rows = one_hot_rows([3, 7, 1, 9])
    cases = [(rows, [3, 7, 1]),       # all three pass: bonus 9
             (rows, [3, 2, 1]),       # the second fails: correction 7 (and 1 no longer counts)
             (rows, [0, 7, 1]),       # the first fails: only the target's 3
             (rows, [3, 7, 4]),       # the last fails
             (rows[:1], []),          # no drafts: plain decoding
             (one_hot_rows([5, 5, 5]), [5, 6])]
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    for _ in range(30):
        k, vocab = rng.randint(0, 6), rng.choice([8, 12, 50])
        logits = torch.randn(k + 1, vocab, generator=gen) * 3
        best = logits.argmax(-1).tolist()
        a = rng.randint(0, k)
        drafts = best[:a]
        if a < k:
            drafts.append(rng.choice([t for t in range(vocab) if t != best[a]]))
            # After the mismatch, drafts that happen to match their rows again: they must not count.
            drafts += [best[i] if rng.random() < 0.5 else rng.randrange(vocab)
                       for i in range(a + 1, k)]
        cases.append((logits, drafts))
    return cases


def _greedy_hint(got: list[int], expected: list[int], best: list[int], drafts: list[int]) -> str:
    a, k = len(expected) - 1, len(drafts)
    if got == drafts[:a]:
        return ("after the accepted drafts, always add one token of the target's own: its argmax "
                "at the first mismatch, or the bonus token of the last row when all drafts passed.")
    if a == k and got == drafts:
        return ("every draft passed: the last row of the logits (row k) still gives a bonus token, "
                "so k + 1 tokens come out of one pass.")
    if a < k and got == drafts[:a] + [drafts[a]]:
        return ("at the first mismatch emit the target's choice (argmax of that row), not the "
                "rejected draft.")
    if got == best and a < k:
        return ("stop at the first mismatch: the rows after it scored a context that contained "
                "the rejected draft, so their argmax means nothing.")
    if len(got) > a + 1 and got[:a] == drafts[:a]:
        return ("stop at the first mismatch: a later draft that matches its row does not count, "
                "because that row assumed every earlier draft was right.")
    if k and len(best) > 1 and drafts[0] == best[1]:
        return ("row i of target_logits scores the token at draft position i: compare drafts[i] "
                "with the argmax of row i (row 0 scores drafts[0]).")
    return ""


@exercise("spec.verify_greedy", CHAPTER, "verify_greedy",
          "greedy verification: the longest matching prefix, then the target's token",
          hint="best = target_logits.argmax(-1).tolist(); count a while drafts[a] == best[a]; "
               "return drafts[:a] + [best[a]] (row a is the correction, or the bonus when a == k).")
def check_verify_greedy(verify_greedy_fn) -> None:
    for logits, drafts in _greedy_cases():
        best = logits.argmax(-1).tolist()
        what = (f"verify_greedy(target_logits with argmax per row {best}, drafts={drafts})")
        got = _tokens(call(verify_greedy_fn, what, logits.clone(), list(drafts)), what)
        expected = verify_greedy(logits, drafts).token_ids
        if got != expected:
            expect_equal(got, expected, what, _greedy_hint(got, expected, best, drafts))


# --------------------------------------------------------------------------- exercise 2
def _residual_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)

    def dist(v: int, sharp: float = 1.5, dtype=torch.float32) -> torch.Tensor:
        logits = torch.randn(v, generator=gen, dtype=torch.float64) * sharp
        return torch.softmax(logits, 0).to(dtype)

    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.2, 0.2, 0.5, 0.1])
    cases = [("the worked example", p, q)]
    for i in range(6):
        cases.append(("random p and q", dist(8), dist(8)))
    one_hot = torch.zeros(8)
    one_hot[3] = 1.0
    cases.append(("a deterministic draft (q one-hot at token 3)", dist(8), one_hot))
    same = dist(6)
    cases.append(("p == q", same, same.clone()))
    topk = dist(8)
    topk[[1, 4, 6]] = 0.0
    cases.append(("p after top-k (zeros) against a q that is positive everywhere",
                  topk / topk.sum(), dist(8)))
    cases.append(("disjoint supports", torch.tensor([0.6, 0.4, 0.0, 0.0]),
                  torch.tensor([0.0, 0.0, 0.3, 0.7])))
    cases.append(("p one-hot at token 1", torch.tensor([0.0, 1.0, 0.0]),
                  torch.tensor([0.3, 0.3, 0.4])))
    cases.append(("float64 inputs", dist(16, dtype=torch.float64), dist(16, dtype=torch.float64)))
    cases.append(("a large vocabulary", dist(1000, sharp=3.0), dist(1000, sharp=3.0)))
    return cases


def _fmt(t: torch.Tensor) -> str:
    if t.numel() > 8:
        return f"tensor of {t.numel()} probabilities"
    return "[" + ", ".join(f"{x:.3f}" for x in t.tolist()) + "]"


def _residual_hint(got: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> str:
    g, pd, qd = got.double(), p.double(), q.double()

    def near(a: torch.Tensor) -> bool:
        return bool(torch.allclose(g, a, atol=1e-5))

    raw = (pd - qd).clamp(min=0)
    if torch.isnan(g).any():
        return ("when p == q, max(0, p - q) is all zeros and its sum is 0: return p itself (a "
                "rejection never happens there, and the engine falls back to p).")
    if raw.sum() == 0 and not near(pd):
        return ("when p == q, max(0, p - q) is all zeros: return p itself (a rejection never "
                "happens there, and the engine falls back to p).")
    if near(raw):
        return "normalise: divide max(0, p - q) by its sum, so the residual sums to 1."
    if (g < -1e-7).any():
        return "clamp at zero: the residual is max(0, p - q), never negative."
    rev = (qd - pd).clamp(min=0)
    if rev.sum() > 0 and near(rev / rev.sum()):
        return ("p - q, not q - p: the residual holds the mass the target has and the draft "
                "lacks.")
    ab = (pd - qd).abs()
    if ab.sum() > 0 and near(ab / ab.sum()):
        return "clamp at zero instead of taking the absolute value: max(0, p - q), then normalise."
    if near(pd):
        return ("after a rejection the replacement comes from max(0, p - q), not from p: the "
                "accepted drafts already supplied min(p, q) of every token's probability.")
    return ""


@exercise("spec.residual", CHAPTER, "residual",
          "the residual distribution norm(max(0, p - q)) a rejection resamples from",
          hint="r = (p - q).clamp(min=0); return r / r.sum(), or p itself when r.sum() == 0 "
               "(p == q: a rejection cannot happen there).")
def check_residual(residual_fn) -> None:
    for name, p, q in _residual_cases():
        what = f"residual(p={_fmt(p)}, q={_fmt(q)}) ({name})"
        got = call(residual_fn, what, p.clone(), q.clone())
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what}: returned {type(got).__name__} {got!r:.80}; return a torch "
                           "tensor of probabilities with the shape of p")
        if not got.is_floating_point():
            raise Mismatch(f"{what}: returned a tensor of dtype {got.dtype}; probabilities are "
                           "floating point (keep p's dtype)")
        expected = reference(p, q)
        if tuple(got.shape) == tuple(expected.shape) and \
                torch.allclose(got.double(), expected.double(), atol=1e-5):
            continue
        if tuple(got.shape) != tuple(expected.shape):
            raise Mismatch(f"{what}: expected shape {tuple(expected.shape)}, got "
                           f"{tuple(got.shape)}",
                           "the residual is one probability per token: the shape of p.")
        expect_close(got, expected, f"{what}: expected {_fmt(expected)}, got "
                     f"{_fmt(got.detach())}", 1e-5, _residual_hint(got, p, q))


# --------------------------------------------------------------------------- exercise 3
V = 6
# A target p and a draft q over six tokens, per position (rows), chosen so that every typical
# mistake moves a statistic far outside its tolerance: the drafts pass at 55% and 63%.
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                  [0.05, 0.30, 0.10, 0.35, 0.12, 0.08],
                  [0.20, 0.10, 0.30, 0.10, 0.20, 0.10]])
Q = torch.tensor([[0.10, 0.15, 0.40, 0.05, 0.25, 0.05],
                  [0.30, 0.30, 0.05, 0.10, 0.05, 0.20]])
N_SAMPLED, N_ONE_HOT = 1500, 1000
NGRAM_DRAFTS = [1, 3]          # a deterministic proposal (q one-hot): pass with p(1), then p(3)
# A correct sampler fails a test only with probability ~1e-6 each (its own generator draws differ
# from the engine's, so it must be judged statistically): chi-square p-value below 1e-6, or an
# acceptance rate more than 5 standard deviations sqrt(a(1 - a)/n) from a (two-sided ~6e-7).
# The typical mistakes land at p-values below 1e-15 or 7 and more standard deviations away
# (measured on the wrong answers in tests/lab_solutions/spec.py and a few more).
P_VALUE, SIGMAS = 1e-6, 5.0


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= statistic), len(probs) - 1 degrees of freedom (gammaincc(df/2, x/2))."""
    counts, probs = counts.double(), probs.double()
    expected = counts.sum() * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64),
                                   stat / 2).item()


def _fmt_dist(d: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in d.tolist()) + "]"


def _exact_cases():
    """Cases whose outcome is forced: every acceptance has probability 0 or 1, and every token the
    verifier samples comes from a one-hot distribution."""
    gen = torch.Generator().manual_seed(4)
    soft = torch.softmax(torch.randn(3, V, generator=gen), -1)

    def one_hot(t: int) -> torch.Tensor:
        row = torch.zeros(V)
        row[t] = 1.0
        return row

    uniform = torch.full((V,), 1.0 / V)
    no_tok2 = torch.tensor([0.2, 0.2, 0.0, 0.2, 0.2, 0.2])
    bonus = ("When every draft passes, the last row of target_probs (row k) gives one more token: "
             "the bonus token.")
    return [
        ("q == p: every draft passes, then the bonus from the last row",
         torch.cat([soft, one_hot(4)[None]]), [0, 5, 2], soft.clone(),
         "with q == p, min(1, p(x)/q(x)) = 1: every draft passes (the acceptance probability is "
         "the ratio p(x)/q(x), not p(x)). " + bonus),
        ("the second draft has p = 0 there: rejected, and max(0, p - q) is one-hot at 2",
         torch.cat([soft[:1], one_hot(2)[None], one_hot(1)[None]]), [3, 5],
         torch.stack([soft[0], no_tok2]),
         "draft i is verified against row i of target_probs and of draft_probs (p_i, q_i): here "
         "p_1(5) = 0, so draft 5 is always rejected, and max(0, p_1 - q_1) is one-hot at 2."),
        ("the first draft has p = 0: rejected at once",
         torch.stack([one_hot(1), one_hot(0)]), [0], uniform[None].clone(),
         "p_0(0) = 0: the draft never passes, and max(0, p_0 - q_0) is positive only at token 1."),
        ("a deterministic proposal (draft_probs None) the target agrees with, then a mismatch",
         torch.stack([one_hot(3), one_hot(5), one_hot(0), one_hot(2)]), [3, 5, 1], None,
         "draft_probs None means q is one-hot at each draft: accept x with probability p(x), "
         "else sample from p with x removed."),
        ("a deterministic proposal the target agrees with entirely: bonus",
         torch.stack([one_hot(3), one_hot(5), one_hot(2)]), [3, 5], None,
         "draft_probs None means q is one-hot at each draft: accept x with probability p(x) "
         "(here 1). " + bonus),
        ("no drafts (k = 0), draft_probs of shape (0, vocab)", one_hot(4)[None], [],
         torch.zeros(0, V), "with no drafts, the one token comes from row 0 of target_probs, "
         "as the bonus does after k accepted drafts."),
        ("no drafts (k = 0), draft_probs None", one_hot(4)[None], [], None,
         "with no drafts, the one token comes from row 0 of target_probs, as the bonus does "
         "after k accepted drafts."),
    ]


def _describe(target: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
              rows: str | None = None) -> str:
    qs = "None" if q is None else f"{len(q)} rows"
    rows = rows or "; ".join(_fmt_dist(r) for r in target)
    return f"verify_sampled(target_probs rows {rows}, drafts={drafts}, draft_probs={qs}, generator)"


def _run_one(fn, target: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
             generator: torch.Generator, what: str) -> list[int]:
    """One learner call on copies (checking they are left as they were), its answer's shape."""
    t_in, q_in = target.clone(), None if q is None else q.clone()
    try:
        got = call(fn, what, t_in, list(drafts), q_in, generator)
    except Mismatch as m:
        if "multinomial" in m.message or "probability tensor" in m.message:
            raise Mismatch(m.message, "torch.multinomial needs non-negative weights with a "
                           "positive sum: clamp p - q at zero, and fall back to p when the "
                           "residual is all zeros.") from None
        raise
    if not torch.equal(t_in, target) or (q is not None and not torch.equal(q_in, q)):
        raise Mismatch(f"{what}: changed target_probs or draft_probs in place",
                       "clone a row before zeroing or subtracting in it (p[i].clone()): the "
                       "engine still needs the distributions after verification.")
    got = _tokens(got, what)
    k, a = len(drafts), len(got) - 1
    if any(not 0 <= t < target.shape[-1] for t in got):
        raise Mismatch(f"{what}: returned {got}; token ids index the vocabulary, 0 to "
                       f"{target.shape[-1] - 1}",
                       "return token ids (indices into a row of target_probs), not "
                       "probabilities or positions.")
    if not 1 <= len(got) <= k + 1:
        raise Mismatch(f"{what}: returned {got}, {len(got)} tokens; a verification emits 1 to "
                       f"k + 1 = {k + 1} tokens",
                       "return the accepted drafts, then exactly one token: the replacement at "
                       "the first rejection, or the bonus from the last row if all passed.")
    if got[:a] != list(drafts[:a]):
        raise Mismatch(f"{what}: returned {got}, which does not start with the accepted drafts",
                       "the emitted tokens are a prefix of the drafts (the accepted ones) then one "
                       "token; stop at the first rejection.")
    return got


def _check_replacement(got: list[int], drafts: list[int], what: str) -> None:
    """A draft is rejected only where p(x) < q(x), and the residual max(0, p - q) is 0 there: the
    replacement can never be the rejected draft itself."""
    a = len(got) - 1
    if got == list(drafts):
        raise Mismatch(f"{what}: returned {got}, the {len(drafts)} drafts and nothing after them",
                       "when every draft passes, the last row of target_probs (row k) still gives "
                       "a bonus token, k + 1 tokens in all; and if the last draft was rejected, "
                       "its replacement cannot be the draft itself (see the next hint).")
    raise Mismatch(f"{what}: returned {got}: draft {drafts[a]} at position {a} was rejected and "
                   "then emitted as its own replacement",
                   "a rejected draft x cannot come back: it was rejected because p(x) < q(x), "
                   "so max(0, p(x) - q(x)) = 0. Resample from the residual norm(max(0, p - q)), "
                   "not from p.")


def _acceptance_hint(rate: float, p: torch.Tensor, q: torch.Tensor) -> str:
    """Name the acceptance rule whose rate is nearest the measured one."""
    rules = {
        "accept when p(x) >= q(x) is deterministic; the rule is random: accept with probability "
        "min(1, p(x)/q(x)), i.e. when u < p(x)/q(x) for u uniform in [0, 1).":
            (q * (p >= q)).sum().item(),
        "accept with probability min(1, p(x)/q(x)), not p(x): a token the draft proposes often "
        "(large q(x)) must pass less often, or it comes out too often.": (q * p).sum().item(),
        "the ratio is p(x)/q(x), target over draft, not q(x)/p(x).":
            (q * torch.clamp(q / p, max=1)).sum().item(),
        "accept when u < p(x)/q(x), not when u > p(x)/q(x).":
            1 - torch.minimum(p, q).sum().item(),
    }
    nearest = min(rules, key=lambda h: abs(rules[h] - rate))
    return nearest if abs(rules[nearest] - rate) < 0.05 else ""


def _distribution_hint(freq: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> str:
    if q is None:
        return ("with draft_probs None (q one-hot at the draft x), a rejected x is replaced by a "
                "sample from p with x removed: max(0, p - one_hot(x)), normalised.")
    alpha = torch.minimum(p, q).sum()
    candidates = {
        "after a rejection, resample from norm(max(0, p - q)), not from p: accepted drafts already "
        "supplied min(p, q) of each token's probability.": torch.minimum(p, q) + (1 - alpha) * p,
        "after a rejection, resample from norm(max(0, p - q)), not from q.":
            torch.minimum(p, q) + (1 - alpha) * q,
    }
    nearest = min(candidates, key=lambda h: (candidates[h] - freq).abs().sum().item())
    return nearest if (candidates[nearest] - freq).abs().sum() < (p - freq).abs().sum() else ""


@exercise("spec.verify_sampled", CHAPTER, "verify_sampled",
          "rejection sampling: the emitted tokens follow the target, whatever the draft",
          hint="for each draft x at position i: u = torch.rand((), generator=generator); accept if "
               "u < p_i(x) / q_i(x) (q_i(x) = 1 when draft_probs is None); at the first rejection "
               "emit one token sampled (torch.multinomial, same generator) from "
               "norm(max(0, p_i - q_i)) and stop; if all pass, sample a bonus token from p_k.")
def check_verify_sampled(fn) -> None:
    P_ROWS = "; ".join(_fmt_dist(r) for r in P)      # formatted once: thousands of calls follow
    # 1. Forced outcomes, against the engine: a draft with p(x) >= q(x) always passes, one with
    # p(x) = 0 never does, and a one-hot distribution always gives its token.
    for name, target, drafts, q, hint in _exact_cases():
        what = f"{_describe(target, drafts, q)} ({name})"
        got = _run_one(fn, target, drafts, q, torch.Generator().manual_seed(0), what)
        expected = verify_sampled(target, drafts, q, torch.Generator().manual_seed(0)).token_ids
        expect_equal(got, expected, what, hint)

    # 2. Reproducible: a request's seed fixes its output, so every draw uses `generator`.
    drafts_g = torch.Generator().manual_seed(9)
    trial = [[int(torch.multinomial(Q[i], 1, generator=drafts_g)) for i in range(2)]
             for _ in range(40)]
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(123)
        runs.append([_run_one(fn, P, d, Q, g, _describe(P, d, Q, P_ROWS)) for d in trial])
    if runs[0] != runs[1]:
        raise Mismatch("the same 40 verifications with a generator seeded alike gave different "
                       "tokens",
                       "draw every random number from `generator` (torch.rand(..., "
                       "generator=generator), torch.multinomial(..., generator=generator)): a "
                       "request's seed must fix its output.")

    # 3. The distribution: drafts drawn from q, verified against p, N_SAMPLED times.
    g = torch.Generator().manual_seed(2024)
    draws = torch.stack([torch.multinomial(Q[i], N_SAMPLED, replacement=True, generator=drafts_g)
                         for i in range(2)], 1).tolist()
    runs = [(d, _run_one(fn, P, d, Q, g, _describe(P, d, Q, P_ROWS))) for d in draws]
    _check_statistics(runs, P, Q, "drafts sampled from q", P_ROWS)

    # 4. A deterministic proposal (an n-gram drafter): q is one-hot at the draft.
    what = _describe(P, NGRAM_DRAFTS, None, P_ROWS)
    runs = [(NGRAM_DRAFTS, _run_one(fn, P, NGRAM_DRAFTS, None, g, what))
            for _ in range(N_ONE_HOT)]
    one_hot_q = torch.zeros(2, V)
    one_hot_q[0, NGRAM_DRAFTS[0]] = one_hot_q[1, NGRAM_DRAFTS[1]] = 1.0
    _check_statistics(runs, P, one_hot_q, f"the fixed drafts {NGRAM_DRAFTS} with draft_probs None",
                      P_ROWS, one_hot=True)


def _check_statistics(runs, p, q, setting, p_rows, one_hot=False) -> None:
    """runs: (drafts, emitted tokens) of n verifications. First the acceptance rate (it names a
    wrong acceptance rule best), then each replacement, then the emitted tokens' distribution."""
    n = len(runs)
    counts = [[0] * V for _ in range(3)]     # python lists: indexing a tensor costs microseconds
    for _, got in runs:
        for pos, tok in enumerate(got):
            counts[pos][tok] += 1
    counts = torch.tensor(counts, dtype=torch.float64)
    alpha = torch.minimum(p[0], q[0]).sum().item()
    rate = sum(len(got) > 1 for _, got in runs) / n
    sigma = math.sqrt(alpha * (1 - alpha) / n)
    if abs(rate - alpha) > SIGMAS * sigma:
        hint = ("with draft_probs None, q is one-hot at the draft: accept x with probability "
                "p(x), i.e. when u < p(x)." if one_hot else _acceptance_hint(rate, p[0], q[0]))
        raise Mismatch(f"{setting}: the first draft passed {rate:.1%} of {n} times; the rule "
                       f"passes it with probability sum_x min(p(x), q(x)) = {alpha:.1%} "
                       f"(allowed: +-{SIGMAS * sigma:.1%}, {SIGMAS:g} standard deviations)", hint)
    for drafts, got in runs:
        a = len(got) - 1
        if a < len(drafts) and got[a] == drafts[a]:
            _check_replacement(got, drafts, _describe(p, drafts, None if one_hot else q, p_rows))
    # Each position's emitted token, given that all drafts before it passed, must follow p's row.
    labels = ["first emitted token", "second emitted token (when the first draft passed)",
              "bonus token (when both drafts passed)"]
    for pos in range(3):
        row = counts[pos]
        if row.sum() < 100:          # too few to test (does not happen with these p and q)
            continue
        pvalue = _chi2_pvalue(row, p[pos])
        if pvalue < P_VALUE:
            freq = row / row.sum()
            hint = (_distribution_hint(freq, p[pos], q[pos] if pos < 2 else None) if pos < 2
                    else "the bonus token is sampled from the last row of target_probs, p_k.")
            if pos == 1 and not hint:
                hint = ("position i is verified against row i of target_probs and draft_probs: "
                        "p_i and q_i, not row 0.")
            if one_hot and pos < 2:
                hint = _distribution_hint(freq, p[pos], None)
            raise Mismatch(f"{setting}: the {labels[pos]} over {int(row.sum())} verifications "
                           f"came out with frequencies {_fmt_dist(freq)}; it must follow the "
                           f"target p = {_fmt_dist(p[pos])} (chi-square p-value {pvalue:.1e}, "
                           f"allowed down to {P_VALUE:g})", hint)
