"""python -m workbench.bench soak [--clients 128] [--rounds 5] [--json results/cpu/soak-....json]

Starts a server on SmolLM2-135M (a key, small waiting bounds, a small body limit) as a process of
its own, runs the soak test of workbench/loadtest/soak.py against it (good requests mixed with
disconnects, malformed and oversized bodies, wrong keys, invalid parameters, bursts past the
waiting bound), and reports per round what was completed, rejected by reason, disconnected,
answered with a clean error, or lost; the KV cache after each round; the server's RSS.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

import httpx

from workbench.bench.machine import machine_info, measured_commit
from workbench.loadtest.soak import soak
from workbench.net import free_port


def server_flags(args, key: str, access_log: str) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype, "--device", "cpu",
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--api-key", key, "--max-waiting-requests", str(args.max_waiting_requests),
            "--max-body-bytes", str(args.max_body_bytes), "--access-log", access_log]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-waiting-requests", type=int, default=32)
    ap.add_argument("--max-body-bytes", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    commit = measured_commit()
    key = "sk-soak-" + secrets.token_hex(8)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "access.jsonl")      # a file: a full stderr pipe would block it
        flags = server_flags(args, key, log)
        out = open(os.path.join(tmp, "server.out"), "w+")
        proc = subprocess.Popen([sys.executable, "-m", "workbench", "serve", "--port", str(port),
                                 *flags], stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, url, out)
            report = asyncio.run(soak(
                url, clients=args.clients, rounds=args.rounds,
                requests_per_client=args.requests_per_client, seed=args.seed, api_key=key,
                pid=proc.pid, max_body_bytes=args.max_body_bytes,
                log=lambda line: print(line, file=sys.stderr, flush=True)))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            out.close()
    print(report.table())
    result = {"workload": "soak", "model": args.model, "dtype": args.dtype,
              "server_flags": [f if f != key else "<key>" for f in flags if f != log],
              **report.to_dict(),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(commit)}
    result.pop("url")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not report.ok:
        sys.exit(1)


def _wait_healthy(proc, url: str, out, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out.seek(0)
            raise RuntimeError(f"the server exited: {out.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server did not come up in {timeout:g} s")
