"""A router in front of several engine replicas (one server process each): it forwards every
/v1 request to one replica that is up and streams the answer back; a replica that fails before
its answer starts costs the client nothing but the time, the request goes to another one.

policy "prefix": requests that start alike go to the same replica, so that replica's prefix cache
holds their shared start (a system prompt, a few-shot header) and skips recomputing it. The key
is the conversation before its last message (chat), or the first `prefix_chars` characters /
`prefix_tokens` token ids of the prompt (completions); the replica is the healthy one with the
highest sha256(replica, key) (rendezvous hashing). SGLang's router does this with a radix tree of
what each replica has seen; hashing a fixed-length start is the simple version. "random" and
"round_robin" ignore the content: the baselines.

Failures: a request that fails to connect, is reset before its answer starts, or gets a 5xx
before any event goes to another healthy replica (at most `max_retries` times). A stream cut
after it started ends with an OpenAI-shaped error event and `data: [DONE]`; a non-streamed answer
cut mid-body is a 502; with no replica up, a 503 with Retry-After. GET /router/replicas is the
router's view of its replicas, /metrics the same for Prometheus (workbench/serve/replicas.py).

    python -m workbench router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \
        --policy prefix --port 8000
"""
from __future__ import annotations

import asyncio
import json
import math
import random
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from workbench.serve.replicas import Replicas, rendezvous_order

POLICIES = ("prefix", "random", "round_robin")
REPLICA_HEADER = "x-workbench-replica"       # which replica answered, for clients and tests
CONNECT_TIMEOUT = 3.0


def routing_key(body: dict, prefix_chars: int = 256, prefix_tokens: int = 64) -> str:
    if "messages" in body and isinstance(body["messages"], list) and body["messages"]:
        return json.dumps(body["messages"][:-1] or body["messages"][:1], sort_keys=True)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return json.dumps(prompt[:prefix_tokens])
    return str(prompt)[:prefix_chars]


class Router:
    def __init__(self, replicas: list[str], policy: str = "prefix", seed: int = 0, *,
                 health_interval: float = 2.0, unhealthy_after: int = 2,
                 health_timeout: float = 1.0, max_retries: int = 2):
        if not replicas:
            raise ValueError("replicas=[] is invalid: give at least one replica URL")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: allowed are {', '.join(POLICIES)}")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} is invalid: allowed are integers >= 0")
        self.replicas, self.policy = [r.rstrip("/") for r in replicas], policy
        self.fleet = Replicas(self.replicas, health_interval, unhealthy_after, health_timeout)
        self.max_retries = max_retries
        self._rng = random.Random(seed)
        self._turn = 0

    @property
    def counts(self) -> list[int]:
        return [rep.sent for rep in self.fleet.items]

    def choose(self, body: dict, exclude=()) -> int | None:
        """The replica for `body` among those up and not in `exclude`; None when there is none."""
        ok = [i for i in self.fleet.healthy() if i not in exclude]
        if not ok:
            return None
        if self.policy == "random":
            return self._rng.choice(ok)
        if self.policy == "round_robin":
            self._turn += 1
            return ok[(self._turn - 1) % len(ok)]
        # Rendezvous hashing: a replica going down moves only its own keys, spread over the rest.
        return next(i for i in rendezvous_order(routing_key(body), self.replicas) if i in ok)


def openai_error(status: int, message: str, code: str | None = None, headers=None):
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": code}}, status, headers=headers)


def sse_error(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(payload)}\n\n".encode() + b"data: [DONE]\n\n"


async def sse_events(upstream: httpx.Response):
    """Whole events only, so that an event cut in half never reaches the client."""
    buf = b""
    async for chunk in upstream.aiter_raw():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buf.strip():
        yield buf


def build_router_app(router: Router, transport: httpx.AsyncBaseTransport | None = None):
    """`transport` replaces the network (tests stand replicas in with httpx.MockTransport)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT),
                               limits=httpx.Limits(max_connections=None), transport=transport)
    fleet = router.fleet

    @asynccontextmanager
    async def lifespan(app):
        checks = asyncio.create_task(fleet.check_forever(client))
        yield
        checks.cancel()
        await client.aclose()

    app = FastAPI(title="inference workbench router", lifespan=lifespan)

    def none_up():
        return openai_error(503, "no replica is up: "
                            + "; ".join(f"{r.url}: {r.last_error}" for r in fleet.items),
                            "no_replica_available",
                            {"Retry-After": str(max(1, math.ceil(fleet.health_interval)))})

    async def attempt(i: int, method: str, path: str, raw: bytes, headers: dict, streamed: bool):
        """(None, the answer to give) or (a 5xx answer, None) from replica i; None when it
        failed before its answer started."""
        url = router.replicas[i]
        fleet.items[i].sent += 1
        try:
            upstream = await client.send(
                client.build_request(method, url + path, content=raw, headers=headers),
                stream=True)
        except httpx.TransportError as err:
            fleet.failed(i, f"{method} {path}: {err!r}",
                         connect=isinstance(err, httpx.ConnectError))
            return None
        out_headers = {REPLICA_HEADER: url}
        if "retry-after" in upstream.headers:
            out_headers["Retry-After"] = upstream.headers["retry-after"]
        if upstream.status_code >= 500:
            try:
                content = await upstream.aread()
            except httpx.TransportError:
                content = b""
            await upstream.aclose()
            fleet.items[i].last_error = f"{method} {path} answered {upstream.status_code}"
            return Response(content, upstream.status_code, out_headers,
                            upstream.headers.get("content-type")), None
        if not streamed or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.TransportError as err:
                fleet.failed(i, f"{method} {path} cut mid-body: {err!r}")
                fleet.record(i, "cut")
                return None, openai_error(502, f"replica {url} failed mid-response: {err!r}")
            finally:
                await upstream.aclose()
            fleet.record(i, "ok")
            return None, Response(content, upstream.status_code, out_headers,
                                  upstream.headers.get("content-type"))
        events = sse_events(upstream)
        try:                                 # nothing went to the client yet: still retryable
            first = await anext(events, b"")
        except httpx.TransportError as err:
            fleet.failed(i, f"{method} {path} reset before the first event: {err!r}")
            await upstream.aclose()
            return None

        async def relay():
            outcome = "ok"
            try:
                yield first
                async for event in events:
                    yield event
            except httpx.TransportError as err:
                outcome = "cut"
                fleet.failed(i, f"{method} {path} cut mid-stream: {err!r}")
                yield sse_error(f"replica {url} failed mid-stream: {err!r}")
            finally:                         # a client that leaves closes our upstream too
                fleet.record(i, outcome)
                await upstream.aclose()
        return None, StreamingResponse(relay(), headers=out_headers,
                                       media_type="text/event-stream")

    async def send(request: Request, method: str, path: str, raw: bytes = b""):
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}                          # the replica answers malformed JSON with its 400
        body = body if isinstance(body, dict) else {}
        headers = {"content-type": "application/json", **_auth(request)}
        i, tried, server_error = router.choose(body), [], None
        if i is None:
            return none_up()
        while True:
            tried.append(i)
            result = await attempt(i, method, path, raw, headers, bool(body.get("stream")))
            if result is not None:
                server_error, answer = result
                if answer is not None:
                    return answer
            nxt = router.choose(body, exclude=tried) if len(tried) <= router.max_retries else None
            fleet.record(i, "retried" if nxt is not None else "failed")
            if nxt is None:
                break
            i = nxt
        if server_error is not None:
            return server_error
        if not fleet.healthy():
            return none_up()
        return openai_error(502, f"no replica answered after {len(tried)} attempts: "
                            + "; ".join(f"{router.replicas[j]}: {fleet.items[j].last_error}"
                                        for j in tried), "replica_failed")

    @app.get("/health")
    async def health():
        up = fleet.healthy()
        return JSONResponse({"status": "ok" if up else "unavailable", "policy": router.policy,
                             "replicas": router.replicas,
                             "replicas_up": [router.replicas[i] for i in up],
                             "requests_per_replica": router.counts}, 200 if up else 503)

    @app.get("/router/replicas")
    async def replicas():
        return {"policy": router.policy, "health_interval": fleet.health_interval,
                "unhealthy_after": fleet.unhealthy_after, "max_retries": router.max_retries,
                "replicas": [rep.view() for rep in fleet.items]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(fleet.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return await send(request, "GET", "/v1/models")

    @app.post("/v1/{endpoint:path}")
    async def forward(endpoint: str, request: Request):
        return await send(request, "POST", f"/v1/{endpoint}", await request.body())

    return app


def _auth(request: Request) -> dict:
    h = request.headers.get("authorization")
    return {"authorization": h} if h else {}
