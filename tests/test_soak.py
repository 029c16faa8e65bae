"""The soak test at smoke size: 64 concurrent clients, three short rounds of good requests mixed
with abuse (disconnects, malformed and oversized bodies, wrong keys, invalid parameters, bursts
past the waiting bound) against one server process on the tiny model. Nothing may be lost, every
kind of request must end the way the server promises, and after each round the KV cache is empty,
/metrics agrees with what the clients saw, and greedy answers are unchanged."""
from __future__ import annotations

import asyncio

import pytest

from test_serve import start_server, stop_server
from workbench import SamplingParams
from workbench.loadtest.soak import CATEGORIES, KIND_WEIGHTS, soak

KEY = "sk-soak"
BODY_LIMIT = 4096
RSS_GROWTH_MB = 30          # from the 2nd round to the last; the first warms up


@pytest.fixture(scope="module")
def soak_server(tiny_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "access.jsonl"   # a file: a full stderr pipe blocks
    proc, url = start_server(tiny_folder, "--max-num-seqs", "8", "--api-key", KEY,
                             "--max-waiting-requests", "8", "--max-body-bytes", str(BODY_LIMIT),
                             "--access-log", str(log))
    yield proc, url
    stop_server(proc)


@pytest.fixture(scope="module")
def report(soak_server):
    proc, url = soak_server
    rep = asyncio.run(soak(url, clients=64, rounds=3, requests_per_client=2, seed=0, api_key=KEY,
                           pid=proc.pid, max_body_bytes=BODY_LIMIT, request_timeout=60,
                           drain_timeout=30, burst=12))
    print("\n" + rep.table())
    return rep


def test_nothing_is_lost(report):
    assert report.sent >= 3 * 64
    assert report.lost == 0, "requests lost:\n" + "\n".join(
        d for r in report.rounds for d in r.lost_details)
    assert report.total("clean_error") == 0, report.table()
    assert sum(report.total(c) for c in CATEGORIES) == report.sent


def test_every_kind_ends_as_promised(report):
    kinds = report.by_kind()
    assert set(kinds) == set(KIND_WEIGHTS)
    assert set(kinds["wrong_key"]) == {"rejected 401 unauthorized"}
    assert set(kinds["malformed"]) == {"rejected 400 invalid"}, \
        f"a malformed body got no OpenAI 400: {kinds['malformed']}"
    assert set(kinds["oversized"]) == {"rejected 413 too_large"}, \
        f"an oversized body got no 413: {kinds['oversized']}"
    assert "rejected 400 invalid" in kinds["invalid"]
    assert set(kinds["invalid"]) <= {"rejected 400 invalid", "rejected 429 queue_full",
                                     "rejected 429 queued_tokens"}
    assert kinds["disconnect"].get("disconnected", 0) > 0
    for kind in ("complete", "chat", "greedy", "burst"):
        assert kinds[kind].get("completed", 0) > 0, kinds[kind]
    busy = sum(n for kind in ("complete", "chat", "greedy", "disconnect", "burst")
               for k, n in kinds[kind].items() if k.startswith("rejected 429"))
    assert busy > 0, "no request passed --max-waiting-requests"
    assert report.rejected()["429 queue_full"] > 0


def test_after_each_round_nothing_leaks_and_metrics_agree(report):
    assert len(report.rounds) == 3
    for r in report.rounds:
        assert r.drained, f"round {r.round}: requests still running or waiting on /metrics"
        assert r.kv_cache_usage == 0, f"round {r.round}: KV blocks leaked"
        assert r.check_ok, f"round {r.round}: a greedy request no longer gets its reference"
        assert r.server_rejected == r.client_rejected, \
            f"round {r.round}: /metrics counted {r.server_rejected}, clients {r.client_rejected}"
        # A stream the client cut may still have finished on the server first.
        completed, cut = r.counts["completed"], r.counts["disconnected"]
        assert completed <= r.server_success <= completed + cut, (r.round, r.server_success)


def test_rss_stays_flat_after_the_first_round(report):
    rss = [r.rss_mb for r in report.rounds]
    assert all(x is not None for x in rss)
    assert rss[-1] - rss[1] < RSS_GROWTH_MB, f"the server's RSS by round: {rss} MB"


def test_references_are_the_offline_engines_greedy_texts(report, tiny_llm):
    assert report.references
    for entry in report.references:
        body = entry["body"]
        prompt = tiny_llm.apply_chat_template(body["messages"]) \
            if entry["endpoint"] == "chat" else body["prompt"]
        params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=True)
        assert tiny_llm.generate(prompt, params)[0].outputs[0].text == entry["text"], entry
