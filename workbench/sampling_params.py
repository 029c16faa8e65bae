"""SamplingParams: how one request is decoded, validated once at construction.

The names and meanings follow vLLM's `SamplingParams`, so code written against the workbench carries
over. Every invalid value raises a ValueError that names the field, the value and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Decoding settings for one request.

    temperature: 0 means greedy (argmax); > 0 divides the logits before softmax.
    top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches top_p; 1 = off.
    top_k: keep the k most likely tokens; -1 or 0 = off (vLLM uses -1, transformers 0).
    max_tokens: how many tokens to generate at most (finish_reason "length" when reached).
    stop: strings that end the output; the stop string itself is not returned.
    stop_token_ids: token ids that end the output, in addition to the model's end-of-sequence token.
    seed: makes this request's sampling reproducible, whatever else is in the batch.
    ignore_eos: keep generating past the end-of-sequence token (benchmarks use this).
    logprobs: return the log-probability of each sampled token and of the `logprobs` most likely ones.
    prompt_logprobs: the same for every prompt token (the first has none: nothing predicts it).
    num_speculative_tokens: with speculative decoding on, this request's k (None: the engine's;
        0: no speculation for this request). The output distribution does not depend on it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_speculative_tokens: int | None = None
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature={self.temperature!r} is invalid: it must be a number >= 0 "
                             "(0 means greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: it must be in (0, 1] (1 disables it)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} is invalid: it must be a positive integer, "
                             "or -1 or 0 to disable it")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} is invalid: it must be an integer >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name}={value!r} is invalid: it must be None or an integer >= 0 "
                                 "(how many top alternatives to return besides the chosen token)")
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 16):
            raise ValueError(f"num_speculative_tokens={k!r} is invalid: it must be None (the "
                             "engine's setting) or an integer in [0, 16] (0: no speculation)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be None or an integer")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop={self.stop!r} is invalid: stop strings must be non-empty str")
        self.stop_list = stop
        ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is invalid: "
                             "it must be a list of token ids >= 0")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
