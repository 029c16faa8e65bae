"""SamplingParams: how one request is decoded, validated once at construction.

The names and meanings follow vLLM's `SamplingParams`, so code written against the workbench carries
over. Every invalid value raises a ValueError that names the field, the value and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from workbench.structured.params import StructuredOutputsParams


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
    n: how many outputs to return for the prompt. The prompt is prefilled once and the samples
        share its KV blocks (copy-on-write); with a seed, sample i draws from seed + i.
    best_of: generate this many samples (>= n) and return the n with the highest cumulative
        logprob; None means n.
    presence_penalty: subtracted from the logit of every token that already appears in the output
        (> 0 discourages repeats, < 0 encourages them); in [-2, 2].
    frequency_penalty: subtracted once per earlier occurrence in the output; in [-2, 2].
    repetition_penalty: the CTRL / transformers penalty over prompt and output tokens: a positive
        logit is divided by it, a negative one multiplied; > 0, 1 = off.
    min_p: drop tokens whose probability is below min_p times the top token's; in [0, 1], 0 = off.
    logit_bias: {token_id: bias} added to the logits before anything else; bias in [-100, 100].
    min_tokens: end-of-sequence and stop_token_ids cannot end the output before this many tokens.
    bad_words: words that are never generated: the last token of each word's tokenization is
        banned whenever the output ends with the tokens before it.
    structured_outputs: StructuredOutputsParams (or a dict of its fields): the output must match
        a JSON schema, a regex, a choice or a grammar; a token bitmask from xgrammar masks every
        sampling step.
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
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
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
        self._check_fan_out()
        self._check_logits_processors()

    def _check_fan_out(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} is invalid: it must be an integer >= 1")
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) \
                or self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of!r} is invalid: it must be an integer >= "
                             f"n={self.n}")
        if self.best_of > self.n and self.greedy:
            raise ValueError(f"best_of={self.best_of} is invalid with temperature=0: greedy "
                             "samples are all the same, so best_of must equal n")

    def _check_logits_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name}={value!r} is invalid: it must be a number in [-2, 2] "
                                 "(0 disables it)")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} is invalid: it "
                             "must be a number > 0 (1 disables it)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r} is invalid: it must be in [0, 1] "
                             "(0 disables it)")
        bias = self.logit_bias or {}
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias={self.logit_bias!r:.80} is invalid: it must be a dict "
                             "{token_id: bias}")
        clean = {}
        for token, value in bias.items():
            tid = int(token) if isinstance(token, str) and token.isdigit() else token
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise ValueError(f"logit_bias key {token!r} is invalid: keys are token ids >= 0")
            if not _is_number(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias[{token!r}]={value!r} is invalid: a bias is a "
                                 "number in [-100, 100]")
            clean[tid] = float(value)
        self.logit_bias = clean or None
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} is invalid: it must be an integer "
                             f"in [0, max_tokens={self.max_tokens}]")
        words = self.bad_words or []
        if isinstance(words, str) or any(not isinstance(w, str) or not w.strip() for w in words):
            raise ValueError(f"bad_words={self.bad_words!r:.80} is invalid: it must be a list of "
                             "non-empty str")
        self.bad_words = list(words) or None
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as err:
                raise ValueError(f"structured_outputs={so!r:.80} is invalid: {err}; its fields "
                                 "are json, regex, choice, grammar, json_object, "
                                 "disable_any_whitespace") from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs={so!r:.80} is invalid: pass a "
                             "StructuredOutputsParams, a dict of its fields, or None")
        self.structured_outputs = so

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def uses_history(self) -> bool:
        """The logits depend on the tokens generated so far (penalties, min_tokens, bad_words):
        the sampler needs each row's tokens, and drafted tokens cannot be verified in one pass."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1 or self.min_tokens or self.bad_words)

    @property
    def processes_logits(self) -> bool:
        """Anything changes the logits before temperature: greedy rows need it too."""
        return self.uses_history or self.logit_bias is not None

    @property
    def ranks_samples(self) -> bool:
        """best_of > n: every sample's cumulative logprob is tracked to keep the best n."""
        return self.best_of > self.n


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
