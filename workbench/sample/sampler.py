"""Sampler: from one row of logits per sequence to one next token per sequence.

Order of operations, the same as vLLM: the logits processors (logit_bias, min_tokens, bad_words,
penalties: logits_processors.py), then temperature scales the logits, min-p drops the tokens far
below the top one, top-k keeps the k largest, top-p keeps the smallest prefix of the sorted
distribution whose mass reaches p, and one token is drawn. Greedy rows (temperature 0) take the
argmax of the processed logits. Returned logprobs are those of the model's own distribution
(log-softmax of the raw logits), as in vLLM.

Reproducibility: a request with a `seed` draws from its own `torch.Generator`, so its tokens do not
depend on which other requests share the batch; requests without one share the engine's generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.sample.grammar import apply_bitmask
from workbench.sample.logits_processors import History, apply_min_p, process_logits
from workbench.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, its rank, [(token_id, logprob), ...top-n]) or None.
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k and top-p remove from one row of logits."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Remove a token when the mass *before* it already reaches top_p; the first always stays.
        remove = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def top_logprobs(logprobs_row: torch.Tensor, chosen: int, n: int):
    """The chosen token's logprob and rank (1 = most likely), plus the n most likely tokens."""
    chosen_lp = logprobs_row[chosen].item()
    rank = int((logprobs_row > chosen_lp).sum().item()) + 1
    top = []
    if n > 0:
        values, ids = torch.topk(logprobs_row, n)
        top = list(zip(ids.tolist(), values.tolist()))
    return chosen_lp, rank, top


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: list[History | None] | None = None,
                 bitmask: torch.Tensor | None = None,
                 masked_rows: list[int] = ()) -> SampleResult:
        """logits: (num_seqs, vocab) fp32, one row per sequence that needs a token. histories:
        per row, the tokens its penalties and bans read (None where the request has none).
        bitmask, masked_rows: structured outputs' allowed tokens (sample/grammar.py) for the
        rows that have a grammar."""
        processed = process_logits(logits, params, histories or [None] * len(params))
        if masked_rows:
            processed = self._mask(logits, processed, bitmask, masked_rows)
        token_ids = processed.argmax(dim=-1).tolist()  # greedy for every row; sampled overwrite
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = apply_min_p(processed[i] / p.temperature, p.min_p)
            row = apply_top_k_top_p(row, p.top_k, p.top_p)
            probs = row.softmax(-1).to("cpu")
            gen = generators[i] or self.generator
            token_ids[i] = int(torch.multinomial(probs, 1, generator=gen).item())
        logprobs = [None] * len(params)
        # best_of ranks samples by cumulative logprob, so it needs the chosen token's at least.
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None or p.ranks_samples]
        if wanted:
            lps = torch.log_softmax(logits[wanted], dim=-1).cpu()
            for j, i in enumerate(wanted):
                logprobs[i] = top_logprobs(lps[j], token_ids[i], params[i].logprobs or 0)
        return SampleResult(token_ids, logprobs)

    @staticmethod
    def _mask(logits, processed, bitmask, rows) -> torch.Tensor:
        """The grammar's mask on top of the processors. Where bans (min_tokens, bad_words) and
        grammar together allow nothing, the grammar wins: its output must stay valid."""
        if processed is logits:
            processed = logits.clone()
        apply_bitmask(processed, bitmask, rows)
        dead = [r for r in rows if torch.isinf(processed[r]).all()]
        if dead:
            processed[dead] = logits[dead]
            apply_bitmask(processed, bitmask, dead)
        return processed
