"""Prometheus metrics, fed from the engine's step records and finished requests (on the engine
thread; prometheus_client's metrics are thread-safe). Names follow vLLM's (`vllm:` becomes
`workbench:`) so that dashboards built for one read the other."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets in seconds, dense where interactive serving lives (vLLM uses similar ranges).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2)
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)

# The `reason` label of workbench:request_rejected_total (a dashboard reads these names).
REJECT_REASONS = ("queue_full", "queued_tokens", "rate_limit_requests", "rate_limit_tokens",
                  "shutting_down", "unauthorized", "content_policy", "invalid", "too_large",
                  "timeout")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name

        def hist(name, doc, buckets):
            return Histogram(f"workbench:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(f"workbench:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"workbench:{name}", doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.", TOKEN_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between consecutive tokens of a request.", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                          TTFT_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "First scheduled to first token (the prefill, chunks included).",
                            TTFT_BUCKETS)
        self.running = gauge("num_requests_running", "Requests holding KV blocks.")
        self.waiting = gauge("num_requests_waiting", "Requests queued (new or preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV blocks held by requests (0-1).")
        self.prefill_budget = gauge("prefill_budget_tokens",
                                    "Prefill tokens a step may take (adapted with --tpot-slo).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate",
                                     "Share of looked-up prompt tokens found in the prefix cache.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._prefix_seen = (0, 0)
        self.tier_hits = {t: counter(f"kv_{t}_tier_hits",
                                     f"Prompt tokens loaded from the {t} KV tier.")
                          for t in ("cpu", "disk")}
        self._tier_seen = {"cpu": 0, "disk": 0}
        self.preemptions = counter("num_preemptions", "Sequences preempted.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafts accepted.")
        self._success = Counter("workbench:request_success", "Finished requests.",
                                labels + ["finished_reason"], registry=r)
        self._rejected = Counter("workbench:request_rejected",
                                 "Requests refused before or while running, by reason.",
                                 labels + ["reason"], registry=r)
        for reason in REJECT_REASONS:        # every series exists from the start, at 0
            self._rejected.labels(model_name, reason)

    def observe_step(self, engine, record) -> None:
        self.running.set(record.num_running)
        self.waiting.set(record.num_waiting)
        self.kv_usage.set(record.blocks_used / max(1, record.blocks_total))
        if record.prefill_budget is not None:
            self.prefill_budget.set(record.prefill_budget)
        self.prefix_hit_rate.set(engine.blocks.hit_rate)
        queries, hits = engine.blocks.prefix_queries, engine.blocks.prefix_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        for tier, hits in engine.blocks.tier_hits.items():
            self.tier_hits[tier].inc(hits - self._tier_seen[tier])
            self._tier_seen[tier] = hits
        self.preemptions.inc(record.num_preempted)
        self.prompt_tokens.inc(record.num_prefill_tokens)
        self.generation_tokens.inc(len(record.sampled) + record.num_accepted_tokens)
        self.draft_tokens.inc(record.num_draft_tokens)
        self.accepted_tokens.inc(record.num_accepted_tokens)

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, output, num_prompt_tokens: int) -> None:
        m = output.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        reason = output.outputs[0].finish_reason or "abort"
        self._success.labels(self.model, reason).inc()

    def observe_rejected(self, reason: str) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"reason={reason!r} is invalid: one of {', '.join(REJECT_REASONS)}")
        self._rejected.labels(self.model, reason).inc()

    def idle(self, engine) -> None:
        """When nothing runs: the gauges must not keep the last busy step's values."""
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(engine.blocks.pool.num_used / max(1, engine.blocks.pool.num_blocks))

    def render(self) -> bytes:
        return generate_latest(self.registry)
