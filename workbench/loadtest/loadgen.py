"""A load generator for an OpenAI-compatible server, measured the way vLLM's serving benchmark
measures (benchmarks/benchmark_serving.py: request throughput, TTFT, TPOT, ITL percentiles,
goodput under SLOs).

    python -m workbench.loadtest.loadgen --url http://127.0.0.1:8000 --rate 4 --num-requests 64 \
        --input-len 32:256 --output-len 16:128 [--burstiness 1] [--slo-ttft 0.5] [--json out.json]

Arrivals: a gamma process with mean 1/rate between requests; burstiness 1 is Poisson, below 1
burstier, above 1 more regular; --rate inf sends everything at once. Prompts are random token ids
of the drawn length (the server takes token-id prompts), outputs are forced to their drawn
length (ignore_eos), so the load is what was asked for. --dataset FILE takes JSON lines with
"prompt" and "max_tokens" instead.

Per request: TTFT (request sent to first token), ITL (gaps between streamed chunks: usually one
token each; text held back, a partial stop string or UTF-8 character, merges tokens, as in vLLM),
TPOT ((e2e - TTFT) / (output tokens - 1)), end-to-end latency. Goodput: requests per second that
met every SLO given.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np


@dataclass
class RequestResult:
    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    start: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_range(spec: str) -> tuple[int, int]:
    """'128' -> (128, 128); '32:256' -> (32, 256)."""
    lo, _, hi = spec.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"length range {spec!r} is invalid: use N or LO:HI with 1 <= LO <= HI")
    return lo, hi


def make_requests(num: int, input_len: str, output_len: str, seed: int, vocab: int = 49152,
                  dataset: str | None = None) -> list[dict]:
    rng = random.Random(seed)
    if dataset:
        rows = [json.loads(line) for line in open(dataset) if line.strip()]
        return [{"prompt": r["prompt"], "max_tokens": int(r.get("max_tokens", 64))}
                for r in (rows * (num // len(rows) + 1))[:num]]
    (il, ih), (ol, oh) = parse_range(input_len), parse_range(output_len)
    # Ids from 1000 up: no special tokens, so every prompt is ordinary text.
    return [{"prompt": [rng.randrange(1000, vocab) for _ in range(rng.randint(il, ih))],
             "max_tokens": rng.randint(ol, oh)} for _ in range(num)]


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed + 1)
    theta = 1.0 / (rate * burstiness)          # gamma(k, theta) has mean k * theta = 1 / rate
    return [rng.gammavariate(burstiness, theta) for _ in range(num)]


async def send(client: httpx.AsyncClient, url: str, model: str | None, req: dict,
               headers: dict) -> RequestResult:
    prompt = req["prompt"]
    res = RequestResult(len(prompt) if isinstance(prompt, list) else -1, req["max_tokens"])
    body = {"prompt": prompt, "max_tokens": req["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    res.start = start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                    if res.prompt_tokens < 0:
                        res.prompt_tokens = event["usage"]["prompt_tokens"]
                for choice in event.get("choices", []):
                    if not choice.get("text"):
                        continue
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.ttft is not None
    except httpx.HTTPError as err:
        res.error = repr(err)
    return res


async def run(url: str, requests: list[dict], gaps: list[float], model: str | None = None,
              api_key: str | None = None, timeout: float = 600) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for req, gap in zip(requests, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(send(client, url, model, req, headers)))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in ps} | {"mean": None}
    # Linear interpolation between the two nearest ranks: numpy's default, as vLLM's serving
    # benchmark computes them (np.percentile), so p50 of [1, 2] is 1.5.
    quantiles = np.percentile(np.asarray(values, dtype=float), list(ps))
    out = {f"p{p}": float(q) for p, q in zip(ps, quantiles)}
    out["mean"] = statistics.fmean(values)
    return out


def summarize(results: list[RequestResult], duration: float, slo_ttft: float | None = None,
              slo_tpot: float | None = None, slo_e2e: float | None = None) -> dict:
    done = [r for r in results if r.ok]
    good = [r for r in done
            if (slo_ttft is None or r.ttft <= slo_ttft)
            and (slo_tpot is None or r.tpot is None or r.tpot <= slo_tpot)
            and (slo_e2e is None or r.e2e <= slo_e2e)]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(max(0, r.prompt_tokens) for r in done))
        / duration,
        "goodput": len(good) / duration,
        "slo": {"ttft": slo_ttft, "tpot": slo_tpot, "e2e": slo_e2e},
        "ttft": percentiles([r.ttft for r in done]),
        "tpot": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl": percentiles([g for r in done for g in r.itl]),
        "e2e": percentiles([r.e2e for r in done]),
    }


def format_summary(s: dict) -> str:
    lines = [f"requests {s['completed']}/{s['requests']} completed in {s['duration_s']:.1f} s: "
             f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
             f"goodput {s['goodput']:.2f} req/s"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = s[name]
        if p["p50"] is not None:
            lines.append(f"  {name.upper():<5} ms  p50 {1e3 * p['p50']:8.1f}  p90 "
                         f"{1e3 * p['p90']:8.1f}  p99 {1e3 * p['p99']:8.1f}  mean "
                         f"{1e3 * p['mean']:8.1f}")
    if s["errors"]:
        lines.append(f"  errors: {s['errors']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.loadtest.loadgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests per second")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", default="32:256")
    ap.add_argument("--output-len", default="16:128")
    ap.add_argument("--dataset", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    ap.add_argument("--slo-e2e", type=float, default=None, help="seconds")
    ap.add_argument("--json", default=None, help="write the summary and every request here")
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.burstiness <= 0 or args.num_requests < 1:
        ap.error("--rate, --burstiness and --num-requests must be positive")
    reqs = make_requests(args.num_requests, args.input_len, args.output_len, args.seed,
                         dataset=args.dataset)
    gaps = arrival_gaps(len(reqs), args.rate, args.burstiness, args.seed)
    results, duration = asyncio.run(run(args.url, reqs, gaps, args.model, args.api_key))
    summary = summarize(results, duration, args.slo_ttft, args.slo_tpot, args.slo_e2e)
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"rate": str(args.rate)}, "summary": summary,
                       "requests": [asdict(r) | {"tpot": r.tpot} for r in results]}, f, indent=1)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
