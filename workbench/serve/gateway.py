"""The server's front door, an ASGI middleware in front of the FastAPI app: API keys, body size,
shutdown refusals, field limits, input screening and rate limits run here, before a body is
parsed by the request models; every request then leaves one JSON line in the access log and, if
it was refused, one count in workbench:request_rejected_total.

Inside the app, `GuardedStream` wraps each engine stream: it enforces --request-timeout, screens
the generated text, and records tokens and timings for the access log.

Refusals and their HTTP statuses:
    401 unauthorized     413 too_large            400 invalid / content_policy
    429 queue_full, queued_tokens, rate_limit_requests, rate_limit_tokens (with Retry-After)
    503 shutting_down (with Retry-After)
    504 timeout: a non-streamed request past --request-timeout; a streamed one instead ends with
        an SSE event {"error": {..., "code": "timeout"}} followed by `data: [DONE]`.
In both cases the request is aborted in the engine at once, freeing its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from workbench.serve.admission import Limits, Refusal, clamp_retry, estimate_prompt_tokens
from workbench.serve.async_engine import Delta, RequestStream
from workbench.serve.protocol import OpenAIError
from workbench.serve.security import ApiKeys, ContentFilter, RateLimiter, screen_input

ACCESS_LOGGER = "workbench.access"
MIB = 1 << 20


@dataclass
class ServingPolicy:
    """What the gateway enforces; every field's default is the server's flag default."""
    api_keys: ApiKeys | None = None
    protect_metrics: bool = False              # /metrics and /health need a key too
    max_body_bytes: int = MIB
    limits: Limits = field(default_factory=Limits)
    rate_limiter: RateLimiter | None = None
    input_filter: ContentFilter = field(default_factory=ContentFilter)
    output_filter: ContentFilter = field(default_factory=ContentFilter)
    request_timeout: float | None = None       # seconds from arrival to the last token
    # JSON lines at INFO; `python -m workbench serve` gives it a handler (make_access_logger).
    access_log: logging.Logger | None = field(
        default_factory=lambda: logging.getLogger(ACCESS_LOGGER))


@dataclass
class RequestContext:
    """One HTTP request, as the gateway and the handlers see it."""
    request_id: str
    method: str
    path: str
    arrival: float                              # time.monotonic()
    key: str | None = None                      # the API key's name
    status: int | None = None
    reason: str | None = None                   # a refusal: workbench:request_rejected reason
    policy: str | None = None                   # the content policy that matched
    prompt_estimate: int = 1
    charged_tokens: int = 0                     # taken from the key's tokens-per-minute bucket
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    finish_reason: str | None = None


_CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "workbench_request", default=None)


def current_request() -> RequestContext | None:
    return _CURRENT.get()


def note_refusal(refusal: Refusal) -> None:
    """Mark the current request as refused (for the access log and the rejected counter)."""
    ctx = _CURRENT.get()
    if ctx is not None:
        ctx.reason = refusal.reason
        ctx.policy = getattr(refusal, "policy", ctx.policy)


def make_access_logger(path: str | None = None) -> logging.Logger:
    """The `workbench.access` logger writing bare JSON lines to `path` (stderr without one)."""
    log = logging.getLogger(ACCESS_LOGGER)
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.FileHandler(path) if path else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    return log


class Gateway:
    """The ASGI middleware. `engine` is the AsyncEngine (for `stopping` and `metrics`)."""

    def __init__(self, app, policy: ServingPolicy, engine, max_model_len: int,
                 shutdown_retry_after: int):
        self.app, self.policy, self.engine = app, policy, engine
        self.max_model_len = max_model_len
        self.shutdown_retry_after = shutdown_retry_after

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        ctx = RequestContext((headers.get("x-request-id") or uuid.uuid4().hex[:16])[:128],
                             scope["method"], scope["path"], time.monotonic())

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                ctx.status = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", ctx.request_id.encode())]
            await send(message)

        token = _CURRENT.set(ctx)
        try:
            try:
                receive = await self._admit(ctx, headers, receive)
            except Refusal as refusal:
                note_refusal(refusal)
                await JSONResponse(refusal.body(), refusal.status,
                                   headers=refusal.headers)(scope, receive, send_tagged)
                return
            if receive is None:                  # the client left while sending its body
                ctx.status = 499
                return
            await self.app(scope, receive, send_tagged)
        except Exception:
            ctx.status = ctx.status or 500      # the error middleware outside answers it
            raise
        finally:
            _CURRENT.reset(token)
            self._finish(ctx)

    # ------------------------------------------------------------------ before the app
    async def _admit(self, ctx: RequestContext, headers: Headers, receive):
        p = self.policy
        keyed = ctx.path.startswith("/v1") or (p.protect_metrics and
                                               ctx.path in ("/metrics", "/health"))
        if p.api_keys is not None and keyed:
            spec = p.api_keys.identify_header(headers.get("authorization"))
            if spec is None:
                raise Refusal("the API key is missing or wrong: send 'Authorization: Bearer "
                              "<key>'", "unauthorized", status=401, code="invalid_api_key")
            ctx.key = spec.name
        if ctx.method != "POST" or not ctx.path.startswith("/v1"):
            return receive
        if self.engine.stopping:
            raise self.shutting_down()
        body = await self._read_body(headers, receive)
        if body is None:
            return None
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None                        # the app answers with its own 400
        if isinstance(parsed, dict):
            self._screen(ctx, parsed)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()               # after the body: disconnect notices
        return replay

    async def _read_body(self, headers: Headers, receive) -> bytes | None:
        limit = self.policy.max_body_bytes
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise self._too_large(f"{int(declared)} bytes", limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._drain(receive, message, size, 16 * limit)
                raise self._too_large(f"more than {limit} bytes", limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _drain(receive, message, size: int, bound: int) -> None:
        """Read and drop the rest of an oversized body (up to `bound` bytes): a socket closed
        with unread data is reset, and the client then loses the 413 it was sent."""
        while message.get("more_body", False) and size <= bound:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))

    @staticmethod
    def _too_large(size: str, limit: int) -> Refusal:
        refusal = Refusal(f"the request body is {size}, and this server accepts at most {limit} "
                          "bytes (--max-body-bytes); HTTP 413", "too_large", status=413)
        refusal.headers = {"Connection": "close"}    # the client need not upload the rest
        return refusal

    def _screen(self, ctx: RequestContext, body: dict) -> None:
        p = self.policy
        p.limits.check(body)
        if p.input_filter:
            screen_input(p.input_filter, body)
        ctx.prompt_estimate = estimate_prompt_tokens(body)
        if p.rate_limiter is not None and p.rate_limiter.enabled:
            max_tokens = next((body[f] for f in ("max_completion_tokens", "max_tokens")
                               if isinstance(body.get(f), int)), None)
            if max_tokens is None:
                default = self.max_model_len if "messages" in body else 16
                max_tokens = p.limits.default_max_tokens(default)
            tokens = ctx.prompt_estimate + max(0, max_tokens)
            p.rate_limiter.admit(ctx.key or "anonymous", tokens)
            ctx.charged_tokens = tokens

    def shutting_down(self) -> Refusal:
        return Refusal("the server is shutting down; retry on another replica or later",
                       "shutting_down", status=503, kind="server_error",
                       retry_after=self.shutdown_retry_after)

    # ------------------------------------------------------------------ after the response
    def _finish(self, ctx: RequestContext) -> None:
        now = time.monotonic()
        if ctx.reason is None and ctx.path.startswith("/v1") and ctx.status in (400, 404, 422):
            ctx.reason = "invalid"
        metrics = self.engine.metrics
        if ctx.reason is not None and metrics is not None:
            metrics.observe_rejected(ctx.reason)
        if ctx.charged_tokens and self.policy.rate_limiter is not None:
            self.policy.rate_limiter.settle(ctx.key or "anonymous", ctx.charged_tokens,
                                            ctx.prompt_tokens + ctx.completion_tokens)
        log = self.policy.access_log
        if log is None or (ctx.path in ("/health", "/metrics") and ctx.status == 200):
            return                               # probes and scrapes stay out of the log
        log.info(json.dumps({
            "time": round(time.time(), 3), "request_id": ctx.request_id, "key": ctx.key,
            "method": ctx.method, "endpoint": ctx.path, "status": ctx.status,
            "prompt_tokens": ctx.prompt_tokens, "completion_tokens": ctx.completion_tokens,
            "ttft_s": None if ctx.first_token is None else round(ctx.first_token - ctx.arrival, 4),
            "e2e_s": round(now - ctx.arrival, 4), "finish_reason": ctx.finish_reason,
            "rejection": ctx.reason, "policy": ctx.policy}))


class GuardedStream:
    """A RequestStream behind the request timeout and the output filter, recording what it
    passes on into the request's context. Same interface: async iteration of Deltas,
    `num_prompt_tokens`, `abort()`."""

    def __init__(self, inner: RequestStream, ctx: RequestContext | None, policy: ServingPolicy):
        self.inner, self.policy = inner, policy
        self.ctx = ctx if ctx is not None else RequestContext("-", "", "", time.monotonic())
        self.ctx.prompt_tokens = inner.num_prompt_tokens
        self.timeout = policy.request_timeout
        self.deadline = None if self.timeout is None else self.ctx.arrival + self.timeout
        self._ready: deque[Delta] = deque()
        self._screens: dict[int, _Screened] = {}   # the output filter's state per choice
        self._inner_done = False

    @property
    def num_prompt_tokens(self) -> int:
        return self.inner.num_prompt_tokens

    def abort(self) -> None:
        self.inner.abort()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        while not self._ready:
            if self._inner_done:
                raise StopAsyncIteration
            self._take(await self._next_inner())
        delta = self._ready.popleft()
        ctx = self.ctx
        if delta.token_ids and ctx.first_token is None:
            ctx.first_token = time.monotonic()
        ctx.completion_tokens += len(delta.token_ids)
        if delta.finished and delta.index == 0:
            ctx.finish_reason = delta.finish_reason
        return delta

    async def _next_inner(self) -> Delta:
        if self.deadline is None:
            return await self.inner.__anext__()
        try:
            return await asyncio.wait_for(self.inner.__anext__(),
                                          max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            self.inner.abort()                  # frees the KV blocks now
            self._inner_done = True
            self.ctx.reason = "timeout"
            raise Refusal(f"the request ran past request-timeout={self.timeout:g} s and was "
                          f"aborted, after {self.ctx.completion_tokens} generated tokens",
                          "timeout", status=504, kind="server_error", code="timeout") from None

    def _take(self, delta: Delta) -> None:
        if delta.last:
            self._inner_done = True
        flt = self.policy.output_filter
        if not flt:
            self._ready.append(delta)
            return
        st = self._screens.setdefault(delta.index, _Screened())
        if st.ended:                             # the filter ended this choice: drop the rest
            if delta.last:
                self._ready.append(Delta("", [], index=delta.index, output=delta.output,
                                         last=True))
            return
        st.held.append(delta)
        st.text += delta.text
        policy, stop, complete = flt.first_match(st.text, partial=not delta.finished,
                                                 start=st.released)
        if complete:
            st.ended = True
            self.ctx.policy = policy
            before = st.text[st.released:stop] if stop is not None else ""
            st.held.clear()
            done = sum(s.ended for s in self._screens.values()) == self.inner.n
            if done:                             # no choice left to run: free the blocks now
                self.inner.abort()
                self._inner_done = True
            self._ready.append(Delta(before, [], None, finished=True,
                                     finish_reason="content_filter", index=delta.index,
                                     last=done or delta.last, output=delta.output))
            return
        limit = len(st.text) if stop is None else stop
        while st.held and st.released + len(st.held[0].text) <= limit:
            released = st.held.pop(0)
            st.released += len(released.text)
            self._ready.append(released)


@dataclass
class _Screened:
    """One choice's text under the output filter: released, and held back while it could still
    be the start of a match."""
    held: list = field(default_factory=list)
    text: str = ""
    released: int = 0
    ended: bool = False


def screened_token_prompt(prompt, content_filter: ContentFilter, tokenizer):
    """A token-id prompt, screened as the text it decodes to: a callable the engine thread runs
    (it owns the tokenizer) before adding the request. Other prompts are screened as text by
    the gateway and pass through unchanged."""
    if not content_filter or tokenizer is None or not isinstance(prompt, list) or \
            not all(isinstance(t, int) for t in prompt):
        return prompt

    def ids():
        try:
            text = tokenizer.decode(prompt)
        except Exception:                       # ids out of the vocabulary: the engine says so
            return prompt
        screen_input(content_filter, {"prompt": text})
        return prompt
    return ids


async def sse_errors(events):
    """The SSE events of a streamed response; an OpenAIError while streaming (a timeout) ends
    the stream with an error event and [DONE] instead of a cut connection."""
    try:
        async for chunk in events:
            yield chunk
    except OpenAIError as err:
        yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()                   # its own finally aborts the request now


def shutdown_retry_after(shutdown_timeout: float) -> int:
    """Retry-After while shutting down: the time this replica takes to go."""
    return clamp_retry(shutdown_timeout)
