"""The sampling half of a step: from the forward pass's logits rows to the tokens each sequence
appends. Plain sequences go through the sampler together (grammar masks applied to their rows);
a sequence that drafted k tokens has k + 1 rows, which verification turns into the accepted drafts
plus one token. Samples of one request fork from it at its first token and share its row.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.engine.sequence import Sequence, SequenceStatus
from workbench.kv.block_manager import BlockManager
from workbench.sample.grammar import GrammarCompiler, apply_bitmask
from workbench.sample.logits_processors import History
from workbench.sample.rejection import verify
from workbench.sample.sampler import Sampler, top_logprobs


def rows_of(sampled: list[Sequence]) -> list[int]:
    """The first logits row of each sampled sequence (1 + its drafts rows each)."""
    rows, r = [], 0
    for seq in sampled:
        rows.append(r)
        r += 1 + len(seq.spec_token_ids)
    return rows


def fork_groups(blocks: BlockManager, scheduler, sampled: list[Sequence], logits: torch.Tensor):
    """Groups sampling their first token: the other members share the prompt's blocks now and
    draw from the same logits row. Returns the logits with those rows appended, and the new
    members (they run from the next step on)."""
    first_row = dict(zip(map(id, sampled), rows_of(sampled)))
    extra, forked = [], []
    for seq in sampled:
        if not seq.members or seq.forked:
            continue
        seq.forked = True
        for child in seq.members[1:]:
            blocks.fork(seq.request_id, child.request_id)
            child.num_computed_tokens = seq.num_prompt_tokens
            child.first_scheduled_time = seq.first_scheduled_time
            child.status = SequenceStatus.RUNNING
            scheduler.running.append(child)
            extra.append(first_row[id(seq)])
            forked.append(child)
    if extra:
        logits = torch.cat([logits, logits[extra]])
    return logits, forked


class StepSampler:
    def __init__(self, sampler: Sampler, grammars: Callable[[], GrammarCompiler]):
        """grammars: the processor's compiler, built only when a request uses one."""
        self.sampler, self.grammars = sampler, grammars

    def __call__(self, sampled: list[Sequence], logits: torch.Tensor):
        """Per sampled sequence: (tokens to append, their logprob infos, drafts accepted)."""
        rows = rows_of(sampled)
        results = [None] * len(sampled)
        plain = [j for j, s in enumerate(sampled) if not s.spec_token_ids]
        if plain:
            picked = [rows[j] for j in plain]
            # Without drafts the rows are already in order: indexing would copy every logit
            # (batch x vocab fp32 each step) for nothing.
            in_order = picked == list(range(len(logits)))
            bitmask, masked = self._grammar_masks([sampled[j].grammar for j in plain])
            sample = self.sampler(logits if in_order else logits[picked],
                                  [sampled[j].params for j in plain],
                                  [sampled[j].generator for j in plain],
                                  [history(sampled[j]) for j in plain], bitmask, masked)
            for m, j in enumerate(plain):
                results[j] = ([sample.token_ids[m]], [sample.logprobs[m]], 0)
        for j, seq in enumerate(sampled):
            if results[j] is None:
                results[j] = self._verify(seq, logits[rows[j]:rows[j] + len(seq.spec_token_ids) + 1])
        return results

    def _verify(self, seq: Sequence, block: torch.Tensor):
        target = self._mask_drafts(seq, block) if seq.grammar is not None else block
        v = verify(target, seq.spec_token_ids, seq.spec_probs, seq.params,
                   seq.generator or self.sampler.generator)
        infos = [None] * len(v.token_ids)
        if seq.params.logprobs is not None:
            lps = torch.log_softmax(block, dim=-1).cpu()
            infos = [top_logprobs(lps[t], tok, seq.params.logprobs)
                     for t, tok in enumerate(v.token_ids)]
        return v.token_ids, infos, v.num_accepted

    def _grammar_masks(self, grammars: list) -> tuple[torch.Tensor | None, list[int]]:
        """One bitmask row per sampled row; filled for the rows whose request has a grammar."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None, []
        bitmask = self.grammars().allocate_bitmask(len(grammars))
        for i in rows:
            grammars[i].fill_bitmask(bitmask, i)
        return bitmask, rows

    def _mask_drafts(self, seq: Sequence, block: torch.Tensor) -> torch.Tensor:
        """The k + 1 target rows of a drafted sequence under its grammar: row i's mask is the
        grammar's after drafts 1..i, so the state walks the drafts and then rolls back. A draft
        the grammar refuses ends the walk: its row gives it probability 0, so verification
        rejects it there and never reads the rows after."""
        bitmask = self.grammars().allocate_bitmask(block.shape[0])
        walked, rows = 0, []
        for i in range(block.shape[0]):
            seq.grammar.fill_bitmask(bitmask, i)
            rows.append(i)
            if i == len(seq.spec_token_ids) or not seq.grammar.accept(seq.spec_token_ids[i]):
                break
            walked += 1
        seq.grammar.rollback(walked)
        block = block.clone()
        apply_bitmask(block, bitmask, rows)
        return block


def history(seq: Sequence) -> History | None:
    if not seq.params.uses_history:
        return None
    return History(seq.prompt_token_ids, seq.output_token_ids, seq.min_tokens_stop_ids,
                   seq.bad_words_token_ids)


def record_speculation(seq: Sequence, drafted: int, accepted: int) -> None:
    seq.spec_steps += 1
    seq.spec_proposed += drafted
    seq.spec_accepted += accepted
    grow = drafted - len(seq.spec_proposed_at)
    if grow > 0:
        seq.spec_proposed_at += [0] * grow
        seq.spec_accepted_at += [0] * grow
    for p in range(drafted):
        seq.spec_proposed_at[p] += 1
        seq.spec_accepted_at[p] += p < accepted
