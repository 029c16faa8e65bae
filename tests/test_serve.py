"""The OpenAI-compatible server, started as a real process on 127.0.0.1 and driven by the official
`openai` client (and raw HTTP where the client would refuse to send bad input)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from workbench import LLM, SamplingParams

MODEL = "tiny"
KEY = "sk-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, *extra) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", str(folder), "--dtype",
           "float32", "--device", "cpu", "--port", str(port), "--served-model-name", MODEL,
           "--max-model-len", "256", "--max-num-seqs", "16", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return wait_healthy(proc, f"http://127.0.0.1:{port}", "server")


def wait_healthy(proc: subprocess.Popen, url: str, what: str,
                 seconds: float = 120) -> tuple[subprocess.Popen, str]:
    """Poll url/health until it answers 200; the process's output if it exits or never does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the {what} did not come up in {seconds:g} s: {proc.stdout.read()}")


def wait_idle(url: str, seconds: float = 10) -> str:
    """/metrics once no request runs and no KV block is held (or after `seconds`): the engine
    thread sees finished and disconnected requests shortly after the client does."""
    deadline = time.monotonic() + seconds
    while True:
        text = httpx.get(f"{url}/metrics").text
        if (metric(text, "workbench:num_requests_running") == 0
                and metric(text, "workbench:kv_cache_usage_perc") == 0) \
                or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


@pytest.fixture(scope="module")
def server(tiny_folder):
    proc, url = start_server(tiny_folder)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_folder):
    """The same model offline: what every served greedy request must equal."""
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=256, max_num_seqs=16)


def offline_text(llm, prompt, **kw) -> str:
    params = SamplingParams(temperature=0, **kw)
    return llm.generate(prompt, params)[0].outputs[0].text


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_completion_matches_offline_greedy(client, offline):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.choices[0].text == offline_text(offline, prompt, max_tokens=12, ignore_eos=True)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streamed_completion_is_the_same_text(client, offline):
    prompt = [1, 200, 300, 400]              # token ids are a prompt too
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_text(offline, prompt, max_tokens=10, ignore_eos=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_chat_plain_and_streamed(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = offline.apply_chat_template(messages)
    want = offline_text(offline, ids, max_tokens=16, ignore_eos=True)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # max_completion_tokens is the newer name for max_tokens
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3


def test_logprobs_in_both_formats(client, offline):
    prompt = "Once upon a time"
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=2,
                                                  ignore_eos=True))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    want = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert len(lp.top_logprobs) == 5 and all(len(top) == 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
        assert bytes(e.bytes).decode() == e.token


def test_a_stop_string_spanning_tokens_is_never_partly_streamed(client, offline):
    prompt = "The capital of France is"
    full = offline_text(offline, prompt, max_tokens=24, ignore_eos=True)
    words = re.findall(r"\S{4,}", full[6:])
    assert words, full
    stop = words[0][1:4]                    # three characters inside a later word
    want = full[:full.index(stop)]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0, stop=[stop], stream=True,
                                            extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    streamed = ""
    for t in texts:                           # no prefix of the stop string ever went out
        streamed += t
        assert stop[0] not in streamed[len(want):]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  stop=stop, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x " * 300, "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "model": "gpt-9"}, "model"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "logit_bias": {"7": 500}}, "logit_bias"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "", "max_tokens": 2}, "prompt"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(server, body, param):
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"]
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_malformed_json_and_bad_chat_bodies(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "hi", ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"messages": [{"role": "wizard", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_api_key(tiny_folder):
    proc, url = start_server(tiny_folder, "--api-key", KEY)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(f"{url}/health").status_code == 200    # probes need no key
    finally:
        stop_server(proc)


def metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$', text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_64_concurrent_streams_some_aborted(server, offline):
    """One continuous batch for all; every request that is not aborted gets the offline text;
    aborted ones free their blocks; the metrics add up."""
    prompts = [f"Request {i}: tell me about the number {i}" for i in range(64)]
    want = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    aborted = set(range(0, 64, 8))
    before = httpx.get(f"{server}/metrics").text

    async def one(client, i):
        # A request to abort asks for many tokens, so that it cannot finish before the server
        # sees the disconnect.
        stream = await client.completions.create(model=MODEL, prompt=prompts[i],
                                                 max_tokens=200 if i in aborted else 12,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if i in aborted and text:
                await stream.close()            # the client goes away mid-stream
                return None
        return text

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    texts = asyncio.run(run_all())
    for i, t in enumerate(texts):
        if i not in aborted:
            assert t == want[i], i
    text = wait_idle(server)
    assert metric(text, "workbench:num_requests_running") == 0
    assert metric(text, "workbench:kv_cache_usage_perc") == 0      # no block is held
    finished = (metric(text, "workbench:e2e_request_latency_seconds_count")
                - metric(before, "workbench:e2e_request_latency_seconds_count"))
    assert finished == 64 - len(aborted)
    assert metric(text, "workbench:generation_tokens_total") >= 12 * (64 - len(aborted))
    assert metric(text, "workbench:time_to_first_token_seconds_count") >= finished


def test_shutdown_ends_running_streams_and_says_so(tiny_folder):
    """SIGTERM with --shutdown-timeout 0: the running stream is not cut off, it ends with
    finish_reason "abort" and [DONE], and the server exits."""
    proc, url = start_server(tiny_folder, "--shutdown-timeout", "0")
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                                "stream": True, "temperature": 0}) as r:
            lines = r.iter_lines()
            first = next(l for l in lines if l.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            proc.terminate()                     # Ctrl-C / SIGTERM while a stream runs
            rest = [l for l in lines if l.startswith("data: ")]
        events = [json.loads(l[6:]) for l in rest if l != "data: [DONE]"]
        reasons = [c["finish_reason"] for e in events for c in e["choices"]]
        assert reasons and reasons[-1] == "abort"
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(30) is not None
    finally:
        stop_server(proc)


def test_loadgen_against_the_server(server):
    """Poisson arrivals, random lengths; every request completes with its forced length and the
    report's numbers are consistent with each other."""
    from workbench.loadtest.loadgen import arrival_gaps, make_requests, run, summarize
    reqs = make_requests(16, "4:24", "2:10", seed=1)
    gaps = arrival_gaps(16, rate=40, burstiness=1.0, seed=1)
    assert sum(gaps) == pytest.approx(16 / 40, rel=0.8)
    results, duration = asyncio.run(run(server, reqs, gaps, model=MODEL))
    s = summarize(results, duration, slo_ttft=60.0)
    assert s["completed"] == 16 and s["failed"] == 0
    assert [r.output_tokens for r in results] == [q["max_tokens"] for q in reqs]
    assert [r.prompt_tokens for r in results] == [len(q["prompt"]) for q in reqs]
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    for name in ("ttft", "e2e"):
        p = s[name]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert all(r.ttft <= r.e2e for r in results)
    tight = summarize(results, duration, slo_ttft=0.0)
    assert tight["goodput"] == 0


def test_prefix_aware_routing_beats_random_routing(tiny_folder):
    """Two replicas with prefix caching behind the router; four long system prompts. Routed by
    prefix, each system prompt's blocks are computed on one replica and then reused; routed at
    random, both replicas compute most of them. Hit rates come from the replicas' /metrics."""
    procs = []
    try:
        replicas = []
        for _ in range(2):
            proc, url = start_server(tiny_folder, "--enable-prefix-caching")
            procs.append(proc)
            replicas.append(url)
        systems = [f"System {s}: " + " ".join(f"rule {s}.{k} is important" for k in range(12))
                   for s in range(4)]
        convs = [[{"role": "system", "content": systems[i % 4]},
                  {"role": "user", "content": f"Question {i}?"}] for i in range(24)]

        def hits_and_queries():
            totals = [0.0, 0.0]
            for url in replicas:
                text = httpx.get(f"{url}/metrics").text
                totals[0] += metric(text, "workbench:prefix_cache_hits_total")
                totals[1] += metric(text, "workbench:prefix_cache_queries_total")
            return totals

        rates = {}
        for policy in ("random", "prefix"):
            port = free_port()
            cmd = [sys.executable, "-m", "workbench", "router", "--policy", policy, "--port",
                   str(port)] + [a for u in replicas for a in ("--replica", u)]
            router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
            procs.append(router)
            url = f"http://127.0.0.1:{port}"
            for _ in range(200):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            # Fresh system prompts per policy, so neither run reuses the other's cache.
            tag = policy.upper()
            before = hits_and_queries()
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            for conv in convs:
                conv = [{"role": "system", "content": tag + conv[0]["content"]}, conv[1]]
                r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=2)
                assert r.choices[0].finish_reason in ("length", "stop")
            after = hits_and_queries()
            rates[policy] = (after[0] - before[0]) / (after[1] - before[1])
            counts = httpx.get(f"{url}/health").json()["requests_per_replica"]
            assert sum(counts) == len(convs)
        # Prefix routing computes each system prompt once (4 misses); random routing about
        # once per replica it lands on (~8): fewer misses, a higher hit rate.
        assert rates["prefix"] > rates["random"] + 0.02, rates
    finally:
        for p in procs:
            stop_server(p)


def test_router_policies_choose_as_documented():
    from workbench.serve.router import Router, routing_key
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]}
    other_question = {"messages": [{"role": "system", "content": "S"},
                                   {"role": "user", "content": "b"}]}
    assert routing_key(chat) == routing_key(other_question)        # the last message is ignored
    assert routing_key({"prompt": "x" * 300}) == "x" * 256
    assert routing_key({"prompt": list(range(100))}) == json.dumps(list(range(64)))
    r = Router(["http://a", "http://b", "http://c"], "prefix")
    assert len({r.choose(chat), r.choose(other_question), r.choose(chat)}) == 1
    rr = Router(["http://a", "http://b"], "round_robin")
    assert [rr.choose({}) for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="policy='nearest' is invalid"):
        Router(["http://a"], "nearest")


def test_percentiles_interpolate_like_vllms_benchmark():
    """Linear interpolation between ranks (np.percentile's default, used by vLLM's serving
    benchmark), not the nearest rank: an even count has a p50 between its two middle values."""
    from workbench.loadtest.loadgen import percentiles
    assert percentiles([2.0, 1.0]) == {"p50": 1.5, "p90": 1.9, "p99": 1.99, "mean": 1.5}
    assert percentiles([1.0, 2.0, 3.0, 4.0])["p50"] == 2.5
    assert percentiles([5.0])["p99"] == 5.0
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
