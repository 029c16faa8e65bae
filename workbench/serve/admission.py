"""Admission control: what the server accepts before the engine sees a request.

Three gates, each decided on the event loop without a round trip to the engine thread:

- `Limits`: per-request bounds on body fields (max_tokens, n, logprobs/top_logprobs), read from
  the raw JSON body, so they hold whatever the pydantic models accept. A violation is a 400 that
  names the field, its value and the limit.
- `Admission`: bounds on the work waiting to be scheduled, in requests and in prompt tokens.
  "Waiting" is what the server accepted and the engine has not scheduled yet: requests submitted
  but not yet taken off the engine thread's command queue (counted here, at submit time) plus the
  engine's waiting sequences (published by the engine thread after each step). Past a bound: 429
  with a Retry-After derived from the measured rate at which waiting requests get scheduled.
- `Refusal`: the OpenAIError these gates raise; it carries the metrics reason and HTTP headers.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workbench.serve.protocol import OpenAIError

RETRY_MIN, RETRY_MAX = 1, 60            # Retry-After is clamped to this range (seconds)


class Refusal(OpenAIError):
    """An OpenAIError that is also a counted rejection: `reason` is the label of
    workbench:request_rejected_total; `headers` go on the HTTP response (Retry-After)."""

    def __init__(self, message: str, reason: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message, param, status, kind, code if code is not None else reason)
        self.reason = reason
        self.retry_after = retry_after
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else None


def clamp_retry(seconds: float) -> int:
    if not math.isfinite(seconds):
        return RETRY_MAX
    return int(min(RETRY_MAX, max(RETRY_MIN, math.ceil(seconds))))


# ---------------------------------------------------------------------------- body limits
@dataclass
class Limits:
    max_tokens: int | None = None        # --max-tokens-limit
    max_n: int = 8                       # --max-n
    max_logprobs: int = 20               # --max-logprobs

    def check(self, body: dict) -> None:
        """Raise a 400 Refusal for the first field of `body` (a parsed JSON object) past its
        limit. Fields of the wrong type are left to the request model's validation."""
        for field, flag, limit in (("max_tokens", "--max-tokens-limit", self.max_tokens),
                                   ("max_completion_tokens", "--max-tokens-limit",
                                    self.max_tokens),
                                   ("n", "--max-n", self.max_n),
                                   ("logprobs", "--max-logprobs", self.max_logprobs),
                                   ("top_logprobs", "--max-logprobs", self.max_logprobs)):
            value = body.get(field)
            if limit is None or not _is_int(value):
                continue
            if value > limit:
                raise Refusal(f"{field}={value} is invalid: this server allows at most {limit} "
                              f"({flag})", "invalid", param=field)

    def default_max_tokens(self, default: int) -> int:
        """The max_tokens a request gets when it names none."""
        return default if self.max_tokens is None else min(default, self.max_tokens)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def estimate_prompt_tokens(body: dict) -> int:
    """Prompt tokens of a request before tokenization: exact for token-id prompts, about one
    token per 4 UTF-8 bytes of text (plus a few per chat message for the template)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return len(prompt)
    texts = [prompt] if isinstance(prompt, str) else \
        [p for p in prompt if isinstance(p, str)] if isinstance(prompt, list) else []
    n = sum(math.ceil(len(t.encode()) / 4) for t in texts)
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            n += 4 + (math.ceil(len(content.encode()) / 4) if isinstance(content, str) else 0)
    return max(1, n)


# ---------------------------------------------------------------------------- queue bounds
class DrainRate:
    """How fast waiting requests leave the queue: the times they were first scheduled, kept for
    `window` seconds. Appended by the engine thread (deque.append is atomic), read here."""

    def __init__(self, window: float = 60.0, maxlen: int = 1024,
                 clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = window, clock
        self.times: deque[float] = deque(maxlen=maxlen)

    def note(self, t: float | None = None) -> None:
        self.times.append(self.clock() if t is None else t)

    def seconds_per_request(self) -> float | None:
        """Mean seconds between two requests leaving the queue over the window up to now (a
        stalled engine lowers the rate as time passes); None before anything was measured."""
        now = self.clock()
        recent = [t for t in list(self.times) if t > now - self.window]
        if not recent:
            return None
        return max(now - recent[0], 1.0) / len(recent)

    def retry_after(self, requests_ahead: int) -> int:
        """Seconds until `requests_ahead` requests have left the queue at the measured rate."""
        per = self.seconds_per_request()
        return clamp_retry(RETRY_MAX if per is None else per * max(1, requests_ahead))


@dataclass
class QueueState:
    waiting_requests: int
    waiting_tokens: int


class Admission:
    """The waiting-work bounds. `admit` runs on the event loop right before a request is posted
    to the engine thread, with no await in between, so two requests never both take the last
    slot."""

    def __init__(self, max_waiting_requests: int | None = 256,
                 max_queued_prompt_tokens: int | None = 65536,
                 drain: DrainRate | None = None):
        for name, value in (("max_waiting_requests", max_waiting_requests),
                            ("max_queued_prompt_tokens", max_queued_prompt_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} is invalid: it must be at least 1 (or None "
                                 "for no bound)")
        self.max_waiting_requests = max_waiting_requests
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.drain = drain if drain is not None else DrainRate()

    def admit(self, state: QueueState, prompt_tokens: int) -> None:
        """Raise a 429 Refusal if one more request of `prompt_tokens` would pass a bound. A
        request finding nothing waiting is admitted whatever its size: the token bound limits
        queued work, --max-prompt-tokens limits one prompt."""
        cap = self.max_waiting_requests
        if cap is not None and state.waiting_requests + 1 > cap:
            ahead = state.waiting_requests + 1 - cap
            raise Refusal(f"the server is busy: {state.waiting_requests} requests are waiting, "
                          f"and max-waiting-requests={cap}; retry later", "queue_full",
                          status=429, kind="rate_limit_error",
                          retry_after=self.drain.retry_after(ahead))
        cap = self.max_queued_prompt_tokens
        if cap is not None and state.waiting_tokens > 0 and \
                state.waiting_tokens + prompt_tokens > cap:
            per = state.waiting_tokens / max(1, state.waiting_requests)
            ahead = math.ceil((state.waiting_tokens + prompt_tokens - cap) / max(1.0, per))
            raise Refusal(f"the server is busy: {state.waiting_tokens} prompt tokens are "
                          f"waiting, this request brings about {prompt_tokens}, and "
                          f"max-queued-prompt-tokens={cap}; retry later", "queued_tokens",
                          status=429, kind="rate_limit_error",
                          retry_after=self.drain.retry_after(ahead))
