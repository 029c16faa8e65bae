"""Beam search on the paged engine: beams are sequences that share blocks through fork.

transformers' algorithm (generate(num_beams=W), do_sample=False), step by step for each prompt:

    every live beam b decodes one token; its log-softmax row gives candidates
        score(b, t) = score(b) + log p(t | beam b)
    keep the K = max(2, 1 + #eos) * W best candidates over all beams (each beam's K best suffice:
        the engine returns them as top logprobs)
    of the first W, those ending in EOS (or at max_tokens) become finished hypotheses, ranked by
        score / generated_len ** length_penalty; the W best hypotheses are kept
    the first W candidates that did not end become the next beams: the first candidate drawn
        from a beam replaces that beam's last token in place, every further one forks it (the new
        beam shares all its blocks; the partly filled last block is copied on write); beams no
        candidate came from are aborted and give their blocks back
    stop when every candidate ended (max_tokens), or when W hypotheses are finished and the best
        live beam, length-normalized now, cannot beat the worst of them (transformers'
        early_stopping=False heuristic)

The replaced last token has no K/V yet (the engine computes a token's K/V when it feeds it, one
step after sampling it), so rewriting it costs nothing. Beams never draft (speculation off).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from workbench.sampling_params import SamplingParams
from workbench.engine.sequence import Sequence, SequenceStatus


@dataclass
class BeamSearchParams:
    """vLLM's names. length_penalty: hypotheses are ranked by cum_logprob / len ** length_penalty
    (len = generated tokens, EOS included); ignore_eos: EOS does not end a hypothesis."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid: it must be an integer >= 1")
        if self.temperature != 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: beam search keeps the "
                             "most likely beams (0); sample with SamplingParams(n=...) instead")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp:
            raise ValueError(f"length_penalty={lp!r} is invalid: it must be a number")


@dataclass
class BeamSearchSequence:
    token_ids: list[int]           # generated tokens (EOS included when it ended the hypothesis)
    text: str
    cum_logprob: float
    score: float                   # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str             # "stop" (EOS) or "length" (max_tokens)


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]    # beam_width hypotheses, best first


@dataclass
class _Beam:
    seq: Sequence
    score: float                   # cumulative logprob of seq.output_token_ids


@dataclass
class _Search:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    can_improve: bool = True
    done: bool = False


def beam_search(engine, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    width = params.beam_width
    if width > engine.config.max_num_seqs:
        raise ValueError(f"beam_width={width} is invalid: the beams run together, at most "
                         f"max_num_seqs={engine.config.max_num_seqs}")
    eos = engine.output_processor.eos_token_ids
    keep = max(2, 1 + len(eos)) * width
    sp = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                        logprobs=keep, num_speculative_tokens=0)
    for p in prompts:                  # everything is checked before anything is queued
        _, ids = engine.tokenize(p)
        if len(ids) + params.max_tokens > engine.plan.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} is invalid for a prompt of "
                             f"{len(ids)} tokens: together they exceed max_model_len="
                             f"{engine.plan.max_model_len}")
    searches: list[_Search] = []
    try:
        for p in prompts:
            rid = engine.add_request(p, sp)
            seq = engine.get_sequence(rid)
            searches.append(_Search(rid, seq.prompt, list(seq.prompt_token_ids),
                                    [_Beam(seq, 0.0)]))
        step = 0
        while not all(s.done for s in searches):
            step += 1
            while any(len(b.seq.output_token_ids) < step and not b.seq.is_finished
                      for s in searches if not s.done for b in s.beams):
                engine.step()
            for s in searches:
                if not s.done:
                    _select(engine, s, step, keep, width, eos, params)
        return [BeamSearchOutput(s.prompt, s.prompt_token_ids, s.finished) for s in searches]
    finally:
        for s in searches:
            for b in s.beams:
                if engine.get_sequence(b.seq.request_id) is not None:
                    engine.abort_request(b.seq.request_id)


def _select(engine, s: _Search, step: int, keep: int, width: int, eos: set[int],
            params: BeamSearchParams) -> None:
    candidates = []
    for i, beam in enumerate(s.beams):
        if len(beam.seq.output_token_ids) < step:     # ended by the engine (pool too small)
            continue
        entries = sorted(beam.seq.logprobs[-1].items(), key=lambda kv: -kv[1].logprob)[:keep]
        candidates += [(beam.score + lp.logprob, i, t) for t, lp in entries]
    candidates = sorted(candidates, key=lambda c: -c[0])[:keep]
    ends = [(t in eos and not params.ignore_eos) or step >= params.max_tokens
            for _, _, t in candidates]
    if s.can_improve:
        for (score, i, t), end in list(zip(candidates, ends))[:width]:
            if end:
                tokens = s.beams[i].seq.output_token_ids[:-1] + [t]
                s.finished.append(BeamSearchSequence(
                    tokens, engine.output_processor.decode(tokens), score,
                    score / step ** params.length_penalty,
                    "length" if t not in eos or params.ignore_eos else "stop"))
        s.finished = sorted(s.finished, key=lambda h: -h.score)[:width]
    going = [c for c, end in zip(candidates, ends) if not end][:width]
    if not going:
        s.done = True
        return
    s.beams = _regroup(engine, s, going)
    if len(s.finished) == width:
        best = s.beams[0].score / step ** params.length_penalty
        s.can_improve = best > s.finished[-1].score
    s.done = not s.can_improve


def _regroup(engine, s: _Search, going: list[tuple[float, int, int]]) -> list[_Beam]:
    """The next beams: in place for the first candidate of a beam, a fork for each further one;
    beams without a candidate are aborted."""
    claimed, beams = set(), []
    for score, i, t in going:
        parent = s.beams[i].seq
        if i in claimed:
            seq = fork_sequence(engine, parent, f"{s.request_id}.beam{next(_fork_ids)}")
        else:
            claimed.add(i)
            seq = parent
        beams.append((_Beam(seq, score), t))
    for beam, t in beams:              # after the forks: they copy the parent's tokens
        beam.seq.output_token_ids[-1] = t
    for i, beam in enumerate(s.beams):
        if i not in claimed:
            engine.abort_request(beam.seq.request_id)
    return [b for b, _ in beams]


_fork_ids = itertools.count()


def fork_sequence(engine, parent: Sequence, child_id: str) -> Sequence:
    """A copy of `parent` that shares all its blocks; a preempted parent holds none, and its copy
    waits to be recomputed like it."""
    if child_id in engine._sequences:
        raise ValueError(f"request_id={child_id!r} is invalid: it is already in use")
    child = Sequence(child_id, parent.prompt, parent.prompt_token_ids, parent.params,
                     arrival_time=parent.arrival_time, priority=parent.priority)
    child.output_token_ids = list(parent.output_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    child.logprobs = list(parent.logprobs) if parent.logprobs is not None else None
    child.cumulative_logprob = parent.cumulative_logprob
    child.first_scheduled_time, child.first_token_time = (parent.first_scheduled_time,
                                                          parent.first_token_time)
    child.last_token_time = parent.last_token_time
    engine._sequences[child_id] = child
    for scheduler in engine.schedulers:
        if parent in scheduler.running:
            engine.blocks.fork(parent.request_id, child_id)
            child.status = SequenceStatus.RUNNING
            scheduler.running.append(child)
            return child
    child.num_computed_tokens = 0
    engine.scheduler.add(child)
    return child
