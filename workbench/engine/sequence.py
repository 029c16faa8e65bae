"""Sequence: one request's state as it moves through the engine.

A sequence owns its tokens (prompt then output), knows how many of them already have keys and values
in the KV cache (`num_computed_tokens`), and carries what the output processor accumulates (text,
logprobs, finish reason) and the timestamps that TTFT and TPOT are computed from.

A request with n > 1 (or best_of > 1) is a group: its first sequence is queued and prefills the
prompt; when its first token is sampled, the other members fork its blocks (sharing them, copy on
write) and each samples its own first token from the same logits. `members` lists the group on
its first sequence.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from workbench.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no blocks (new, or preempted to be recomputed)
    RUNNING = "running"      # holds blocks, gets tokens every step
    SWAPPED = "swapped"      # preempted; its blocks wait in CPU memory
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    priority: int = 0                         # lower runs first (vLLM's convention)
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None          # "stop" or "length"
    stop_reason: str | int | None = None      # the stop string or stop token that ended it
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding (spec/): tokens drafted for this step, not yet part of the output.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None    # (len(spec_token_ids), vocab) q, or None: one-hot
    num_lookahead: int = 0                    # drafts the scheduler made room for this step
    spec_proposed: int = 0                    # drafted tokens verified, over the whole request
    spec_accepted: int = 0                    # of those, accepted
    spec_accepted_at: list[int] = field(default_factory=list)   # accepted count per draft position
    spec_proposed_at: list[int] = field(default_factory=list)   # verified count per draft position
    spec_steps: int = 0                       # verification steps
    # Parallel sampling: the request's samples, on its first sequence (None for n = best_of = 1).
    index: int = 0                            # which sample of its request this sequence is
    members: list["Sequence"] | None = None
    forked: bool = False                      # the other members have taken the prompt's blocks
    # Logits processors that read the tokens so far (logits_processors.History).
    min_tokens_stop_ids: frozenset[int] = frozenset()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    grammar: object | None = None             # structured outputs: a structured.GrammarState

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def scheduled_tokens(self, start: int, n: int) -> list[int]:
        """The n tokens fed to the model from position `start`: cached tokens, then drafts."""
        tokens = self.token_slice(start, min(start + n, self.num_tokens))
        extra = start + n - self.num_tokens
        return tokens + self.spec_token_ids[:extra] if extra > 0 else tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def group_finished(self) -> bool:
        """Every sample of the request has finished (the sequence itself when it is alone)."""
        return all(m.is_finished for m in (self.members or [self]))

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) >= self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: priority first, then arrival (first come, first served)."""
        return (self.priority, self.arrival_time)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose keys and values are not in the cache yet: the next step's work."""
        return self.num_tokens - self.num_computed_tokens
