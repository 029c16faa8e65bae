"""Replicas and failover behind the router: health checks, stable re-hashing over the replicas
that are up, transparent retries before an answer starts, clean errors after, and the router's
view of its replicas. The burst test runs two real replicas and kills one in the middle."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from starlette.testclient import TestClient
from test_serve import (MODEL, free_port, offline, start_server, stop_server,  # noqa: F401
                        wait_healthy)

from workbench import SamplingParams
from workbench.serve.router import REPLICA_HEADER, Router, build_router_app, routing_key, sse_error

URLS = ["http://a:1", "http://b:2", "http://c:3", "http://d:4"]
KEYS = [{"prompt": f"conversation {k} starts here"} for k in range(400)]


def metric(text: str, name: str, **labels) -> float:
    for m in re.finditer(rf'^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$', text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
            return float(m.group(2))
    raise AssertionError(f"{name} {labels} missing from /metrics")


def test_a_down_replica_gets_nothing_and_only_its_keys_move():
    router = Router(URLS, "prefix")
    before = [router.choose(k) for k in KEYS]
    assert set(before) == {0, 1, 2, 3}
    router.fleet.failed(1, "refused", connect=True)          # a failed connect: down at once
    after = [router.choose(k) for k in KEYS]
    assert 1 not in after
    assert all(a == b for a, b in zip(after, before) if b != 1)   # the others' keys stay put
    moved = [a for a, b in zip(after, before) if b == 1]
    assert moved and set(moved) == {0, 2, 3}                  # spread over all the rest
    router.fleet.succeeded_check(1)
    assert [router.choose(k) for k in KEYS] == before         # back up: the old mapping
    assert router.choose(KEYS[0], exclude=[before[0]]) not in (None, before[0])
    for i in range(4):
        router.fleet.failed(i, "refused", connect=True)
    assert router.choose(KEYS[0]) is None


def test_routing_key_ignores_the_last_message_and_down_replicas_in_the_baselines():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]}
    assert routing_key(chat) == routing_key({**chat, "messages": chat["messages"][:1] + [
        {"role": "user", "content": "b"}]})
    rr = Router(URLS[:3], "round_robin")
    rr.fleet.failed(1, "refused", connect=True)
    assert [rr.choose({}) for _ in range(4)] == [0, 2, 0, 2]
    rnd = Router(URLS[:3], "random", seed=1)
    rnd.fleet.failed(2, "refused", connect=True)
    assert {rnd.choose({}) for _ in range(50)} == {0, 1}


def test_consecutive_failures_mark_down_and_one_good_check_marks_up():
    router = Router(URLS[:2], "prefix", unhealthy_after=3)
    fleet = router.fleet
    for n in (1, 2):
        fleet.failed(0, f"GET /health failed {n}")
        assert fleet.items[0].up and fleet.items[0].consecutive_failures == n
    fleet.failed(0, "GET /health failed 3")
    view = fleet.items[0].view()
    assert not view["up"] and view["consecutive_failures"] == 3
    assert view["last_error"] == "GET /health failed 3"
    assert fleet.healthy() == [1]
    fleet.succeeded_check(0)
    assert fleet.items[0].up and fleet.items[0].consecutive_failures == 0


@pytest.mark.parametrize("kw,msg", [
    ({"max_retries": -1}, "max_retries=-1 is invalid"),
    ({"health_interval": 0}, "health_interval=0 is invalid"),
    ({"unhealthy_after": 0}, "unhealthy_after=0 is invalid"),
    ({"health_timeout": -1.0}, "health_timeout=-1.0 is invalid"),
])
def test_bad_settings_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Router(URLS, **kw)


def test_the_cut_stream_event_is_an_openai_error_then_done():
    lines = [l for l in sse_error("replica http://a failed mid-stream").decode().split("\n\n") if l]
    assert json.loads(lines[0][6:]) == {"error": {
        "message": "replica http://a failed mid-stream", "type": "server_error", "param": None,
        "code": None}}
    assert lines[1] == "data: [DONE]"


def test_no_replica_up_is_a_503_with_retry_after():
    """Both replicas refuse connections: the request tries each once, marks both down, and the
    client gets a 503 it can retry after; the router's view says why."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = Router(dead, "prefix", health_interval=3.0)
    with TestClient(build_router_app(router)) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert err["type"] == "server_error" and "no replica is up" in err["message"]
        assert client.get("/health").status_code == 503
        view = client.get("/router/replicas").json()["replicas"]
        assert [v["up"] for v in view] == [False, False]
        assert all("ConnectError" in v["last_error"] for v in view)
        assert sum(v["requests"] for v in view) == 2 and sum(v["retries"] for v in view) == 1
        text = client.get("/metrics").text
        for url in dead:
            assert metric(text, "workbench_router:replica_up", replica=url) == 0
        assert sum(metric(text, "workbench_router:requests_total", replica=u, outcome=o)
                   for u in dead for o in ("retried", "failed")) == 2


class Cut(httpx.AsyncByteStream):
    """A body that breaks after `parts`, as when the replica process dies."""
    def __init__(self, *parts: bytes):
        self.parts = parts

    async def __aiter__(self):
        for part in self.parts:
            yield part
        raise httpx.RemoteProtocolError("peer closed connection without sending complete "
                                        "message body (incomplete chunked read)")


def event(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n".encode()


GOOD_JSON = {"choices": [{"index": 0, "text": "fine"}]}
FAILURES = {  # how the first replica fails before its answer starts, per the request's kind
    "refused": lambda req: (_ for _ in ()).throw(httpx.ConnectError("refused", request=req)),
    "reset": lambda req: (_ for _ in ()).throw(
        httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                  request=req)),
    "503": lambda req: httpx.Response(503, json={"error": {"message": "queue full"}}),
    "500": lambda req: httpx.Response(500, text="Internal Server Error"),
    "reset_before_first_event": lambda req: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=Cut()),
}


def good(req):
    if json.loads(req.content).get("stream"):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=(
            httpx.ByteStream(event("fi") + event("ne") + b"data: [DONE]\n\n")))
    return httpx.Response(200, json=GOOD_JSON)


def fake_router(first_fails, body, other_answers=good, **kw):
    """A router over replicas a and b answered in process; the one `body` goes to first
    answers with `first_fails`, the other with `other_answers`. Returns (router, app, first,
    other)."""
    router = Router(["http://a:1", "http://b:2"], "prefix", health_interval=60, **kw)
    first = router.choose(body)
    hosts = {"ab"[first]: first_fails, "ab"[1 - first]: other_answers}

    def handler(req):
        if req.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return hosts[req.url.host](req)
    app = build_router_app(router, httpx.MockTransport(handler))
    return router, app, router.replicas[first], router.replicas[1 - first]


def outcomes(client, url):
    text = client.get("/metrics").text
    return {o: metric(text, "workbench_router:requests_total", replica=url, outcome=o)
            for o in ("ok", "retried", "failed", "cut") if metric(
                text, "workbench_router:requests_total", replica=url, outcome=o)}


@pytest.mark.parametrize("failure,streamed", [
    ("refused", False), ("refused", True), ("reset", False), ("reset", True), ("503", False),
    ("503", True), ("reset_before_first_event", True)])
def test_a_failure_before_the_answer_starts_is_retried_on_the_other_replica(failure, streamed):
    body = {"prompt": "hello", "max_tokens": 2, "stream": streamed}
    router, app, first, other = fake_router(FAILURES[failure], body)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == other
        if streamed:
            assert r.text == (event("fi") + event("ne") + b"data: [DONE]\n\n").decode()
        else:
            assert r.json() == GOOD_JSON
        assert outcomes(client, first) == {"retried": 1}
        assert outcomes(client, other) == {"ok": 1}
        view = {v["url"]: v for v in client.get("/router/replicas").json()["replicas"]}
        assert view[first]["retries"] == 1 and view[first]["last_error"]
        assert view[first]["up"] == (failure != "refused")   # refused: down at once
        assert router.counts == [1, 1]


def test_when_every_replica_answers_5xx_the_last_answer_goes_to_the_client():
    body = {"prompt": "hello"}
    router, app, first, other = fake_router(FAILURES["503"], body, FAILURES["500"])
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.text == "Internal Server Error"
        assert outcomes(client, first) == {"retried": 1}
        assert outcomes(client, other) == {"failed": 1}
    router, app, first, other = fake_router(FAILURES["503"], body, max_retries=0)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["message"] == "queue full"
        assert outcomes(client, first) == {"failed": 1} and router.counts.count(0) == 1


def test_a_stream_cut_after_it_started_ends_with_an_error_event_then_done():
    body = {"prompt": "hello", "stream": True}
    cut = lambda req: httpx.Response(200, headers={"content-type": "text/event-stream"},  # noqa
                                     stream=Cut(event("fi"), event("n")[:9]))
    router, app, first, other = fake_router(cut, body)
    with TestClient(app) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert lines[0] == event("fi").decode().strip()        # the half event is dropped
        err = json.loads(lines[1][6:])["error"]
        assert err["type"] == "server_error" and err["message"].startswith(
            f"replica {first} failed mid-stream")
        assert lines[2:] == ["data: [DONE]"]
        assert outcomes(client, first) == {"cut": 1} and outcomes(client, other) == {}


def test_a_non_streamed_answer_cut_mid_body_is_a_502():
    body = {"prompt": "hello"}
    cut = lambda req: httpx.Response(200, headers={"content-type": "application/json"},  # noqa
                                     stream=Cut(b'{"choices": [{"ind'))
    router, app, first, other = fake_router(cut, body)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["type"] == "server_error" and "failed mid-response" in err["message"]
        assert outcomes(client, first) == {"cut": 1}


def start_router(replicas, *extra):
    port = free_port()
    cmd = [sys.executable, "-m", "workbench", "router", "--policy", "prefix", "--port",
           str(port), *extra] + [a for u in replicas for a in ("--replica", u)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return wait_healthy(proc, f"http://127.0.0.1:{port}", "router", 30)


async def one(client, http, url, prompt, streamed, started=None):
    """("completed" | "cut", text, replica that answered) for one request through the router."""
    args = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True})
    if not streamed:
        raw = await client.completions.with_raw_response.create(**args)
        return "completed", raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]
    if streamed == "raw":                      # the SSE lines themselves: error, then [DONE]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            text, datas = "", []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                datas.append(line[6:])
                if datas[-1] != "[DONE]" and "error" not in json.loads(datas[-1]):
                    text += json.loads(datas[-1])["choices"][0]["text"]
                    if text and started:
                        started(r.headers[REPLICA_HEADER])
            assert datas[-1] == "[DONE]", datas[-3:]
            if "error" in datas[-2]:
                err = json.loads(datas[-2])["error"]
                assert err["type"] == "server_error" and "mid-stream" in err["message"], err
                return "cut", text, r.headers[REPLICA_HEADER]
            return "completed", text, r.headers[REPLICA_HEADER]
    raw = await client.completions.with_raw_response.create(**args, stream=True)
    text = ""
    try:
        async for chunk in raw.parse():
            text += chunk.choices[0].text if chunk.choices else ""
            if text and started:
                started(raw.headers[REPLICA_HEADER])
    except openai.APIError as err:
        assert err.type == "server_error" and "failed mid-stream" in err.message, err
        return "cut", text, raw.headers[REPLICA_HEADER]
    return "completed", text, raw.headers[REPLICA_HEADER]


MAX_TOKENS = 120


def test_killing_a_replica_mid_burst_loses_no_request(tiny_folder, offline):  # noqa: F811
    """24 concurrent requests over two replicas, half streamed; one replica is SIGKILLed once a
    stream on it has started. Every request completes with the offline greedy text, except
    streams that had started on the killed replica: those end with the error event. Requests
    sent after the kill all land on the survivor."""
    procs = []
    try:
        with ThreadPoolExecutor(2) as pool:
            for proc, _ in pool.map(lambda _: start_server(tiny_folder), range(2)):
                procs.append(proc)
        replicas = [p.args[p.args.index("--port") + 1] for p in procs]
        replicas = [f"http://127.0.0.1:{port}" for port in replicas]
        victim, survivor = replicas
        router_proc, url = start_router(replicas, "--health-interval", "0.5",
                                        "--health-timeout", "5")
        procs.append(router_proc)
        # Six streamed and six not on each replica, as the router's own hashing places them.
        placement = Router(replicas, "prefix")
        kinds = [True, "raw", False]
        burst, per = [], {}
        for k in range(400):
            prompt = f"Request {k}: tell me about the number {k}"
            key = (placement.choose({"prompt": prompt}), bool(kinds[k % 3]))
            if per.get(key, 0) < 6:
                per[key] = per.get(key, 0) + 1
                burst.append((prompt, kinds[k % 3]))
        assert len(burst) == 24
        after = [(f"After the kill {k}: count to {k}", kinds[k % 3]) for k in range(6)]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [p for p, _ in burst + after]
        want = dict(zip(prompts, (o.outputs[0].text for o in offline.generate(prompts, params))))

        async def run_all():
            victim_started = asyncio.Event()

            def started(replica):
                if replica == victim:
                    victim_started.set()

            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                          timeout=120) as client, \
                    httpx.AsyncClient(timeout=120) as http:
                tasks = [asyncio.create_task(one(client, http, url, p, s, started))
                         for p, s in burst]
                await victim_started.wait()
                procs[0].send_signal(signal.SIGKILL)
                late = [asyncio.create_task(one(client, http, url, p, s)) for p, s in after]
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                health = (await http.get(f"{url}/health")).status_code
                return results, await asyncio.wait_for(asyncio.gather(*late), 120), health

        results, late, health = asyncio.run(run_all())
        assert health == 200
        completed = [r for r in results if r[0] == "completed"]
        cut = [(r, s) for r, (_, s) in zip(results, burst) if r[0] == "cut"]
        print(f"\nsent {len(burst)}, completed {len(completed)}, cut {len(cut)}; after the kill: "
              f"sent {len(after)}, completed {sum(r[0] == 'completed' for r in late)}")
        assert len(results) == len(burst) and len(late) == len(after) > 0
        assert len(completed) + len(cut) == len(burst)
        assert cut, "the kill came after every stream on the victim had finished"
        for (outcome, text, replica), (prompt, streamed) in zip(results, burst):
            if outcome == "completed":
                assert text == want[prompt], prompt
            else:                                # started on the victim, then the victim died
                assert streamed and replica == victim, (prompt, streamed, replica)
                assert want[prompt].startswith(text) and text != want[prompt], prompt
        for (outcome, text, replica), (prompt, _) in zip(late, after):
            assert (outcome, replica) == ("completed", survivor), prompt
            assert text == want[prompt], prompt
        assert any(placement.choose({"prompt": p}) == 0 for p, _ in after)

        for _ in range(100):                   # the health checks run every 0.5 s
            view = httpx.get(f"{url}/router/replicas").json()["replicas"]
            if not view[0]["up"]:
                break
            time.sleep(0.1)
        assert [v["url"] for v in view] == replicas
        assert [v["up"] for v in view] == [False, True], view
        assert view[0]["last_error"] and view[0]["consecutive_failures"] >= 1
        assert view[1]["last_error"] is None and view[1]["retries"] == 0
        assert view[0]["requests"] >= 12 and view[0]["retries"] >= 1
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["replicas_up"] == [survivor]
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "workbench_router:replica_up", replica=victim) == 0
        assert metric(text, "workbench_router:replica_up", replica=survivor) == 1
        assert metric(text, "workbench_router:requests_total", replica=victim,
                      outcome="cut") == len(cut)
        assert metric(text, "workbench_router:requests_total", replica=victim,
                      outcome="retried") == view[0]["retries"]
        assert metric(text, "workbench_router:requests_total", replica=survivor,
                      outcome="ok") == len(burst) + len(after) - len(cut) - sum(
                          r[2] == victim for r in results if r[0] == "completed")
        for u in replicas:
            assert metric(text, "workbench_router:requests_total", replica=u,
                          outcome="failed") == 0
    finally:
        for p in procs:
            stop_server(p)
