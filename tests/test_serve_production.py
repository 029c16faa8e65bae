"""The server behind a gateway: waiting bounds, named keys, rate limits, content screening,
request limits, TLS, timeouts, refusals while shutting down, the access log and
workbench:request_rejected_total. Unit tests with a fake clock first; then two server processes:
`gw` (plain HTTP, keys, limits, filters, one sequence at a time) and `tls` (HTTPS, protected
metrics, a request timeout; the last test shuts it down)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time

import httpx
import openai
import pytest

import test_serve
from test_serve import MODEL, metric, start_server, stop_server, wait_idle
from workbench import SamplingParams
from workbench.serve.admission import Admission, DrainRate, QueueState, Refusal
from workbench.serve.async_engine import Delta
from workbench.serve.gateway import GuardedStream, RequestContext, ServingPolicy
from workbench.serve.security import (ApiKeys, ContentFilter, KeySpec, RateLimiter,
                                      parse_key_file)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------- units
def test_every_key_is_compared_whichever_matches():
    calls = []

    def compare(a, b):
        calls.append((a, b))
        return a == b
    keys = ApiKeys([KeySpec("a", "sk-a"), KeySpec("b", "sk-b"), KeySpec("c", "sk-c")], compare)
    for presented, name in (("sk-a", "a"), ("sk-c", "c"), ("sk-x", None)):
        calls.clear()
        spec = keys.identify(presented)
        assert (spec.name if spec else None) == name
        assert len(calls) == 3                      # no early exit on a match or a miss
        assert {len(a) for a, _ in calls} == {32}   # digests: lengths say nothing either
    assert keys.identify_header("Bearer sk-b").name == "b"
    assert keys.identify_header("Basic sk-b") is None and keys.identify_header(None) is None
    with pytest.raises(ValueError, match=r"\['a'\] are used twice"):
        ApiKeys([KeySpec("a", "1"), KeySpec("a", "2")])


def test_key_file_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalice:sk-1\n\nbob:sk-2 rpm=5 tpm=0\n")
    specs = parse_key_file(path)
    assert [(s.name, s.key, s.rpm, s.tpm) for s in specs] == [
        ("alice", "sk-1", None, None), ("bob", "sk-2", 5.0, 0.0)]
    path.write_text("alice sk-1\n")
    with pytest.raises(ValueError, match=r"keys:1: 'alice' is invalid: a key line is NAME:KEY"):
        parse_key_file(path)


def test_rate_limiter_buckets_per_key_with_a_fake_clock():
    clock = FakeClock()
    rl = RateLimiter(rpm=2, tpm=100, keys=[KeySpec("vip", "k", rpm=0, tpm=0)], clock=clock)
    rl.admit("a", 10)
    rl.admit("a", 10)
    with pytest.raises(Refusal) as err:
        rl.admit("a", 10)
    assert err.value.reason == "rate_limit_requests" and err.value.status == 429
    assert err.value.retry_after == 30 and "rate-limit-rpm=2" in err.value.message
    rl.admit("b", 10)                             # another key has its own buckets
    for _ in range(10):
        rl.admit("vip", 10 ** 6)                  # rpm=0 / tpm=0: unlimited for this key
    clock.t += 30
    rl.admit("a", 70)               # one request refilled; 30 of 100 tokens left
    clock.t += 30                   # +1 request, +50 tokens: 80
    with pytest.raises(Refusal) as err:
        rl.admit("a", 90)
    assert err.value.reason == "rate_limit_tokens" and err.value.retry_after == 6
    assert "rate-limit-tpm=100" in err.value.message
    rl.settle("a", charged=70, used=20)        # the 70-token request used 20: 50 come back
    rl.admit("a", 90)
    clock.t += 60
    with pytest.raises(Refusal) as err:
        rl.admit("a", 101)                      # more than a minute's worth: never admissible
    assert err.value.retry_after == 60 and "this request alone needs about 101" in \
        err.value.message


def test_admission_bounds_and_retry_after_from_the_drain_rate():
    clock = FakeClock(0.0)
    drain = DrainRate(window=60, clock=clock)
    assert drain.retry_after(1) == 60                 # nothing measured yet: the longest wait
    for t in range(10):
        drain.note(float(t))                          # one request scheduled per second
    clock.t = 10.0
    assert drain.retry_after(1) == 1 and drain.retry_after(5) == 5
    clock.t = 40.0                                    # stalled for 30 s: the rate falls
    assert drain.retry_after(1) == 4
    clock.t = 200.0                                   # nothing in the window
    assert drain.retry_after(1) == 60
    for _ in range(500):
        drain.note(200.0)
    assert drain.retry_after(3) == 1                  # clamped to at least 1 s
    clock.t = 10.0
    drain2 = DrainRate(clock=clock)
    drain2.note(9.0)
    assert drain2.retry_after(200) == 60              # clamped to at most 60 s

    adm = Admission(max_waiting_requests=2, max_queued_prompt_tokens=100, drain=drain)
    clock.t = 200.0
    adm.admit(QueueState(1, 50), 50)
    with pytest.raises(Refusal) as err:
        adm.admit(QueueState(2, 10), 1)
    e = err.value
    assert (e.status, e.reason, e.code) == (429, "queue_full", "queue_full")
    assert e.headers == {"Retry-After": "1"} and "max-waiting-requests=2" in e.message
    with pytest.raises(Refusal) as err:
        adm.admit(QueueState(1, 60), 41)
    assert err.value.reason == "queued_tokens" and "max-queued-prompt-tokens=100" in \
        err.value.message
    adm.admit(QueueState(0, 0), 5000)           # nothing waits: one big prompt is admitted
    with pytest.raises(ValueError, match="max_waiting_requests=0 is invalid"):
        Admission(max_waiting_requests=0)


class FakeStream:
    """A RequestStream's interface over fixed Deltas."""

    def __init__(self, texts):
        self.deltas = [Delta(t, [i], None, finished=i == len(texts) - 1,
                             finish_reason="length" if i == len(texts) - 1 else None,
                             last=i == len(texts) - 1)
                       for i, t in enumerate(texts)]
        self.aborted = False
        self.num_prompt_tokens = 3
        self.n = 1

    async def __anext__(self):
        if not self.deltas:
            raise StopAsyncIteration
        return self.deltas.pop(0)

    def abort(self):
        self.aborted = True


def screened(texts, patterns):
    policy = ServingPolicy(output_filter=ContentFilter.build(patterns, prefix="out"))
    inner = FakeStream(texts)
    ctx = RequestContext("r", "POST", "/v1/completions", time.monotonic())

    async def run():
        return [d async for d in GuardedStream(inner, ctx, policy)]
    return asyncio.run(run()), inner, ctx


def test_output_screen_holds_back_what_could_start_a_match():
    out, inner, ctx = screened(["ab", "c se", "cr", "et!", "more"], ["secret"])
    texts = [d.text for d in out]
    assert texts == ["ab", "c "]                       # "se", "secr" never went out
    assert out[-1].finished and out[-1].finish_reason == "content_filter"
    assert inner.aborted and ctx.policy == "out-1" and ctx.finish_reason == "content_filter"
    # A partial match that never completes is released when the text ends.
    out, inner, ctx = screened(["ab", "c se", "cr"], ["secret"])
    assert [d.text for d in out] == ["ab", "c se", "cr"] and out[-1].finish_reason == "length"
    assert not inner.aborted and ctx.completion_tokens == 3


def test_output_screen_ends_only_the_matching_choice_of_n():
    policy = ServingPolicy(output_filter=ContentFilter.build(["secret"], prefix="out"))
    inner = FakeStream([])
    inner.n = 2
    inner.deltas = [Delta("a sec", [1], index=0), Delta("fine", [2], index=1),
                    Delta("ret", [3], index=0), Delta(" too", [4], index=1, finished=True,
                                                      finish_reason="length"),
                    Delta(" tail", [5], index=0, finished=True, finish_reason="length",
                          last=True)]
    ctx = RequestContext("r", "POST", "/v1/completions", time.monotonic())

    async def run():
        return [d async for d in GuardedStream(inner, ctx, policy)]
    out = asyncio.run(run())
    by_index = {i: "".join(d.text for d in out if d.index == i) for i in (0, 1)}
    assert by_index == {0: "a ", 1: "fine too"}
    ends = {d.index: d.finish_reason for d in out if d.finished}
    assert ends == {0: "content_filter", 1: "length"} and out[-1].last
    assert not inner.aborted                 # choice 1 was still running when 0 matched


# ---------------------------------------------------------------------------- the gw server
ALICE, BOB, CAROL = "sk-alice", "sk-bob", "sk-carol"
FRANCE = "The capital of France is"


def rejected(text: str, reason: str) -> float:
    m = re.search(rf'^workbench:request_rejected_total\{{[^}}]*reason="{reason}"[^}}]*\}} '
                  r'([0-9.e+-]+)$', text, re.M)
    assert m, f"workbench:request_rejected_total{{reason={reason!r}}} missing from /metrics"
    return float(m.group(1))


def success(text: str) -> float:
    return sum(float(v) for v in re.findall(
        r'^workbench:request_success_total\{[^}]*\} ([0-9.e+-]+)$', text, re.M))


def unique_window(text: str, width: int = 6) -> str:
    """The first `width` characters of `text` that occur in it once, not at its start."""
    for i in range(1, len(text) - width + 1):
        if text.count(text[i:i + width]) == 1 and text[i:i + width].strip():
            return text[i:i + width]
    raise AssertionError(f"no unique window in {text!r}")


@pytest.fixture(scope="module")
def france_text(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return tiny_llm.generate(FRANCE, params)[0].outputs[0].text


@pytest.fixture(scope="module")
def gw(tiny_folder, tmp_path_factory, france_text):
    """Keys key-1, key-2 (flags), alice (unlimited), bob (server-wide 3 rpm), carol (40 tpm);
    one sequence at a time, at most 2 waiting / 100 queued prompt tokens."""
    d = tmp_path_factory.mktemp("gw")
    (d / "keys.txt").write_text(f"alice:{ALICE} rpm=0 tpm=0\nbob:{BOB}\n"
                                f"carol:{CAROL} rpm=0 tpm=40\n")
    (d / "policies.txt").write_text("# input policies\nno-launch-codes launch\\s+codes\n")
    (d / "screens.py").write_text("def shouting(text):\n"
                                  "    return 'no-shouting' if text.isupper() else None\n")
    blocked_output = unique_window(france_text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]))
        proc, url = start_server(
            tiny_folder, "--max-model-len", "2048", "--max-num-seqs", "1",
            "--api-key", "sk-cli-1", "--api-key", "sk-cli-2", "--api-key-file", str(d / "keys.txt"),
            "--rate-limit-rpm", "3", "--rate-limit-tpm", "1000000",
            "--max-waiting-requests", "2", "--max-queued-prompt-tokens", "100",
            "--max-prompt-tokens", "100", "--max-tokens-limit", "2000", "--max-logprobs", "5",
            "--max-body-bytes", "4096",
            "--block-pattern", r"forbidden\s+word", "--block-pattern-file",
            str(d / "policies.txt"), "--input-screen", "screens:shouting",
            "--block-output-pattern", re.escape(blocked_output),
            "--access-log", str(d / "access.jsonl"))
    yield {"url": url, "log": d / "access.jsonl", "blocked": blocked_output}
    stop_server(proc)


def auth(key=ALICE) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_waiting_bounds_refuse_with_429_before_the_engine(gw, tiny_llm):
    """max-num-seqs=1: A runs; B (60 prompt tokens) waits; C (60 more) passes the 100 queued
    tokens; D (20) waits; E passes the 2 waiting requests. C and E never reach the engine; once
    A goes, B and D finish, the KV cache empties and the server answers as before."""
    url = gw["url"]
    before = httpx.get(f"{url}/metrics").text

    def body(n_prompt, max_tokens, **kw):
        return {"prompt": list(range(5, 5 + n_prompt)), "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, **kw}

    async def waiting_becomes(client, n):
        for _ in range(300):
            text = (await client.get(f"{url}/metrics")).text
            if metric(text, "workbench:num_requests_waiting") == n:
                return text
            await asyncio.sleep(0.05)
        raise AssertionError(f"num_requests_waiting never became {n}")

    async def scenario():
        async with httpx.AsyncClient(timeout=120, headers=auth()) as client:
            async with client.stream("POST", f"{url}/v1/completions",
                                     json=body(3, 2000, stream=True)) as a:
                lines = a.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break                              # A runs
                b = asyncio.create_task(client.post(f"{url}/v1/completions", json=body(60, 4)))
                await waiting_becomes(client, 1)
                c = await client.post(f"{url}/v1/completions", json=body(60, 4))
                d = asyncio.create_task(client.post(f"{url}/v1/completions", json=body(20, 4)))
                await waiting_becomes(client, 2)
                e = await client.post(f"{url}/v1/completions", json=body(5, 4))
                during = (await client.get(f"{url}/metrics")).text
            return await b, c, await d, e, during         # leaving the block drops A

    b, c, d, e, during = asyncio.run(scenario())
    assert c.status_code == 429 and c.json()["error"]["code"] == "queued_tokens"
    assert "max-queued-prompt-tokens=100" in c.json()["error"]["message"]
    assert e.status_code == 429 and e.json()["error"]["code"] == "queue_full"
    assert "max-waiting-requests=2" in e.json()["error"]["message"]
    for r in (c, e):
        assert 1 <= int(r.headers["Retry-After"]) <= 60
    # The engine held A running and B, D waiting: the refused ones never reached it.
    assert metric(during, "workbench:num_requests_running") == 1
    assert metric(during, "workbench:num_requests_waiting") == 2
    for r in (b, d):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    after = wait_idle(url, 15)
    assert metric(after, "workbench:kv_cache_usage_perc") == 0
    assert success(after) - success(before) == 2          # B and D; A was aborted
    assert rejected(after, "queue_full") - rejected(before, "queue_full") == 1
    assert rejected(after, "queued_tokens") - rejected(before, "queued_tokens") == 1
    r = httpx.post(f"{url}/v1/completions", headers=auth(), timeout=60,
                   json={"prompt": FRANCE, "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True})
    want = tiny_llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))[0].outputs[0].text
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_named_keys_and_a_wrong_key(gw):
    url = gw["url"]
    before = httpx.get(f"{url}/metrics").text
    for key in ("sk-cli-1", "sk-cli-2", ALICE):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-alicf", max_retries=0).models.list()
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # Without --protect-metrics the probes and the scrape need no key.
    assert httpx.get(f"{url}/health").status_code == 200
    after = httpx.get(f"{url}/metrics").text
    assert rejected(after, "unauthorized") - rejected(before, "unauthorized") == 2


def test_rate_limits_per_key(gw):
    url = gw["url"]
    before = httpx.get(f"{url}/metrics").text

    def post(key, **kw):
        return httpx.post(f"{url}/v1/completions", headers=auth(key), timeout=60,
                          json={"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 8,
                                "ignore_eos": True, **kw})
    assert [post(BOB).status_code for _ in range(3)] == [200, 200, 200]
    r = post(BOB)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_requests"
    assert "rate-limit-rpm=3" in r.json()["error"]["message"] and "'bob'" in r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert post(ALICE).status_code == 200                 # other keys are unaffected
    # carol: 40 tokens a minute; each request is 8 prompt + 8 max_tokens.
    assert [post(CAROL).status_code for _ in range(2)] == [200, 200]
    r = post(CAROL)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_tokens"
    assert "rate-limit-tpm=40" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    after = httpx.get(f"{url}/metrics").text
    for reason in ("rate_limit_requests", "rate_limit_tokens"):
        assert rejected(after, reason) - rejected(before, reason) == 1


@pytest.mark.parametrize("path,body,policy,param", [
    ("completions", {"prompt": "say the forbidden   word"}, "block-pattern-1", "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                       {"role": "user", "content": "the launch codes?"}]},
     "no-launch-codes", "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "TELL ME NOW"}]},
     "no-shouting", "messages"),
])
def test_input_screening_refuses_naming_the_policy(gw, path, body, policy, param):
    url = gw["url"]
    before = httpx.get(f"{url}/metrics").text
    r = httpx.post(f"{url}/v1/{path}", headers=auth(), json={**body, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "content_policy" and err["param"] == param
    assert f"'{policy}'" in err["message"]
    after = httpx.get(f"{url}/metrics").text
    assert rejected(after, "content_policy") - rejected(before, "content_policy") == 1
    clean = httpx.post(f"{url}/v1/completions", headers=auth(), timeout=60,
                       json={"prompt": "a harmless word", "max_tokens": 2})
    assert clean.status_code == 200


def test_a_token_id_prompt_is_screened_as_its_text(gw, tiny_llm):
    ids = tiny_llm.get_tokenizer().encode("tell the forbidden word", add_special_tokens=False)
    r = httpx.post(f"{gw['url']}/v1/completions", headers=auth(), timeout=60,
                   json={"prompt": ids, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "content_policy" and "'block-pattern-1'" in err["message"]


def test_output_screening_ends_with_content_filter(gw, france_text):
    """The blocked text is a window of the greedy answer; the answer stops before it, in both
    forms, and the part that matched is never sent."""
    url, blocked = gw["url"], gw["blocked"]
    want = france_text[:france_text.index(blocked)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0)
    kw = dict(model=MODEL, prompt=FRANCE, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "content_filter"
    assert r.choices[0].text == want and blocked not in r.choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "content_filter"
    streamed = ""
    for t in texts:
        streamed += t
        assert blocked not in streamed


@pytest.mark.parametrize("path,body,status,param,value,limit", [
    ("completions", {"prompt": "hi", "max_tokens": 2001}, 400, "max_tokens", "2001", "2000"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 5000}, 400, "max_completion_tokens",
     "5000", "2000"),
    ("completions", {"prompt": "hi", "n": 9}, 400, "n", "9", "8"),
    ("completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs", "6", "5"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 6}, 400, "top_logprobs", "6", "5"),
    ("completions", {"prompt": list(range(5, 106))}, 400, "prompt", "101", "100"),
    ("completions", {"prompt": "x" * 5000}, 413, None, "bytes", "4096"),
])
def test_each_limit_names_the_field_the_value_and_the_limit(gw, path, body, status, param,
                                                             value, limit):
    url = gw["url"]
    before = httpx.get(f"{url}/metrics").text
    r = httpx.post(f"{url}/v1/{path}", headers=auth(), json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and value in err["message"] and limit in err["message"], err
    after = httpx.get(f"{url}/metrics").text
    reason = "too_large" if status == 413 else "invalid"
    assert rejected(after, reason) - rejected(before, reason) == 1


def read_log_until(path, done, timeout: float = 10.0) -> list[dict]:
    """The access log's JSON lines once `done(lines)` holds (or after `timeout`): the gateway
    writes a request's line after the response is sent, so the client can get there first."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if done(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_access_log_has_one_json_line_per_request(gw):
    url = gw["url"]
    rid = "trace-me-0001"
    r = httpx.post(f"{url}/v1/completions", headers={**auth("sk-cli-2"), "X-Request-Id": rid},
                   json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    httpx.post(f"{url}/v1/completions", headers=auth("wrong"), json={"prompt": "hi"})
    lines = read_log_until(gw["log"], lambda lines: lines and lines[-1]["status"] == 401)
    fields = {"request_id", "key", "endpoint", "status", "prompt_tokens", "completion_tokens",
              "ttft_s", "e2e_s", "finish_reason", "rejection"}
    assert all(fields <= set(line) for line in lines)
    mine = [line for line in lines if line["request_id"] == rid]
    assert len(mine) == 1
    m = mine[0]
    assert (m["key"], m["endpoint"], m["status"], m["finish_reason"], m["rejection"]) == \
        ("key-2", "/v1/completions", 200, "length", None)
    assert m["prompt_tokens"] > 0 and m["completion_tokens"] == 3
    assert 0 < m["ttft_s"] <= m["e2e_s"]
    last = lines[-1]
    assert (last["status"], last["rejection"], last["key"]) == (401, "unauthorized", None)
    reasons = {line["rejection"] for line in lines}
    assert {"queue_full", "content_policy", "invalid", "too_large"} <= reasons
    assert any(line["finish_reason"] == "content_filter" for line in lines)


# ---------------------------------------------------------------------------- the tls server
TLS_KEY = "sk-tls"


def self_signed_certificate(folder) -> tuple[str, str]:
    """(certificate, key) files for 127.0.0.1, from `cryptography` or the openssl CLI."""
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("no way to make a certificate: neither the cryptography package nor "
                        "the openssl command is installed")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
                        "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                        "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(private.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName(
                       [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    with open(cert, "wb") as f:
        f.write(certificate.public_bytes(serialization.Encoding.PEM))
    with open(key, "wb") as f:
        f.write(private.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.TraditionalOpenSSL,
                                      serialization.NoEncryption()))
    return cert, key


class TlsProbe:
    """start_server's readiness probe over HTTPS with the key (its own is plain HTTP)."""
    HTTPError = httpx.HTTPError

    def __init__(self, context: ssl.SSLContext):
        self.context = context

    def get(self, url, **kw):
        return httpx.get(url.replace("http://", "https://", 1), verify=self.context,
                         headers=auth(TLS_KEY), **kw)


@pytest.fixture(scope="module")
def tls(tiny_folder, tmp_path_factory):
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    context = ssl.create_default_context(cafile=cert)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_serve, "httpx", TlsProbe(context))
        proc, url = start_server(
            tiny_folder, "--ssl-certfile", cert, "--ssl-keyfile", key, "--api-key", TLS_KEY,
            "--protect-metrics", "--request-timeout", "1.5", "--max-model-len", "2048",
            "--max-num-seqs", "1", "--shutdown-timeout", "30")
    yield {"url": url.replace("http://", "https://", 1), "context": context, "proc": proc}
    stop_server(proc)


def test_the_openai_client_over_tls(tls):
    with httpx.Client(verify=tls["context"]) as http:
        client = openai.OpenAI(base_url=f"{tls['url']}/v1", api_key=TLS_KEY, max_retries=0,
                               http_client=http)
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.chat.completions.create(model=MODEL, max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(httpx.HTTPError):                 # nobody trusts an unknown certificate
        httpx.get(f"{tls['url']}/v1/models", headers=auth(TLS_KEY))


def test_protected_metrics_and_health(tls):
    url, ctx = tls["url"], tls["context"]
    before = httpx.get(f"{url}/metrics", verify=ctx, headers=auth(TLS_KEY)).text
    for path in ("/metrics", "/health"):
        r = httpx.get(f"{url}{path}", verify=ctx)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}{path}", verify=ctx, headers=auth("nope")).status_code == 401
        assert httpx.get(f"{url}{path}", verify=ctx, headers=auth(TLS_KEY)).status_code == 200
    after = httpx.get(f"{url}/metrics", verify=ctx, headers=auth(TLS_KEY)).text
    assert rejected(after, "unauthorized") - rejected(before, "unauthorized") == 4


def test_request_timeout_aborts_and_frees_the_blocks(tls):
    """--request-timeout 1.5, one sequence at a time: the streamed request runs past it (its
    stream ends with an error event and [DONE]); the one waiting behind it too (a 504)."""
    url, ctx = tls["url"], tls["context"]
    before = httpx.get(f"{url}/metrics", verify=ctx, headers=auth(TLS_KEY)).text
    long = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(verify=ctx, headers=auth(TLS_KEY), timeout=60) as client:
            async def streamed():
                async with client.stream("POST", f"{url}/v1/completions",
                                         json={**long, "stream": True}) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]
            a = asyncio.create_task(streamed())
            await asyncio.sleep(0.2)
            return await a, await client.post(f"{url}/v1/completions", json=long)

    events, waited = asyncio.run(scenario())
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "timeout" and "request-timeout=1.5" in err["message"]
    assert all("choices" in json.loads(e[6:]) for e in events[:-2])
    assert waited.status_code == 504 and waited.json()["error"]["code"] == "timeout"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        after = httpx.get(f"{url}/metrics", verify=ctx, headers=auth(TLS_KEY)).text
        if metric(after, "workbench:kv_cache_usage_perc") == 0 and \
                metric(after, "workbench:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(after, "workbench:kv_cache_usage_perc") == 0
    assert rejected(after, "timeout") - rejected(before, "timeout") == 2
    assert success(after) == success(before)         # neither finished: both were aborted


def test_shutting_down_refuses_with_503_and_retry_after(tls):
    """A request whose headers arrived before SIGTERM and whose body arrives after it is
    refused (uvicorn no longer accepts connections, so this is how a request meets a shutdown)."""
    host, port = tls["url"].removeprefix("https://").split(":")
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    raw = socket.create_connection((host, int(port)), timeout=30)
    with tls["context"].wrap_socket(raw, server_hostname=host) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nAuthorization: Bearer " + TLS_KEY.encode() +
                     b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
        time.sleep(0.5)
        tls["proc"].send_signal(signal.SIGTERM)
        time.sleep(1.5)
        conn.sendall(body[5:])
        response = b""
        while chunk := conn.recv(65536):
            response += chunk
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), response
    retry = re.search(rb"(?im)^retry-after: (\d+)\r?$", head)
    assert retry and 1 <= int(retry.group(1)) <= 60
    assert json.loads(payload)["error"]["code"] == "shutting_down"
    assert tls["proc"].wait(30) is not None
