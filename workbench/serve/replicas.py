"""The router's view of its replicas: which are up, what each was sent and how it went, and the
health checks that decide it.

A replica is marked down after `unhealthy_after` consecutive failures (a failed GET /health, or a
forwarded request that broke), at once when a forwarded request cannot connect, and up again
after one successful health check. Selection only ever considers replicas that are up.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

# The `outcome` label of workbench_router:requests_total, one per attempt sent to a replica.
OUTCOMES = ("ok", "retried", "failed", "cut")


@dataclass
class Replica:
    url: str
    up: bool = True
    consecutive_failures: int = 0
    sent: int = 0
    retries: int = 0
    last_error: str | None = None
    last_check: float | None = field(default=None, repr=False)

    def view(self) -> dict:
        return {"url": self.url, "up": self.up,
                "consecutive_failures": self.consecutive_failures, "requests": self.sent,
                "retries": self.retries, "last_error": self.last_error,
                "seconds_since_check": (None if self.last_check is None
                                        else round(time.monotonic() - self.last_check, 3))}


def rendezvous_order(key: str, urls: list[str]) -> list[int]:
    """Replica indices by descending sha256(url, key): the first healthy one serves `key`."""
    def score(i):
        return hashlib.sha256(f"{urls[i]}\0{key}".encode()).digest()
    return sorted(range(len(urls)), key=score, reverse=True)


class Replicas:
    def __init__(self, urls: list[str], health_interval: float = 2.0, unhealthy_after: int = 2,
                 health_timeout: float = 1.0):
        if health_interval <= 0:
            raise ValueError(f"health_interval={health_interval} is invalid: allowed are "
                             "seconds > 0")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after={unhealthy_after} is invalid: allowed are "
                             "integers >= 1")
        if health_timeout <= 0:
            raise ValueError(f"health_timeout={health_timeout} is invalid: allowed are "
                             "seconds > 0")
        self.items = [Replica(u) for u in urls]
        self.health_interval, self.unhealthy_after = health_interval, unhealthy_after
        self.health_timeout = health_timeout
        self.registry = r = CollectorRegistry()
        self._up = Gauge("workbench_router:replica_up", "1 while the router sends to the replica.",
                         ["replica"], registry=r)
        self._requests = Counter("workbench_router:requests",
                                 "Attempts sent to a replica, by how they ended: ok, retried "
                                 "(failed before streaming, sent elsewhere), failed (failed, "
                                 "nowhere left to send), cut (broke after the answer started).",
                                 ["replica", "outcome"], registry=r)
        for rep in self.items:
            self._up.labels(rep.url).set(1)
            for outcome in OUTCOMES:
                self._requests.labels(rep.url, outcome)

    def healthy(self) -> list[int]:
        return [i for i, rep in enumerate(self.items) if rep.up]

    def record(self, i: int, outcome: str) -> None:
        if outcome == "retried":
            self.items[i].retries += 1
        self._requests.labels(self.items[i].url, outcome).inc()

    def failed(self, i: int, err: str, connect: bool = False) -> None:
        rep = self.items[i]
        rep.consecutive_failures += 1
        rep.last_error = err
        if connect or rep.consecutive_failures >= self.unhealthy_after:
            self._set(rep, False)

    def succeeded_check(self, i: int) -> None:
        rep = self.items[i]
        rep.consecutive_failures = 0
        self._set(rep, True)

    def _set(self, rep: Replica, up: bool) -> None:
        rep.up = up
        self._up.labels(rep.url).set(1 if up else 0)

    async def check(self, client: httpx.AsyncClient, i: int) -> None:
        rep = self.items[i]
        try:
            r = await client.get(f"{rep.url}/health", timeout=self.health_timeout)
            ok, err = r.status_code == 200, f"GET /health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, err = False, f"GET /health failed: {e!r}"
        rep.last_check = time.monotonic()
        if ok:
            self.succeeded_check(i)
        else:
            self.failed(i, err)

    async def check_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.gather(*(self.check(client, i) for i in range(len(self.items))))
            await asyncio.sleep(self.health_interval)
