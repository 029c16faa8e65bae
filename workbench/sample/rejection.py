"""Verification of drafted tokens: the rejection sampler of Leviathan et al. (arXiv 2211.17192)
and Chen et al. (arXiv 2302.01318), and the argmax-match rule for greedy requests.

The target has scored k drafted tokens d_1..d_k in one forward pass, which gives k + 1 next-token
distributions p_1..p_{k+1} (p_i conditions on the prefix and d_1..d_{i-1}). The drafter sampled
d_i from q_i. Walk the drafts in order:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
    on the first rejection, emit one token from norm(max(0, p_i - q_i)) and stop
    if all k are accepted, emit a bonus token from p_{k+1}

Every emitted token is then distributed exactly as if the target had sampled it alone: the accepted
part has probability q(x) min(1, p(x)/q(x)) = min(q(x), p(x)), the residual supplies the missing
p(x) - min(q(x), p(x)) = max(0, p(x) - q(x)). A drafter that proposes deterministically (n-gram
lookup) has q_i = one-hot(d_i): accept with probability p_i(d_i), else sample from p_i with d_i
removed. Greedy requests accept while d_i equals argmax p_i and take the argmax at the first
mismatch (or after the last draft), so their output equals greedy decoding without speculation.

p is the *processed* target distribution (temperature, top-k, top-p applied, sampler.py), and q
must be the distribution the drafter actually sampled from, processed with the same parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.sample.logits_processors import add_logit_bias, apply_min_p
from workbench.sample.sampler import apply_top_k_top_p
from workbench.sampling_params import SamplingParams


@dataclass
class Verified:
    token_ids: list[int]      # accepted drafts, then one recovered or bonus token
    num_accepted: int         # how many drafts were kept (0..k)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(rows, vocab) fp32 probabilities after temperature, min-p, top-k and top-p, one row at a
    time as the sampler does (logit_bias is already in the logits: verify adds it)."""
    rows = [apply_top_k_top_p(apply_min_p(row / params.temperature, params.min_p), params.top_k,
                              params.top_p) for row in logits.float()]
    return torch.stack(rows).softmax(-1)


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> Verified:
    """target_logits: (k + 1, vocab). Accept the longest prefix of drafts that the target's argmax
    reproduces, then the target's own argmax."""
    best = target_logits.argmax(-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return Verified(drafts[:a] + [best[a]], a)


def verify_sampled(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> Verified:
    """target_probs: (k + 1, vocab) processed target distributions; draft_probs: (k, vocab) the
    distributions the drafts were sampled from, or None for a deterministic proposal."""
    p = target_probs.float().cpu()
    q = None if draft_probs is None else draft_probs.float().cpu()
    for i, x in enumerate(drafts):
        q_x = 1.0 if q is None else q[i, x].item()
        u = torch.rand((), generator=generator).item()
        if q_x > 0 and p[i, x].item() >= u * q_x:       # min(1, p/q) without dividing by 0
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_(min=0.0)
        if residual.sum() <= 0:          # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        token = int(torch.multinomial(residual, 1, generator=generator).item())
        return Verified(drafts[:i] + [token], i)
    bonus = int(torch.multinomial(p[len(drafts)], 1, generator=generator).item())
    return Verified(list(drafts) + [bonus], len(drafts))


def verify(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator) -> Verified:
    """Requests whose logits depend on the tokens so far (penalties, bans) are never drafted
    for (scheduler.py), so one bias for all k + 1 rows is exact."""
    target_logits = add_logit_bias(target_logits, params.logit_bias)
    if params.greedy:
        return verify_greedy(target_logits, drafts)
    return verify_sampled(processed_probs(target_logits, params), drafts, draft_probs, generator)
