"""A soak test for the OpenAI-compatible server: rounds of many concurrent clients mixing good
requests with abuse, every request accounted for, and the server checked for leaks after each
round.

    python -m workbench.loadtest.soak --url http://127.0.0.1:8000 --api-key KEY --clients 64 \
        --rounds 3 [--requests-per-client 4 | --duration 30] [--pid PID] [--json out.json]

Each client (asyncio; httpx, and for some requests the `openai` AsyncOpenAI client) draws
requests of these kinds:

    complete    a completion, streamed or not, text or token-id prompt, n 1-3, penalties, a priority
    chat        the same through /v1/chat/completions
    greedy      temperature 0 with ignore_eos from a fixed pool, whose text must equal the reference
                the server gave for it in a quiet moment before the first round
    disconnect  a streamed request the client closes after k events
    burst       a dozen small requests at once, to pass --max-waiting-requests (429, Retry-After)
    malformed   bodies that are not a valid request (broken JSON, wrong types, bad UTF-8): 400
    oversized   bodies past --max-body-bytes, with and without Content-Length: 413
    wrong_key   a missing or wrong API key: 401
    invalid     temperature=-1, n=0, max_tokens=0, top_p=2, an unknown model, a prompt past
                max_model_len: 400 naming the field

Every request ends in one category: completed (every choice finished with stop or length, the
stream with [DONE]), rejected (an OpenAI error body; by status and reason, the label of
workbench:request_rejected_total), disconnected (by the client, on purpose), clean_error (an SSE
error event, or a 5xx with an OpenAI error body), or lost: anything else (a hang past the client's
timeout, a connection cut without an error event, a 5xx without an OpenAI body, a stream without
[DONE], a greedy text other than the reference, a status the request's kind does not allow).

After each round: wait until /metrics shows nothing running or waiting, then record
workbench:kv_cache_usage_perc (0 when no block leaked), the server's RSS (with its pid), the
change of workbench:request_rejected_total by reason (to compare with the clients' own count) and
of workbench:request_success_total, and whether a greedy request still gets its reference.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

CATEGORIES = ("completed", "rejected", "disconnected", "clean_error", "lost")
KIND_WEIGHTS = {"complete": 18, "chat": 14, "greedy": 14, "disconnect": 12, "burst": 6,
                "malformed": 8, "oversized": 7, "wrong_key": 8, "invalid": 13}
FINISHED = ("stop", "length")
QUEUE_REASONS = ("queue_full", "queued_tokens", "rate_limit_requests", "rate_limit_tokens")
# The refusal the server counts a lost request of these kinds under, having answered it somehow.
LOST_REASON = {"wrong_key": "unauthorized", "malformed": "invalid", "oversized": "too_large"}
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of "
         "liquor and jugs near old river banks under bright moon light every single night").split()


# ---------------------------------------------------------------------------- results
@dataclass
class Outcome:
    kind: str
    via: str                          # "httpx" or "openai"
    category: str                     # one of CATEGORIES
    label: str                        # rejected: "429 queue_full"; lost: what went wrong
    reason: str | None = None         # the request_rejected_total label it should bump


@dataclass
class RoundReport:
    round: int
    seconds: float
    sent: int
    counts: dict                      # category: requests
    rejected: dict                    # "status reason": requests
    by_kind: dict                     # kind: {category or "rejected <status reason>": requests}
    lost_details: list                # "kind via: what" for each lost request
    drained: bool                     # /metrics showed nothing running or waiting in time
    kv_cache_usage: float | None
    rss_mb: float | None
    check_ok: bool                    # a greedy request got its reference after the round
    server_rejected: dict             # change of request_rejected_total by reason
    client_rejected: dict             # the clients' rejections (and LOST_REASON's) by reason
    server_success: float             # change of request_success_total (stop and length)

    @property
    def rejected_match(self) -> bool:
        reasons = set(self.server_rejected) | set(self.client_rejected)
        return all(self.server_rejected.get(r, 0) == self.client_rejected.get(r, 0)
                   for r in reasons)


@dataclass
class SoakReport:
    url: str
    clients: int
    references: list                  # [{"endpoint", "body", "text"}] of the greedy pool
    rounds: list = field(default_factory=list)

    def total(self, category: str) -> int:
        return sum(r.counts.get(category, 0) for r in self.rounds)

    @property
    def sent(self) -> int:
        return sum(r.sent for r in self.rounds)

    @property
    def lost(self) -> int:
        return self.total("lost")

    def rejected(self) -> Counter:
        out = Counter()
        for r in self.rounds:
            out.update(r.rejected)
        return out

    def by_kind(self) -> dict:
        out: dict[str, Counter] = {}
        for r in self.rounds:
            for kind, counts in r.by_kind.items():
                out.setdefault(kind, Counter()).update(counts)
        return {k: dict(v) for k, v in sorted(out.items())}

    @property
    def ok(self) -> bool:
        return self.lost == 0 and all(r.drained and r.kv_cache_usage == 0 and r.check_ok and
                                      r.rejected_match for r in self.rounds)

    def to_dict(self) -> dict:
        return {"url": self.url, "clients": self.clients, "ok": self.ok, "sent": self.sent,
                "totals": {c: self.total(c) for c in CATEGORIES},
                "rejected": dict(sorted(self.rejected().items())), "by_kind": self.by_kind(),
                "rounds": [{**asdict(r), "rejected_match": r.rejected_match}
                           for r in self.rounds],
                "references": self.references}

    def table(self) -> str:
        reasons = sorted(self.rejected())
        head = ["round", "sent", *CATEGORIES, *reasons, "kv", "RSS MB", "check", "ctr", "s"]
        rows = []
        for r in self.rounds:
            rows.append([str(r.round), str(r.sent), *(str(r.counts.get(c, 0)) for c in CATEGORIES),
                         *(str(r.rejected.get(x, 0)) for x in reasons),
                         "-" if r.kv_cache_usage is None else f"{r.kv_cache_usage:g}",
                         "-" if r.rss_mb is None else f"{r.rss_mb:.1f}",
                         "ok" if r.check_ok else "FAIL", "ok" if r.rejected_match else "FAIL",
                         f"{r.seconds:.1f}"])
        rows.append(["total", str(self.sent), *(str(self.total(c)) for c in CATEGORIES),
                     *(str(self.rejected()[x]) for x in reasons), "", "", "", "", ""])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        lines.append("by kind: " + "; ".join(
            f"{k}: " + ", ".join(f"{n} {c}" for c, n in sorted(v.items()))
            for k, v in self.by_kind().items()))
        for r in self.rounds:
            if not r.rejected_match:
                lines.append(f"round {r.round}: /metrics rejected {r.server_rejected}, "
                             f"clients saw {r.client_rejected}")
            lines += [f"round {r.round} LOST {n}x: {d}"
                      for d, n in sorted(Counter(r.lost_details).items())]
        return "\n".join(lines)


# ---------------------------------------------------------------------------- /metrics
def metric_values(text: str, name: str, label: str | None = None) -> dict:
    """{label value (or ""): sample} for every series of `name`."""
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$', text, re.M):
        key = ""
        if label is not None:
            lm = re.search(rf'{label}="([^"]*)"', m.group(1))
            key = lm.group(1) if lm else ""
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def metric(text: str, name: str) -> float | None:
    values = metric_values(text, name)
    return sum(values.values()) if values else None


def reject_reason(status: int, error: dict) -> str:
    """The request_rejected_total label the server counts a refusal of this shape under."""
    code = error.get("code")
    if status in (429, 503, 504) and code:
        return "timeout" if status == 504 else code
    if status == 401:
        return "unauthorized"
    if status == 413:
        return "too_large"
    if code == "content_policy":
        return "content_policy"
    return "invalid"


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss / 2 ** 20
    except ImportError:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    return None


# ---------------------------------------------------------------------------- the soak
class _Soak:
    def __init__(self, url: str, api_key: str | None, model: str, max_model_len: int,
                 max_body_bytes: int, request_timeout: float, burst: int, openai_share: float,
                 spread: float):
        self.url, self.api_key, self.model = url.rstrip("/"), api_key, model
        self.max_model_len, self.max_body_bytes = max_model_len, max_body_bytes
        self.request_timeout, self.burst, self.openai_share = request_timeout, burst, openai_share
        self.spread = spread
        self.pool: list[dict] = []        # the greedy requests, with "text" once referenced
        self.outcomes: list[Outcome] = []

    def headers(self, key: str | None = "") -> dict:
        key = self.api_key if key == "" else key
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    # ------------------------------------------------------------------ drawing requests
    def prompt_text(self, rng: random.Random, lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    def valid_body(self, rng: random.Random, chat: bool, stream: bool, small: bool = False) -> dict:
        if small:
            prompt_words, max_tokens = (2, 8), rng.randint(2, 8)
        else:
            prompt_words = rng.choice(((2, 10), (10, 40), (40, 100)))
            max_tokens = rng.choice((1, rng.randint(2, 16), rng.randint(16, 48)))
        body = {"model": self.model, "max_tokens": max_tokens, "stream": stream,
                "temperature": rng.choice((0.0, 0.7, 1.0)), "n": rng.choice((1, 1, 1, 2, 3)),
                "priority": rng.randint(-2, 2), "seed": rng.randint(0, 10 ** 6)}
        if rng.random() < 0.4:
            body.update(presence_penalty=round(rng.uniform(-1, 1), 2),
                        frequency_penalty=round(rng.uniform(-1, 1), 2),
                        repetition_penalty=round(rng.uniform(1.0, 1.5), 2))
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt_text(rng, *prompt_words)}]
        elif rng.random() < 0.3:
            body["prompt"] = [rng.randint(100, 5000)
                              for _ in range(rng.randint(*prompt_words))]
        else:
            body["prompt"] = self.prompt_text(rng, *prompt_words)
        return body

    def make_pool(self, rng: random.Random, size: int = 6) -> None:
        for i in range(size):
            chat = i % 3 == 2
            body = {"model": self.model, "max_tokens": (6, 12, 20)[i % 3], "temperature": 0,
                    "ignore_eos": True}
            if chat:
                body["messages"] = [{"role": "user", "content": self.prompt_text(rng, 3, 12)}]
            elif i % 3 == 1:
                body["prompt"] = [rng.randint(100, 5000) for _ in range(rng.randint(4, 30))]
            else:
                body["prompt"] = self.prompt_text(rng, 3, 30)
            self.pool.append({"endpoint": "chat" if chat else "completions", "body": body})

    async def reference(self, client: httpx.AsyncClient) -> None:
        """The pool's texts from the server, one request at a time."""
        for entry in self.pool:
            r = await client.post(self.endpoint(entry["endpoint"]), json=entry["body"],
                                  headers=self.headers())
            if r.status_code != 200:
                raise RuntimeError(f"the reference request failed: {r.status_code} {r.text}")
            entry["text"] = _choice_text(r.json()["choices"][0], entry["endpoint"] == "chat")

    def endpoint(self, name: str) -> str:
        return f"{self.url}/v1/{'chat/completions' if name == 'chat' else 'completions'}"

    # ------------------------------------------------------------------ one client
    async def client(self, index: int, rng: random.Random, first_kind: str | None,
                     requests: int | None, until: float | None) -> None:
        use_openai = rng.random() < self.openai_share
        oa = None
        if use_openai:
            import openai
            oa = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                                    max_retries=0, timeout=self.request_timeout)
        async with httpx.AsyncClient(timeout=self.request_timeout) as hc:
            await asyncio.sleep(rng.uniform(0, self.spread))   # arrivals spread, not one wave
            done = 0
            while (requests is None or done < requests) and \
                    (until is None or time.monotonic() < until):
                kind = first_kind if done == 0 and first_kind else \
                    rng.choices(list(KIND_WEIGHTS), list(KIND_WEIGHTS.values()))[0]
                via = "openai" if oa is not None and kind in (
                    "complete", "chat", "greedy", "disconnect", "wrong_key", "invalid") and \
                    rng.random() < 0.7 else "httpx"
                if kind == "burst":
                    bodies = [self.valid_body(rng, chat=False, stream=False, small=True)
                              for _ in range(self.burst)]
                    await asyncio.gather(*(self.guarded("burst", "httpx", self.send_valid(
                        hc, "completions", b, None)) for b in bodies))
                else:
                    await self.guarded(kind, via, self.one(kind, via, rng, hc, oa))
                    if self.outcomes[-1].label.startswith("429"):
                        await asyncio.sleep(rng.uniform(0, self.spread / 2))   # backs off a bit
                done += 1
        if oa is not None:
            await oa.close()

    async def guarded(self, kind: str, via: str, coro) -> None:
        try:
            async with asyncio.timeout(self.request_timeout + 5):
                category, label, *reason = await coro
        except TimeoutError:
            category, label, reason = "lost", f"no answer in {self.request_timeout + 5:g} s", []
        except Exception as err:         # a connection cut, an unreadable answer: nothing clean
            category, label, reason = "lost", f"{type(err).__name__}: {err}"[:300], []
        reason = reason[0] if reason else None
        if category == "lost":          # the server still counts it under its kind's reason
            reason = LOST_REASON.get(kind)
        self.outcomes.append(Outcome(kind, via, category, label, reason))

    async def one(self, kind: str, via: str, rng: random.Random, hc: httpx.AsyncClient, oa):
        if kind in ("complete", "chat", "disconnect"):
            chat = kind == "chat" or (kind == "disconnect" and rng.random() < 0.5)
            stream = kind == "disconnect" or rng.random() < 0.5
            body = self.valid_body(rng, chat, stream)
            cut = None
            if kind == "disconnect":
                body["max_tokens"] = rng.randint(16, 48)
                cut = rng.randint(1, 4)
            endpoint = "chat" if chat else "completions"
            if via == "openai":
                return await self.send_openai(oa, endpoint, body, cut, None)
            return await self.send_valid(hc, endpoint, body, None, cut)
        if kind == "greedy":
            entry = rng.choice(self.pool)
            body = {**entry["body"], "stream": rng.random() < 0.5,
                    "priority": rng.randint(-2, 2)}
            if via == "openai":
                return await self.send_openai(oa, entry["endpoint"], body, None, entry["text"])
            return await self.send_valid(hc, entry["endpoint"], body, entry["text"])
        if kind == "malformed":
            content = rng.choice((b'{"prompt": "abc", "max_tokens": 4', b"hello", b"",
                                  b'[1, 2, 3]', b'{"prompt": 5}', b'{"messages": "hi"}',
                                  b'{"prompt": "\xff\xfe bad utf-8"}', b'{"prompt": null}',
                                  b'{"prompt": "a", "max_tokens": "many"}'))
            endpoint = "chat" if b"messages" in content or rng.random() < 0.3 else "completions"
            r = await hc.post(self.endpoint(endpoint), content=content,
                              headers={**self.headers(), "Content-Type": "application/json"})
            return self.expect_error(r.status_code, r.headers, r.content, {400})
        if kind == "oversized":
            size = self.max_body_bytes + rng.randint(1, 4096)
            payload = json.dumps({"model": self.model, "max_tokens": 4,
                                  "prompt": "x" * size}).encode()
            headers = {**self.headers(), "Content-Type": "application/json"}
            chunked = rng.random() < 0.5      # no Content-Length to refuse early on

            async def chunks():
                for i in range(0, len(payload), 1024):
                    yield payload[i:i + 1024]
            try:
                r = await hc.post(self.endpoint("completions"),
                                  content=chunks() if chunked else payload, headers=headers)
            except httpx.TransportError as err:
                mode = "chunked" if chunked else "Content-Length"
                return "lost", (f"{mode} body of {len(payload)} bytes: {type(err).__name__} "
                                "instead of 413")
            return self.expect_error(r.status_code, r.headers, r.content, {413})
        if kind == "wrong_key":
            key = rng.choice((None, "sk-wrong", (self.api_key or "k") + "x", ""))
            body = self.valid_body(rng, chat=rng.random() < 0.5, stream=rng.random() < 0.5)
            endpoint = "chat" if "messages" in body else "completions"
            if via == "openai":
                import openai
                bad = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key or "sk-none",
                                         max_retries=0, timeout=self.request_timeout)
                try:
                    return await self.send_openai(bad, endpoint, body, None, None, expect={401})
                finally:
                    await bad.close()
            r = await hc.post(self.endpoint(endpoint), json=body,
                              headers=self.headers(key) if key else {})
            return self.expect_error(r.status_code, r.headers, r.content, {401})
        if kind == "invalid":
            chat = rng.random() < 0.5
            body = self.valid_body(rng, chat, stream=rng.random() < 0.5)
            field_, value = rng.choice((("temperature", -1), ("n", 0), ("max_tokens", 0),
                                        ("top_p", 2), ("model", "no-such-model"),
                                        ("prompt", None)))
            allowed = {400}
            if field_ == "prompt":       # past max_model_len; the waiting bounds come first
                body.pop("messages", None)
                body["prompt"] = [rng.randint(100, 5000) for _ in range(self.max_model_len + 8)]
                chat, param, allowed = False, None, {400, 429}
            else:
                body[field_], param = value, field_
            endpoint = "chat" if chat else "completions"
            if via == "openai":
                return await self.send_openai(oa, endpoint, body, None, None, expect=allowed,
                                              param=param)
            r = await hc.post(self.endpoint(endpoint), json=body, headers=self.headers())
            return self.expect_error(r.status_code, r.headers, r.content, allowed, param)
        raise ValueError(f"kind={kind!r} is invalid")

    # ------------------------------------------------------------------ classifying
    def expect_error(self, status: int, headers, content: bytes, allowed: set,
                     param: str | None = None) -> tuple:
        """An answer that must be one of the `allowed` statuses with an OpenAI error body."""
        error = _error_body(content)
        if status >= 500:
            return ("clean_error", f"{status}") if error else \
                ("lost", f"{status} without an OpenAI error body: {content[:120]!r}")
        if status not in allowed:
            return "lost", f"status {status}, expected {sorted(allowed)}: {content[:160]!r}"
        if error is None:
            return "lost", f"{status} without an OpenAI error body: {content[:120]!r}"
        if param is not None and error.get("param") != param:
            return "lost", f"{status} names param {error.get('param')!r}, expected {param!r}"
        reason = reject_reason(status, error)
        return "rejected", f"{status} {reason}", reason

    def busy(self, status: int, headers, content: bytes) -> tuple:
        """A 429 (or other refusal) of a valid request."""
        error = _error_body(content)
        if status >= 500:
            return ("clean_error", f"{status}") if error else \
                ("lost", f"{status} without an OpenAI error body: {content[:120]!r}")
        if status != 429 or error is None or error.get("code") not in QUEUE_REASONS:
            return "lost", f"a valid request got {status}: {content[:160]!r}"
        retry = headers.get("retry-after", "")
        if not retry.isdigit() or not 1 <= int(retry) <= 60:
            return "lost", f"429 with Retry-After {retry!r}"
        return "rejected", f"429 {error['code']}", error["code"]

    async def send_valid(self, hc: httpx.AsyncClient, endpoint: str, body: dict,
                         want: str | None, cut: int | None = None) -> tuple:
        url, chat, n = self.endpoint(endpoint), endpoint == "chat", body.get("n", 1)
        if not body.get("stream"):
            r = await hc.post(url, json=body, headers=self.headers())
            if r.status_code != 200:
                return self.busy(r.status_code, r.headers, r.content)
            return _check_whole(r.json(), chat, n, want)
        async with hc.stream("POST", url, json=body, headers=self.headers()) as r:
            if r.status_code != 200:
                return self.busy(r.status_code, r.headers, await r.aread())
            state = _StreamState(chat, n)
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if state.done:
                    return "lost", f"an event after [DONE]: {line[:120]!r}"
                events += 1
                state.take(line[6:])
                if cut is not None and events >= cut and not state.done and state.error is None:
                    return "disconnected", f"after {events} events"
            return state.verdict(want)

    async def send_openai(self, oa, endpoint: str, body: dict, cut: int | None,
                          want: str | None, expect: set | None = None,
                          param: str | None = None) -> tuple:
        import openai
        chat, n = endpoint == "chat", body.get("n", 1)
        known = ("model", "max_tokens", "stream", "temperature", "n", "seed", "top_p",
                 "presence_penalty", "frequency_penalty", "stream_options", "messages", "prompt")
        kwargs = {k: v for k, v in body.items() if k in known}
        extra = {k: v for k, v in body.items() if k not in known}
        create = oa.chat.completions.create if chat else oa.completions.create
        try:
            result = await create(**kwargs, extra_body=extra or None)
            if expect is not None:
                return "lost", f"the openai client got an answer, expected {sorted(expect)}"
            if not body.get("stream"):
                return _check_whole(result.model_dump(), chat, n, want)
            state = _StreamState(chat, n)
            events = 0
            try:
                async for chunk in result:
                    events += 1
                    state.take_parsed(chunk.model_dump())
                    if cut is not None and events >= cut:
                        return "disconnected", f"after {events} events"
            finally:
                await result.close()
            state.done = True            # the client stops at [DONE] and does not say it saw it
            return state.verdict(want)
        except openai.APIStatusError as err:
            r = err.response
            if expect is not None:
                return self.expect_error(r.status_code, r.headers, r.content, expect, param)
            return self.busy(r.status_code, r.headers, r.content)
        except openai.APITimeoutError:
            return "lost", f"no answer in {self.request_timeout:g} s (openai client)"
        except openai.APIConnectionError as err:
            return "lost", f"connection: {err.__cause__ or err}"[:300]
        except openai.APIError as err:  # an error event in the stream
            return ("clean_error", f"error event {err.code}") if err.body else \
                ("lost", f"{err}"[:300])

    # ------------------------------------------------------------------ after a round
    async def scrape(self, client: httpx.AsyncClient) -> str:
        r = await client.get(f"{self.url}/metrics", headers=self.headers())
        r.raise_for_status()
        return r.text

    async def drain(self, client: httpx.AsyncClient, timeout: float) -> tuple[bool, str]:
        deadline = time.monotonic() + timeout
        idle_seen = 0
        while True:
            text = await self.scrape(client)
            idle = metric(text, "workbench:num_requests_running") == 0 and \
                metric(text, "workbench:num_requests_waiting") == 0
            idle_seen = idle_seen + 1 if idle else 0
            if idle_seen >= 2:           # two scrapes apart: the engine's idle pass set the gauges
                return True, text
            if time.monotonic() > deadline:
                return False, text
            await asyncio.sleep(0.1)

    async def check(self, client: httpx.AsyncClient, i: int) -> bool:
        entry = self.pool[i % len(self.pool)]
        r = await client.post(self.endpoint(entry["endpoint"]), json=entry["body"],
                              headers=self.headers())
        return r.status_code == 200 and \
            _choice_text(r.json()["choices"][0], entry["endpoint"] == "chat") == entry["text"]


@dataclass
class _StreamState:
    chat: bool
    n: int
    texts: dict = field(default_factory=dict)
    finish: dict = field(default_factory=dict)
    error: dict | None = None
    done: bool = False
    problem: str | None = None

    def take(self, data: str) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            self.take_parsed(json.loads(data))
        except ValueError:
            self.problem = self.problem or f"an event that is not JSON: {data[:120]!r}"

    def take_parsed(self, chunk: dict) -> None:
        if isinstance(chunk.get("error"), dict):
            self.error = chunk["error"]
            return
        for c in chunk.get("choices") or []:
            i = c.get("index", 0)
            piece = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            self.texts[i] = self.texts.get(i, "") + (piece or "")
            if c.get("finish_reason") is not None:
                if i in self.finish:
                    self.problem = self.problem or f"choice {i} finished twice"
                self.finish[i] = c["finish_reason"]

    def verdict(self, want: str | None) -> tuple:
        if self.problem:
            return "lost", self.problem
        if not self.done:
            return "lost", "the stream ended without [DONE]" + \
                (" after an error event" if self.error else "")
        if self.error is not None:
            return "clean_error", f"error event {self.error.get('code')}"
        if set(self.finish) != set(range(self.n)):
            return "lost", f"choices {sorted(self.finish)} of {self.n} finished before [DONE]"
        if any(f == "abort" for f in self.finish.values()):
            return "clean_error", "finish_reason abort"
        bad = {i: f for i, f in self.finish.items() if f not in FINISHED}
        if bad:
            return "lost", f"finish_reason {bad}"
        if want is not None and self.texts.get(0, "") != want:
            return "lost", f"greedy text {self.texts.get(0, '')!r} != reference {want!r}"
        return "completed", ",".join(sorted(set(self.finish.values())))


def _error_body(content: bytes) -> dict | None:
    try:
        body = json.loads(content)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) and isinstance(error.get("message"), str) else None


def _choice_text(choice: dict, chat: bool) -> str:
    return (choice.get("message") or {}).get("content") if chat else choice.get("text")


def _check_whole(body: dict, chat: bool, n: int, want: str | None) -> tuple:
    choices = body.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(n)):
        return "lost", f"choices {[c.get('index') for c in choices]} for n={n}"
    reasons = {c.get("finish_reason") for c in choices}
    if "abort" in reasons:
        return "clean_error", "finish_reason abort"
    if not reasons <= set(FINISHED):
        return "lost", f"finish_reason {reasons}"
    if not all(isinstance(_choice_text(c, chat), str) for c in choices):
        return "lost", "a choice without text"
    if not isinstance(body.get("usage"), dict):
        return "lost", "no usage"
    if want is not None:
        got = _choice_text(sorted(choices, key=lambda c: c["index"])[0], chat)
        if got != want:
            return "lost", f"greedy text {got!r} != reference {want!r}"
    return "completed", ",".join(sorted(reasons))


# ---------------------------------------------------------------------------- entry points
async def soak(url: str, *, clients: int = 64, rounds: int = 3, requests_per_client: int | None = 4,
               duration: float | None = None, seed: int = 0, api_key: str | None = None,
               pid: int | None = None, max_body_bytes: int = 1 << 20,
               request_timeout: float = 120.0, drain_timeout: float = 60.0, burst: int = 12,
               openai_share: float = 0.3, spread: float = 1.0, log=None) -> SoakReport:
    """`rounds` rounds of `clients` concurrent clients, each sending `requests_per_client`
    requests (a burst counts as one) or, with `duration`, sending until that many seconds have
    passed. `pid`: the server's process, for its RSS. `max_body_bytes`: the server's
    --max-body-bytes, which oversized bodies pass. `spread`: seconds over which the clients of a
    round start (a client refused with 429 waits up to half of it). `log`: a callable given each
    round's line."""
    if requests_per_client is None and duration is None:
        raise ValueError("requests_per_client and duration are both None: give one")
    async with httpx.AsyncClient(timeout=request_timeout) as probe:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = await probe.get(f"{url.rstrip('/')}/v1/models", headers=headers)
        r.raise_for_status()
        info = r.json()["data"][0]
        s = _Soak(url, api_key, info["id"], int(info.get("max_model_len") or 2048), max_body_bytes,
                  request_timeout, burst, openai_share, spread)
        s.make_pool(random.Random(seed))
        await s.reference(probe)
        report = SoakReport(url, clients, [dict(e) for e in s.pool])
        kinds = list(KIND_WEIGHTS)
        for rnd in range(1, rounds + 1):
            before = await s.scrape(probe)
            s.outcomes = []
            t0 = time.monotonic()
            until = None if duration is None else t0 + duration
            await asyncio.gather(*(
                s.client(i, random.Random(seed * 1_000_003 + rnd * 10_007 + i),
                         kinds[(i + rnd) % len(kinds)] if i < len(kinds) else None,
                         requests_per_client, until) for i in range(clients)))
            seconds = time.monotonic() - t0
            drained, after = await s.drain(probe, drain_timeout)
            report.rounds.append(_round_report(rnd, seconds, s.outcomes, before, after, drained,
                                               rss_mb(pid), await s.check(probe, rnd)))
            if log is not None:
                r_ = report.rounds[-1]
                log(f"round {rnd}: {r_.sent} sent, " +
                    ", ".join(f"{r_.counts.get(c, 0)} {c}" for c in CATEGORIES) +
                    f", kv {r_.kv_cache_usage}, RSS {r_.rss_mb}, {seconds:.1f} s")
    return report


def _round_report(rnd: int, seconds: float, outcomes: list[Outcome], before: str, after: str,
                  drained: bool, rss: float | None, check_ok: bool) -> RoundReport:
    counts = Counter(o.category for o in outcomes)
    rejected = Counter(o.label for o in outcomes if o.category == "rejected")
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        key = f"rejected {o.label}" if o.category == "rejected" else o.category
        by_kind.setdefault(o.kind, Counter())[key] += 1
    name = "workbench:request_rejected_total"
    b, a = metric_values(before, name, "reason"), metric_values(after, name, "reason")
    server_rejected = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
    client_rejected = dict(Counter(o.reason for o in outcomes if o.reason is not None))
    name = "workbench:request_success_total"
    sb = metric_values(before, name, "finished_reason")
    sa = metric_values(after, name, "finished_reason")
    success = sum(sa.get(k, 0) - sb.get(k, 0) for k in FINISHED)
    return RoundReport(
        round=rnd, seconds=round(seconds, 2), sent=len(outcomes),
        counts={c: counts.get(c, 0) for c in CATEGORIES}, rejected=dict(sorted(rejected.items())),
        by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
        lost_details=[f"{o.kind} {o.via}: {o.label}" for o in outcomes if o.category == "lost"],
        drained=drained, kv_cache_usage=metric(after, "workbench:kv_cache_usage_perc"),
        rss_mb=None if rss is None else round(rss, 1), check_ok=check_ok,
        server_rejected=server_rejected, client_rejected=client_rejected,
        server_success=success)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.loadtest.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=4,
                    help="requests each client sends per round (a burst counts as one)")
    ap.add_argument("--duration", type=float,
                    help="seconds each round lasts instead of --requests-per-client")
    ap.add_argument("--pid", type=int, help="the server's process id, for its RSS")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20,
                    help="the server's --max-body-bytes (oversized bodies pass it)")
    ap.add_argument("--request-timeout", type=float, default=120.0,
                    help="seconds after which an unanswered request counts as lost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the report to this JSON file")
    args = ap.parse_args(argv)
    report = asyncio.run(soak(
        args.url, clients=args.clients, rounds=args.rounds,
        requests_per_client=None if args.duration else args.requests_per_client,
        duration=args.duration, seed=args.seed, api_key=args.api_key, pid=args.pid,
        max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
        log=lambda line: print(line, file=sys.stderr, flush=True)))
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
