"""What `LLM.generate` returns: vLLM's `RequestOutput` / `CompletionOutput` shapes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None           # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) and the latencies derived from them."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_output_tokens: int = 0
    # Speculative decoding (zeros without it).
    num_spec_steps: int = 0               # verification steps (target passes with drafts)
    num_draft_tokens: int = 0             # drafted tokens verified
    num_accepted_tokens: int = 0          # of those, accepted
    accepted_per_position: list[float] = field(default_factory=list)   # acceptance rate of the
    #                                       i-th draft of a step, over the steps that had one

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification step: accepted drafts + the one token the target adds."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps

    @property
    def ttft(self) -> float | None:
        """Time to first token: queueing plus prefill."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: the decode speed a user feels."""
        if self.num_output_tokens < 2 or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None            # "stop", "length", or None while running
    stop_reason: str | int | None = None  # the stop string / token id that matched, if any
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None


@dataclass
class StreamChunk:
    """One piece of a streamed generation: the text and tokens that are new since the last chunk."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = field(default=None, repr=False)  # set on the last chunk
