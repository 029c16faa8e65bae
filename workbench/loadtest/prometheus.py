"""A real Prometheus server as a child process: it scrapes servers' /metrics, evaluates deploy/'s
recording rules and answers PromQL over its HTTP API. Chapter 10 and tests/test_deploy.py read
deploy/'s dashboard through it.

    with Prometheus(["127.0.0.1:8000"], scrape_interval=0.5) as prom:
        ... load ...
        prom.wait_for_scrape(time.time())
        prom.query_range("sum(rate(workbench:generation_tokens_total[1m]))", start, end, step=0.5)

It needs the `prometheus` binary on PATH (see INSTALL). Everything stays on 127.0.0.1: a free
port, a temporary folder for the config, the rules and the storage, removed by stop().
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from workbench.net import free_port

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "recording_rules.yml"
INSTALL = ("Install Prometheus: on Debian or Ubuntu `sudo apt-get install prometheus` (it provides "
           "`prometheus` and `promtool`); elsewhere unpack the release archive from "
           "https://prometheus.io/download/ and put its folder on PATH.")


def installed() -> bool:
    return shutil.which("prometheus") is not None


def duration(seconds: float) -> str:
    """Prometheus's duration syntax: 0.5 -> '500ms', 5 -> '5s', 60 -> '1m'."""
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError(f"duration={seconds!r}: Prometheus durations must be at least 1 ms")
    if ms % 60000 == 0:
        return f"{ms // 60000}m"
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def with_window(expr: str, seconds: float | None) -> str:
    """`expr` with every range selector's window ([1m], [5m], ...) replaced by `seconds`, for runs
    shorter than the windows; None leaves it unchanged."""
    if seconds is None:
        return expr
    window = f"[{duration(seconds)}]"                      # strings (label values) stay as they are
    return re.sub(r'("(?:[^"\\]|\\.)*")|\[[^\]:]+\]', lambda m: m.group(1) or window, expr)


@dataclass
class Series:
    labels: dict[str, str]            # __name__ included where the result keeps it
    times: list[float]                # unix seconds
    values: list[float]               # NaN where PromQL answers NaN (e.g. 0/0)


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """`prometheus` scraping `targets` ("host:port") every `scrape_interval` seconds, with the
    recording rules of `rules` evaluated as often; `window` (seconds) replaces the rules' range
    windows (the recorded names stay, e.g. workbench:generation_tokens:rate1m)."""

    def __init__(self, targets: list[str], *, scrape_interval: float = 1.0, rules: Path = RULES,
                 window: float | None = None, job: str = "workbench"):
        if not targets:
            raise ValueError("targets=[]: give at least one host:port to scrape")
        for t in targets:
            if not re.fullmatch(r"[\w.\-\[\]]+:\d+", t):
                raise ValueError(f"targets: {t!r} is not host:port (e.g. 127.0.0.1:8000, "
                                 "no scheme)")
        self.targets, self.interval, self.rules, self.window, self.job = (
            list(targets), scrape_interval, Path(rules), window, job)
        duration(scrape_interval)                                    # refuses <= 0 early
        if window is not None:
            duration(window)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def _write_config(self, folder: Path) -> Path:
        groups = yaml.safe_load(self.rules.read_text())["groups"]
        for g in groups:
            g["interval"] = duration(self.interval)
            for r in g["rules"]:
                r["expr"] = with_window(r["expr"], self.window)
        (folder / "rules.yml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        every = duration(self.interval)
        config = {"global": {"scrape_interval": every, "scrape_timeout": every,
                             "evaluation_interval": every},
                  "rule_files": ["rules.yml"],
                  "scrape_configs": [{"job_name": self.job, "metrics_path": "/metrics",
                                      "static_configs": [{"targets": self.targets}]}]}
        path = folder / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def start(self, timeout: float = 60) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusError(f"`prometheus` is not on PATH. {INSTALL}")
        self.folder = Path(tempfile.mkdtemp(prefix="workbench-prometheus-"))
        config = self._write_config(self.folder)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.folder / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}: "
                                      f"{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise PrometheusError(f"prometheus not ready after {timeout} s")

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            self.proc = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the HTTP API ----------------------------------------------------------------------------
    def _get(self, path: str, **params) -> dict | list:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        """An instant query at unix time `at` (default: now): one point per series."""
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        data = self._get("query", **params)
        if data["resultType"] == "scalar":
            return [Series({}, [data["result"][0]], [float(data["result"][1])])]
        return [Series(r["metric"], [r["value"][0]], [float(r["value"][1])])
                for r in data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        """The expression evaluated every `step` seconds from `start` to `end`, as a Grafana
        time-series panel asks for it."""
        data = self._get("query_range", query=expr, start=start, end=end, step=step)
        return [Series(r["metric"], [t for t, _ in r["values"]], [float(v) for _, v in r["values"]])
                for r in data["result"]]

    def label_values(self, label: str, match: str) -> list[str]:
        """The values of `label` on the series `match` selects: Grafana's label_values()."""
        return self._get(f"label/{label}/values", **{"match[]": match})

    def wait_for_scrape(self, after: float, timeout: float = 30) -> None:
        """Return once every target has a successful scrape stored that started after unix time
        `after`: what the server exported then is what queries now see."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # timestamp() gives a sample's time only when applied to a selector itself
            up = self.query(f'timestamp(up{{job="{self.job}"}}) and up{{job="{self.job}"}} == 1')
            if len(up) == len(self.targets) and all(s.values[0] >= after for s in up):
                return
            time.sleep(self.interval / 4)
        raise PrometheusError(f"no scrape of {self.targets} after {after} within {timeout} s: "
                              f"{[(s.labels, s.values) for s in up]}")

    def value(self, expr: str) -> float:
        """The value of a one-series expression now (e.g. a sum over a counter)."""
        found = self.query(expr)
        if len(found) != 1 or math.isnan(found[0].values[0]):
            raise PrometheusError(f"{expr} answered {[(s.labels, s.values) for s in found]}, "
                                  "not one number")
        return found[0].values[0]
