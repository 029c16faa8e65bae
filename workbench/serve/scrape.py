"""Scrape a server's /metrics on a timer, as Prometheus does, into memory: what serve/promql.py
evaluates the dashboard's queries over.

    with MetricsRecorder("http://127.0.0.1:8000", interval=1.0) as rec:
        ... load ...
    rec.scrapes        # [Scrape(t, samples)], t in seconds since the recorder started
"""
from __future__ import annotations

import threading
import time
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from workbench.serve.promql import Scrape


def parse_exposition(text: str, **target_labels: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of a text exposition, each sample given the target's labels
    (Prometheus adds `job` and `instance` the same way)."""
    return [(s.name, {**s.labels, **target_labels}, float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


class MetricsRecorder:
    """A thread that GETs `url`/metrics every `interval` seconds until stopped."""

    def __init__(self, url: str, interval: float = 1.0, job: str = "workbench",
                 headers: dict[str, str] | None = None):
        if interval <= 0:
            raise ValueError(f"interval={interval!r}: the scrape interval must be > 0 seconds")
        self.url, self.interval, self.headers = url.rstrip("/"), interval, headers or {}
        self.labels = {"job": job, "instance": urlparse(url).netloc}
        self.scrapes: list[Scrape] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-recorder", daemon=True)

    def scrape_once(self, client: httpx.Client) -> None:
        t = time.monotonic() - self.t0
        try:
            r = client.get(f"{self.url}/metrics", headers=self.headers, timeout=self.interval * 5)
            r.raise_for_status()
        except httpx.HTTPError:
            self.errors += 1           # Prometheus marks the target down; the panels show a gap
            return
        self.scrapes.append(Scrape(t, parse_exposition(r.text, **self.labels)))

    def _run(self) -> None:
        with httpx.Client() as client:
            next_at = time.monotonic()
            while not self._stop.is_set():
                self.scrape_once(client)
                next_at += self.interval
                self._stop.wait(max(0.0, next_at - time.monotonic()))
            self.scrape_once(client)            # the state after the load: counters' final values

    def start(self) -> "MetricsRecorder":
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> "MetricsRecorder":
        self._stop.set()
        self._thread.join()
        return self

    def __enter__(self) -> "MetricsRecorder":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
