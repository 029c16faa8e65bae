"""python -m workbench router: prefix-aware routing over several servers (serve/router.py).
It loads no model, and never imports torch."""
from __future__ import annotations

import argparse
import sys

import uvicorn

from workbench.serve.router import Router, build_router_app


def add_arguments(router: argparse.ArgumentParser) -> None:
    router.add_argument("--replica", action="append", required=True, help="a server URL")
    router.add_argument("--policy", default="prefix", help="prefix, random or round_robin")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between GET /health checks of each replica")
    router.add_argument("--health-timeout", type=float, default=1.0,
                        help="seconds a health check may take before it counts as failed")
    router.add_argument("--unhealthy-after", type=int, default=2,
                        help="consecutive failures that mark a replica down")
    router.add_argument("--max-retries", type=int, default=2,
                        help="other replicas a request that failed before its answer started "
                             "is sent to")


def main(args) -> int:
    try:
        router = Router(args.replica, args.policy, health_interval=args.health_interval,
                        unhealthy_after=args.unhealthy_after,
                        health_timeout=args.health_timeout, max_retries=args.max_retries)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[workbench] routing ({args.policy}) over {len(args.replica)} replicas on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level="warning")
    return 0
