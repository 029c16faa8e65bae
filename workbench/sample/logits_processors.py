"""Logits processors: what changes a row of logits before temperature and sampling, with vLLM's
meanings, applied to the whole batch at once.

Order, as vLLM's sampler has it: logit_bias, then the bans (min_tokens holds end-of-sequence and
stop tokens back; bad_words forbids completing a banned word), then the penalties (repetition over
prompt and output; frequency and presence over the output). Temperature, min_p, top-k and top-p
follow in the sampler. Rows whose request sets none of these are neither copied nor touched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.sampling_params import SamplingParams


@dataclass
class History:
    """What a row's processors read: the request's tokens so far and its precomputed bans."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: frozenset[int] = frozenset()      # banned while len(output) < min_tokens
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


def add_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    """logits (..., vocab) + bias on the named tokens (a new tensor; the input is kept)."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias), device=logits.device)
    out = logits.clone()
    out[..., ids] += torch.tensor(list(bias.values()), dtype=out.dtype, device=out.device)
    return out


def banned_tokens(params: SamplingParams, history: History) -> list[int]:
    """Token ids this row may not produce next."""
    out = history.output_token_ids
    banned = list(history.stop_token_ids) if len(out) < params.min_tokens else []
    for word in history.bad_words_token_ids:
        prefix = word[:-1]
        if len(out) >= len(prefix) and tuple(out[len(out) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned


def _token_matrix(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """(len(rows), vocab) counts of each token id per row."""
    counts = torch.zeros(len(rows), vocab, device=device)
    flat = [t for r in rows for t in r]
    if flat:
        row_idx = torch.tensor([i for i, r in enumerate(rows) for _ in r], device=device)
        counts.index_put_((row_idx, torch.tensor(flat, device=device)),
                          torch.ones(len(flat), device=device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[History]) -> torch.Tensor:
    """Repetition, frequency and presence penalties for every row at once (logits: (rows, vocab),
    changed in place and returned)."""
    vocab, device = logits.shape[-1], logits.device
    output_counts = _token_matrix([h.output_token_ids for h in histories], vocab, device)
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if (rep != 1).any():
        seen = _token_matrix([h.prompt_token_ids for h in histories], vocab, device) > 0
        seen |= output_counts > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - freq * output_counts - pres * (output_counts > 0)


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   histories: list[History | None]) -> torch.Tensor:
    """The batch's logits after each row's processors: `logits` itself when no row has any,
    else a copy (the raw logits stay for logprobs, which vLLM reports unprocessed)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, h = params[i], histories[i]
        if p.logit_bias:
            logits[i] = add_logit_bias(logits[i], p.logit_bias)
        if h is not None:
            banned = banned_tokens(p, h)
            if banned:
                logits[i, banned] = float("-inf")
    penalized = [i for i in rows if params[i].uses_history and histories[i] is not None
                 and (params[i].repetition_penalty != 1 or params[i].presence_penalty
                      or params[i].frequency_penalty)]
    if penalized:
        idx = torch.tensor(penalized, device=logits.device)
        logits[idx] = apply_penalties(logits[idx], [params[i] for i in penalized],
                                      [histories[i] for i in penalized])
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens whose probability is below min_p times the top token's, on
    tempered logits (min-p sampling, Nguyen et al., arXiv 2407.01082)."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
