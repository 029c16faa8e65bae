"""deploy/prometheus/ and the dashboard against the real Prometheus: `promtool` checks the configs
and the recording rules and runs their unit tests (deploy/prometheus/recording_rules_test.yml),
and a `prometheus` process scraping a live server answers every panel of the Grafana dashboard
through its HTTP API (workbench/loadtest/prometheus.py, loadtest/dashboard.py), with the values the
traffic implies. Skips only where the binaries are missing (`./run test` installs Debian's
`prometheus` package as root)."""
from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time

import openai
import pytest
import yaml
from test_deploy import (DEPLOY, PROMETHEUS, PROMETHEUS_K8S, RULES, dashboard, dashboard_queries,
                         drive)
from test_serve import KEY, MODEL, start_server, stop_server

from workbench.loadtest.dashboard import dashboard_panels, timeseries_panels
from workbench.loadtest.prometheus import (INSTALL, Prometheus, PrometheusError, duration,
                                        with_window)

RULES_TEST = DEPLOY / "prometheus" / "recording_rules_test.yml"
STEP = 0.25                # seconds between scrapes, and between the points of the panels' queries
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason=f"promtool is not installed. {INSTALL}")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason=f"prometheus is not installed. {INSTALL}")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------ promtool
@needs_promtool
def test_promtool_accepts_the_compose_config_and_its_rules():
    for r in (promtool("check", "config", str(PROMETHEUS)), promtool("check", "rules", str(RULES))):
        assert r.returncode == 0, r.stdout + r.stderr
        assert "SUCCESS" in r.stdout


@needs_promtool
def test_promtool_accepts_the_kubernetes_config(tmp_path):
    """Debian builds Prometheus without Kubernetes discovery; there, promtool checks the rest of
    the file (relabelling, rule files, intervals) with file discovery in its place."""
    cfg = yaml.safe_load(PROMETHEUS_K8S.read_text())
    assert [job["kubernetes_sd_configs"] for job in cfg["scrape_configs"]] == [[{"role": "pod"}]]
    r = promtool("check", "config", str(PROMETHEUS_K8S))
    if "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        (tmp_path / "pods.json").write_text("[]")
        for job in cfg["scrape_configs"]:
            del job["kubernetes_sd_configs"]
            job["file_sd_configs"] = [{"files": [str(tmp_path / "pods.json")]}]
        for f in cfg["rule_files"]:
            shutil.copy(PROMETHEUS_K8S.parent / f, tmp_path / f)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        r = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_the_recording_rules_record_what_their_unit_tests_expect(tmp_path):
    r = promtool("test", "rules", str(RULES_TEST))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # The same tests with one expected value wrong fail, naming the rule and both values.
    text = RULES_TEST.read_text()
    assert text.count("value: 7\n") == 1
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / RULES_TEST.name).write_text(text.replace("value: 7\n", "value: 13\n"))
    r = promtool("test", "rules", str(tmp_path / RULES_TEST.name))
    report = r.stdout + r.stderr
    assert r.returncode != 0 and "FAILED" in report, report
    assert "workbench:num_requests_waiting:avg1m" in report and "7E+00" in report, report


# ------------------------------------------------------------------ the client's own checks
def test_durations_windows_and_targets_are_checked():
    assert [duration(s) for s in (0.25, 5, 90, 60, 120)] == ["250ms", "5s", "90s", "1m", "2m"]
    with pytest.raises(ValueError, match="at least 1 ms"):
        duration(0)
    expr = 'rate(x{a=~"[0-9]+"}[1m]) / rate(y[5m])'
    assert with_window(expr, 5) == 'rate(x{a=~"[0-9]+"}[5s]) / rate(y[5s])'
    assert with_window(expr, None) == expr
    with pytest.raises(ValueError, match="'http://127.0.0.1:8000' is not host:port"):
        Prometheus(["http://127.0.0.1:8000"])
    with pytest.raises(ValueError, match="at least 1 ms"):
        Prometheus(["127.0.0.1:8000"], window=0)


def test_without_the_binary_start_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PrometheusError, match="apt-get install prometheus"):
        Prometheus(["127.0.0.1:8000"]).start()


# ------------------------------------------------------------- a real Prometheus, a live server
@pytest.fixture(scope="module")
def server(tiny_folder):
    proc, url = start_server(tiny_folder, "--api-key", KEY, "--enable-prefix-caching")
    yield url
    stop_server(proc)


def stream_until(url: str, done: threading.Event, workers: int = 4) -> int:
    """Streams of 48 forced tokens from `workers` clients at once until `done` is set (each
    finishes its request); the tokens generated."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    counts = [0] * workers

    def work(i: int) -> None:
        while not done.is_set():
            r = client.completions.create(model=MODEL, prompt=f"Worker {i} writes", max_tokens=48,
                                          temperature=0, extra_body={"ignore_eos": True})
            counts[i] += r.usage.completion_tokens
    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


@needs_prometheus
def test_a_real_prometheus_draws_every_dashboard_panel(server):
    instance = server.removeprefix("http://")
    generated = f'sum(workbench:generation_tokens_total{{model_name="{MODEL}"}}) or vector(0)'
    with Prometheus([instance], scrape_interval=STEP) as prom:
        start = time.time()
        prom.wait_for_scrape(start)
        before = prom.value(generated)
        tokens = drive(server)                      # plain, streamed, chat; one wrong API key
        client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
        shared = "A long shared instruction that every request repeats word for word. " * 6
        for _ in range(2):                          # the second finds the first's blocks cached
            tokens += client.completions.create(
                model=MODEL, prompt=shared, max_tokens=2, temperature=0,
                extra_body={"ignore_eos": True}).usage.completion_tokens

        def seen(expr: str) -> bool:            # on the time grid the panels are asked on below
            return any(v > 0 for s in prom.query_range(expr, start, time.time(), STEP)
                       for v in s.values)
        # Requests run until the scrapes have caught them running and holding KV blocks.
        done, box = threading.Event(), {}
        busy = threading.Thread(target=lambda: box.setdefault("n", stream_until(server, done)))
        busy.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (seen("sum(workbench:num_requests_running)")
                                                   and seen("max(workbench:kv_cache_usage_perc)")):
            time.sleep(0.1)
        done.set()
        busy.join()
        tokens += box["n"]
        end = time.time()
        prom.wait_for_scrape(end)
        # Prometheus's counter equals what the clients were sent.
        assert prom.value(generated) - before == tokens

        # Grafana's model_name variable: label_values over the running gauge.
        assert prom.label_values("model_name", "workbench:num_requests_running") == [MODEL]
        panels = dashboard_panels(prom, start, time.time(), step=STEP)
        other = dashboard_panels(prom, start, time.time(), step=STEP,
                                 variables={"model_name": "another-model"})

    # Every panel of the dashboard, every one of its queries, was asked.
    assert [p.title for p in panels] == [p["title"] for p in timeseries_panels()]
    asked = [e for p in panels for e in p.exprs]
    targets = [q for q in dashboard_queries(dashboard()) if q[0].startswith("panel")]
    assert len(asked) == len(targets)
    assert all("$" not in e and 'model_name=~".*"' in e for e in asked), asked
    # The variable filters every query: another model's dashboard is empty.
    assert all(not p.series for p in other), [(p.title, list(p.series)) for p in other]

    by_title = {p.title: p for p in panels}
    quantiles = {f"p50 {MODEL}", f"p99 {MODEL}"}
    expected = {
        "Time to first token": quantiles, "Time per output token": quantiles,
        "Inter-token latency": quantiles, "End-to-end latency": quantiles,
        "Tokens per second": {f"prompt {MODEL}", f"generation {MODEL}"},
        "Generation tokens per second per replica (autoscaling input)": {instance},
        "Finished requests by finish reason": {f"length {MODEL}"},
        "Requests running and waiting": {f"running {MODEL}", f"waiting {MODEL}"},
        "Preemptions": {MODEL},
        "KV cache usage": {f"{instance} {MODEL}"},
        "Prefix cache hit rate": {MODEL},
        "Speculative decoding acceptance rate": set(),    # 0/0 without drafts: no data
    }
    rejected = by_title["Rejected requests by reason"].series       # one series per reason
    assert f"unauthorized {MODEL}" in rejected and len(rejected) >= 5, list(rejected)
    assert {t: set(p.series) for t, p in by_title.items() if t in expected} == expected
    assert set(by_title) - set(expected) == {"Rejected requests by reason"}

    def peak(title: str, name: str) -> float:
        times, values = by_title[title].series[name]
        assert times == sorted(times) and all(math.isfinite(v) for v in values), (title, name)
        return max(values)

    for title in ("Time to first token", "Time per output token", "Inter-token latency",
                  "End-to-end latency"):
        p50, p99 = by_title[title].series[f"p50 {MODEL}"], by_title[title].series[f"p99 {MODEL}"]
        assert p50[0] == p99[0] and all(0 < a <= b for a, b in zip(p50[1], p99[1])), title
    for title, name in [("Tokens per second", f"prompt {MODEL}"),
                        ("Tokens per second", f"generation {MODEL}"),
                        ("Generation tokens per second per replica (autoscaling input)", instance),
                        ("Finished requests by finish reason", f"length {MODEL}"),
                        ("Rejected requests by reason", f"unauthorized {MODEL}"),
                        ("Requests running and waiting", f"running {MODEL}"),
                        ("KV cache usage", f"{instance} {MODEL}"),
                        ("Prefix cache hit rate", MODEL)]:
        assert peak(title, name) > 0, (title, name)
    assert peak("KV cache usage", f"{instance} {MODEL}") <= 1
    assert peak("Prefix cache hit rate", MODEL) <= 1
    assert all(peak("Rejected requests by reason", n) == 0
               for n in rejected if n != f"unauthorized {MODEL}")
    assert peak("Preemptions", MODEL) == 0
    assert peak("Requests running and waiting", f"waiting {MODEL}") >= 0
