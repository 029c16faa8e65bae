"""python -m workbench serve: the OpenAI-compatible server (workbench/serve/) on one engine."""
from __future__ import annotations

import argparse
import sys
import threading

import uvicorn

from workbench.cli.engine_args import add_engine_args, engine_kwargs
from workbench.llm import LLM
from workbench.serve.app import build_app
from workbench.serve.async_engine import AsyncEngine
from workbench.serve.admission import Admission, Limits
from workbench.serve.gateway import ServingPolicy, make_access_logger
from workbench.serve.metrics import ServerMetrics
from workbench.serve.security import (ApiKeys, ContentFilter, KeySpec, RateLimiter, load_callable,
                                      parse_key_file)

# A server batches many clients: more sequences per step than LLM()'s default.
SERVER_DEFAULTS = {"max_num_seqs": 32}


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients pass as `model` (default: --model)")
    serve.add_argument("--api-key", action="append", default=[],
                       help="require 'Authorization: Bearer KEY' on /v1 (repeatable; the keys "
                            "are named key-1, key-2, ...)")
    serve.add_argument("--api-key-file", default=None,
                       help="keys as lines NAME:KEY [rpm=N] [tpm=N] (per-key rate limits)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="/metrics and /health need a key too (default: open)")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="429 past this many requests waiting to be scheduled")
    serve.add_argument("--max-queued-prompt-tokens", type=int, default=65536,
                       help="429 past this many prompt tokens waiting to be scheduled")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="abort a request this many seconds after it arrived (504, or an "
                            "error event in a stream)")
    serve.add_argument("--rate-limit-rpm", type=float, default=None,
                       help="requests per minute per key (429 past it)")
    serve.add_argument("--rate-limit-tpm", type=float, default=None,
                       help="tokens (prompt + max_tokens) per minute per key (429 past it)")
    serve.add_argument("--block-pattern", action="append", default=[],
                       help="refuse prompts matching this regex (400 content_policy; repeatable)")
    serve.add_argument("--block-pattern-file", action="append", default=[],
                       help="input policies as lines NAME REGEX")
    serve.add_argument("--block-output-pattern", action="append", default=[],
                       help="end a generation whose text matches this regex "
                            "(finish_reason content_filter; repeatable)")
    serve.add_argument("--block-output-pattern-file", action="append", default=[],
                       help="output policies as lines NAME REGEX")
    serve.add_argument("--input-screen", default=None,
                       help="MODULE:FUNCTION, f(text) -> policy name or None, on prompts")
    serve.add_argument("--output-screen", default=None,
                       help="MODULE:FUNCTION, f(text) -> policy name or None, on generated text")
    serve.add_argument("--ssl-keyfile", default=None)
    serve.add_argument("--ssl-certfile", default=None)
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20,
                       help="413 for a larger request body")
    serve.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="400 for a longer prompt (max_model_len bounds it anyway)")
    serve.add_argument("--max-tokens-limit", type=int, default=None,
                       help="400 for a larger max_tokens; also caps the default")
    serve.add_argument("--max-n", type=int, default=8, help="400 for a larger n")
    serve.add_argument("--max-logprobs", type=int, default=20,
                       help="400 for larger logprobs / top_logprobs")
    serve.add_argument("--access-log", default=None,
                       help="JSON lines per request to this file (default: stderr)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds running requests may finish in after Ctrl-C")
    add_engine_args(serve, SERVER_DEFAULTS)


def main(args) -> int:
    try:
        policy = serving_policy(args)
        admission = Admission(args.max_waiting_requests, args.max_queued_prompt_tokens)
        llm = LLM(**engine_kwargs(args))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    engine = AsyncEngine(llm, ServerMetrics(name), admission=admission,
                         max_prompt_tokens=args.max_prompt_tokens)
    app = build_app(engine, name, shutdown_timeout=args.shutdown_timeout, policy=policy)
    scheme = "https" if args.ssl_certfile else "http"
    print(f"[workbench] serving {name!r} on {scheme}://{args.host}:{args.port}/v1", flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """Ctrl-C / SIGTERM: uvicorn stops accepting and waits for open streams; the engine
            lets them finish for --shutdown-timeout seconds, then ends them with
            finish_reason "abort" (and [DONE]), so no stream is cut off silently."""
            if not self.should_exit:
                threading.Thread(target=engine.shutdown, args=(args.shutdown_timeout,),
                                 daemon=True).start()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)).run()
    return 0


def serving_policy(args):
    """The gateway's ServingPolicy from the serve flags (ValueError names a bad one)."""
    for flag in ("max_body_bytes", "max_n", "max_logprobs", "max_tokens_limit",
                 "max_prompt_tokens", "request_timeout"):
        value, least = getattr(args, flag), 0 if flag == "max_logprobs" else 1
        if value is not None and value < least:
            raise ValueError(f"--{flag.replace('_', '-')}={value} is invalid: it must be at "
                             f"least {least}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: pass both or neither")
    keys = [KeySpec(f"key-{i}", k) for i, k in enumerate(args.api_key, 1)]
    if args.api_key_file:
        keys += parse_key_file(args.api_key_file)
    screens_in = [load_callable(args.input_screen)] if args.input_screen else []
    screens_out = [load_callable(args.output_screen)] if args.output_screen else []
    return ServingPolicy(
        api_keys=ApiKeys(keys) if keys else None, protect_metrics=args.protect_metrics,
        max_body_bytes=args.max_body_bytes,
        limits=Limits(args.max_tokens_limit, args.max_n, args.max_logprobs),
        rate_limiter=RateLimiter(args.rate_limit_rpm, args.rate_limit_tpm, keys),
        input_filter=ContentFilter.build(args.block_pattern, args.block_pattern_file,
                                         screens_in),
        output_filter=ContentFilter.build(args.block_output_pattern,
                                          args.block_output_pattern_file, screens_out,
                                          prefix="block-output-pattern"),
        request_timeout=args.request_timeout, access_log=make_access_logger(args.access_log))
