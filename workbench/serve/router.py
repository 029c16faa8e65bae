"""A router in front of several engine replicas (one server process each): it forwards every
/v1 request to one replica and streams the answer back.

policy "prefix": requests that start alike go to the same replica, so that replica's prefix cache
holds their shared start (a system prompt, a few-shot header) and skips recomputing it. The key
is the conversation before its last message (chat), or the first `prefix_chars` characters /
`prefix_tokens` token ids of the prompt (completions); replica = sha256(key) mod N. SGLang's
router does this with a radix tree of what each replica has seen; hashing a fixed-length start is
the simple version. "random" and "round_robin" ignore the content: the baselines.

    python -m workbench router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \
        --policy prefix --port 8000
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

POLICIES = ("prefix", "random", "round_robin")


def routing_key(body: dict, prefix_chars: int = 256, prefix_tokens: int = 64) -> str:
    if "messages" in body and isinstance(body["messages"], list) and body["messages"]:
        return json.dumps(body["messages"][:-1] or body["messages"][:1], sort_keys=True)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return json.dumps(prompt[:prefix_tokens])
    return str(prompt)[:prefix_chars]


class Router:
    def __init__(self, replicas: list[str], policy: str = "prefix", seed: int = 0):
        if not replicas:
            raise ValueError("replicas=[] is invalid: give at least one replica URL")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: allowed are {', '.join(POLICIES)}")
        self.replicas, self.policy = [r.rstrip("/") for r in replicas], policy
        self._rng = random.Random(seed)
        self._next = itertools.cycle(range(len(replicas)))
        self.counts = [0] * len(replicas)

    def choose(self, body: dict) -> int:
        if self.policy == "random":
            i = self._rng.randrange(len(self.replicas))
        elif self.policy == "round_robin":
            i = next(self._next)
        else:
            digest = hashlib.sha256(routing_key(body).encode()).digest()
            i = int.from_bytes(digest[:8], "big") % len(self.replicas)
        self.counts[i] += 1
        return i


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="inference workbench router")
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy": router.policy, "replicas": router.replicas,
                "requests_per_replica": router.counts}

    @app.get("/v1/models")
    async def models(request: Request):
        r = await client.get(f"{router.replicas[0]}/v1/models", headers=_auth(request))
        return Response(r.content, r.status_code, media_type="application/json")

    @app.post("/v1/{endpoint:path}")
    async def forward(endpoint: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}                          # the replica answers malformed JSON with its 400
        url = f"{router.replicas[router.choose(body if isinstance(body, dict) else {})]}/v1/{endpoint}"
        req = client.build_request("POST", url, content=raw, headers={
            "content-type": "application/json", **_auth(request)})
        upstream = await client.send(req, stream=True)
        if not (isinstance(body, dict) and body.get("stream")) or upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:                            # the client left: so does our upstream stream
                await upstream.aclose()
        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.exception_handler(httpx.HTTPError)
    async def _upstream_down(request, err):
        return JSONResponse({"error": {"message": f"replica unreachable: {err!r}",
                                       "type": "server_error", "param": None, "code": None}}, 502)

    return app


def _auth(request: Request) -> dict:
    h = request.headers.get("authorization")
    return {"authorization": h} if h else {}
