"""Who may call the server and what they may send and receive.

- `ApiKeys`: named API keys, checked in constant time against every key.
- `RateLimiter`: per-key token buckets for requests and tokens per minute.
- `ContentFilter`: named regex policies plus user callables, over prompts (input screening) and
  over generated text (output screening, with `OutputScreen` holding back any text that could
  be the start of a match, so matched text is never sent).
"""
from __future__ import annotations

import hashlib
import hmac
import importlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import regex

from workbench.serve.admission import Refusal, clamp_retry


# ---------------------------------------------------------------------------- API keys
@dataclass
class KeySpec:
    name: str
    key: str
    rpm: float | None = None             # None: the server's --rate-limit-rpm
    tpm: float | None = None


def parse_key_file(path: str | Path) -> list[KeySpec]:
    """Lines `NAME:KEY [rpm=N] [tpm=N]`; blank lines and lines starting with # are skipped.
    rpm/tpm override the server-wide rate limits for that key (0 = unlimited)."""
    specs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, *options = line.split()
        name, sep, key = head.partition(":")
        if not sep or not name or not key:
            raise ValueError(f"{path}:{i}: {head!r:.20} is invalid: a key line is "
                             "NAME:KEY [rpm=N] [tpm=N]")
        spec = KeySpec(name, key)
        for opt in options:
            field_, _, value = opt.partition("=")
            if field_ not in ("rpm", "tpm") or not _number(value):
                raise ValueError(f"{path}:{i}: {opt!r} is invalid: options are rpm=N and tpm=N")
            setattr(spec, field_, float(value))
        specs.append(spec)
    return specs


def _number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


class ApiKeys:
    """The keys a server accepts, each with a name (for logs and rate limits).

    `identify` compares the presented key with every key, never stopping at a match, and
    compares fixed-length SHA-256 digests, so its time says neither which key matched nor how
    long the keys are."""

    def __init__(self, specs: Iterable[KeySpec],
                 compare: Callable[[bytes, bytes], bool] = hmac.compare_digest):
        self.specs = list(specs)
        names = [s.name for s in self.specs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"API key names {sorted(dup)} are used twice: names must be unique")
        if not self.specs:
            raise ValueError("ApiKeys needs at least one key")
        self._digests = [(s, _digest(s.key)) for s in self.specs]
        self.compare = compare

    def identify(self, presented: str | None) -> KeySpec | None:
        candidate = _digest(presented or "")
        found = None
        for spec, digest in self._digests:
            if self.compare(candidate, digest) and found is None:
                found = spec
        return found if presented else None

    def identify_header(self, authorization: str | None) -> KeySpec | None:
        """From an `Authorization: Bearer KEY` header."""
        scheme, _, token = (authorization or "").partition(" ")
        return self.identify(token.strip() if scheme.lower() == "bearer" else None)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# ---------------------------------------------------------------------------- rate limits
class TokenBucket:
    """`per_minute` units, refilled continuously (per_minute / 60 each second); a request takes
    its units if the bucket holds them. `give` returns units charged in excess."""

    def __init__(self, per_minute: float, now: float):
        self.capacity = float(per_minute)
        self.rate = self.capacity / 60.0
        self.level, self.t = self.capacity, now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now

    def wait(self, units: float, now: float) -> float:
        """Seconds until `units` are available (0: now; inf: never, more than the capacity)."""
        self._refill(now)
        if units <= self.level:
            return 0.0
        if units > self.capacity:
            return math.inf
        return (units - self.level) / self.rate

    def take(self, units: float, now: float) -> None:
        self._refill(now)
        self.level -= units

    def give(self, units: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + units)


class RateLimiter:
    """Requests and tokens per minute, per key name. A request is charged one request and its
    token estimate (prompt + max_tokens) at admission; `settle` refunds the difference once the
    real count is known. A key with limit 0 or None is not limited."""

    def __init__(self, rpm: float | None = None, tpm: float | None = None,
                 keys: Iterable[KeySpec] = (), clock: Callable[[], float] = time.monotonic):
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        self._limits = {k.name: (k.rpm if k.rpm is not None else rpm,
                                 k.tpm if k.tpm is not None else tpm) for k in keys}
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm or any(a or b for a, b in self._limits.values()))

    def _bucket(self, key: str, kind: str) -> TokenBucket | None:
        rpm, tpm = self._limits.get(key, (self.rpm, self.tpm))
        limit = rpm if kind == "requests" else tpm
        if not limit:
            return None
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            bucket = self._buckets[(key, kind)] = TokenBucket(limit, self.clock())
        return bucket

    def admit(self, key: str, tokens: int) -> None:
        """Charge one request of `tokens` to `key`, or raise a 429 Refusal naming the limit."""
        now = self.clock()
        requests, token_bucket = self._bucket(key, "requests"), self._bucket(key, "tokens")
        if requests is not None:
            wait = requests.wait(1, now)
            if wait > 0:
                raise Refusal(f"rate limit reached for key {key!r}: rate-limit-rpm="
                              f"{requests.capacity:g} requests per minute; retry in "
                              f"{clamp_retry(wait)} s", "rate_limit_requests", status=429,
                              kind="rate_limit_error", retry_after=clamp_retry(wait))
        if token_bucket is not None:
            wait = token_bucket.wait(tokens, now)
            if math.isinf(wait):
                raise Refusal(f"this request alone needs about {tokens} tokens (prompt + "
                              f"max_tokens), more than rate-limit-tpm={token_bucket.capacity:g} "
                              f"for key {key!r}: lower max_tokens", "rate_limit_tokens",
                              status=429, kind="rate_limit_error", retry_after=60)
            if wait > 0:
                raise Refusal(f"rate limit reached for key {key!r}: rate-limit-tpm="
                              f"{token_bucket.capacity:g} tokens per minute, and this request "
                              f"needs about {tokens}; retry in {clamp_retry(wait)} s",
                              "rate_limit_tokens", status=429, kind="rate_limit_error",
                              retry_after=clamp_retry(wait))
            token_bucket.take(tokens, now)
        if requests is not None:
            requests.take(1, now)

    def settle(self, key: str, charged: int, used: int) -> None:
        """The request used `used` tokens where `charged` were taken: return the difference
        (or take more, when it used more)."""
        bucket = self._bucket(key, "tokens")
        if bucket is None or charged == used:
            return
        if charged > used:
            bucket.give(charged - used, self.clock())
        else:
            bucket.take(used - charged, self.clock())


# ---------------------------------------------------------------------------- content screening
Screen = Callable[[str], "str | None"]     # text -> the name of the policy it breaks, or None


@dataclass
class ContentFilter:
    """Named regex policies (the `regex` module: `re` syntax, plus partial matching for
    streams) and callables `screen(text) -> policy name | None`."""
    patterns: list[tuple[str, regex.Pattern]] = field(default_factory=list)
    screens: list[Screen] = field(default_factory=list)

    @classmethod
    def build(cls, patterns: Iterable[str] = (), files: Iterable[str | Path] = (),
              screens: Iterable[Screen | None] = (), prefix: str = "block-pattern"):
        """`patterns` are named `<prefix>-1`, `<prefix>-2`, ...; a file holds `NAME REGEX`
        lines (# comments and blank lines skipped)."""
        named = [(f"{prefix}-{i}", p) for i, p in enumerate(patterns, 1)]
        for path in files:
            for i, line in enumerate(Path(path).read_text().splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                name, _, pattern = line.partition(" ")
                if not pattern.strip():
                    raise ValueError(f"{path}:{i}: {line!r:.40} is invalid: a pattern line is "
                                     "NAME REGEX")
                named.append((name, pattern.strip()))
        compiled = []
        for name, pattern in named:
            try:
                compiled.append((name, regex.compile(pattern)))
            except regex.error as err:
                raise ValueError(f"pattern {name}={pattern!r} is invalid: {err}") from None
        return cls(compiled, [s for s in screens if s is not None])

    def __bool__(self) -> bool:
        return bool(self.patterns or self.screens)

    def check(self, text: str) -> str | None:
        """The name of the first policy `text` breaks, or None."""
        for name, pattern in self.patterns:
            if pattern.search(text):
                return name
        for screen in self.screens:
            policy = screen(text)
            if policy:
                return str(policy)
        return None

    def first_match(self, text: str, partial: bool,
                    start: int = 0) -> tuple[str | None, int | None, bool]:
        """Over generated text: (policy, where the text must stop, complete). A complete match
        stops the text at the match's start; with `partial`, a pattern that could still match
        as more text arrives holds the text back from where that match would begin. Matches
        are looked for from `start` on (text before it was released: no match can begin
        there), with the whole text as context. A callable sees the whole text; its match
        stops the text where it was (None)."""
        name, stop, complete = None, None, False
        for pname, pattern in self.patterns:
            m = pattern.search(text, start, partial=partial)
            if m is None:
                continue
            if not m.partial:
                if not complete or m.start() < stop:
                    name, stop, complete = pname, m.start(), True
            elif not complete and (stop is None or m.start() < stop):
                stop = m.start()
        if complete:
            return name, stop, True
        for screen in self.screens:
            policy = screen(text)
            if policy:
                return str(policy), None, True
        return None, stop, False


def load_callable(spec: str) -> Screen:
    """'package.module:function' -> the function."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{spec!r} is invalid: name a screen as MODULE:FUNCTION")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{spec!r} is invalid: {err}") from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is invalid: {attr} is not callable")
    return fn


def input_texts(body: dict) -> list[tuple[str, str]]:
    """(field, text) pairs a request sends to the model: its prompt strings and messages."""
    out = []
    prompt = body.get("prompt")
    for p in ([prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []):
        if isinstance(p, str):
            out.append(("prompt", p))
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            out.append(("messages", m["content"]))
    return out


def screen_input(content_filter: ContentFilter, body: dict) -> None:
    """Raise a 400 Refusal (code content_policy) naming the policy a prompt or message breaks."""
    for field_, text in input_texts(body):
        policy = content_filter.check(text)
        if policy is not None:
            refusal = Refusal(f"the {'prompt' if field_ == 'prompt' else 'message'} breaks "
                              f"the content policy {policy!r} and is refused", "content_policy",
                              param=field_, code="content_policy")
            refusal.policy = policy
            raise refusal
