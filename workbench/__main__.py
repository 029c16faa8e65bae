"""Command line:
    python -m workbench generate "prompt" [--chat] [-tp N] [-pp N]   stream one generation
    python -m workbench info                                         what the engine chose
    python -m workbench serve [--port 8000] [--api-key K] [--ssl-certfile C --ssl-keyfile K]
                                                                     the OpenAI-compatible server
    python -m workbench router --replica URL --replica URL           prefix-aware routing
Under torchrun every rank runs the same command (workbench/parallel/launch.py).
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="workbench", description="The inference workbench.")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for a prompt, streaming it")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    info = sub.add_parser("info", help="load the model and print what the engine chose")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (workbench/serve/)")
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
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=32)
    serve.add_argument("--max-num-batched-tokens", type=int, default=512)
    serve.add_argument("--tpot-slo", type=float, default=None,
                       help="SLO-aware batching: a target decode step time in seconds; prefill "
                            "chunks shrink while decode steps run over it")
    serve.add_argument("--enable-prefix-caching", action="store_true")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds running requests may finish in after Ctrl-C")
    router = sub.add_parser("router", help="route /v1 requests over several servers "
                                           "(prefix-aware: workbench/serve/router.py)")
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
    for p in (gen, info, serve):
        p.add_argument("--model", default="smollm2-135m")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--device", default="auto")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
        p.add_argument("--sequence-parallel", "-sp", action="store_true",
                       help="split the tokens between blocks over the tensor-parallel ranks")
        p.add_argument("--expert-parallel-size", "-ep", type=int, default=1)
        p.add_argument("--moe-experts", type=int, default=None,
                       help="cut each MLP into this many experts (a mixture of experts)")
        p.add_argument("--moe-top-k", type=int, default=None, help="experts per token")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens")
    args = ap.parse_args(argv)

    from .parallel.launch import serve_rank, torchrun_rank
    ranked = torchrun_rank()
    if ranked is not None and ranked[0] != 0:     # under torchrun, only rank 0 drives
        return serve_rank()
    if args.command == "serve":
        return serve_main(args)
    if args.command == "router":
        return router_main(args)
    from . import LLM, SamplingParams
    moe = None
    if args.moe_experts is not None:
        moe = {"num_experts": args.moe_experts, "top_k": args.moe_top_k or args.moe_experts}
    try:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
                  tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size,
                  sequence_parallel=args.sequence_parallel,
                  expert_parallel_size=args.expert_parallel_size, moe_config=moe)
        if args.command == "info":
            llm.close()
            return 0
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        prompt = (llm.apply_chat_template([{"role": "user", "content": args.prompt}])
                  if args.chat else args.prompt)
        last = None
        for chunk in llm.stream(prompt, params):
            print(chunk.text, end="", flush=True)
            last = chunk
        m = last.output.metrics
        print(f"\n[{last.finish_reason}] {m.num_output_tokens} tokens, TTFT {m.ttft * 1e3:.0f} ms, "
              f"TPOT {(m.tpot or 0) * 1e3:.1f} ms", file=sys.stderr)
        llm.close()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def router_main(args) -> int:
    import uvicorn

    from .serve.router import Router, build_router_app
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


def serve_main(args) -> int:
    import threading

    import uvicorn

    from .llm import LLM
    from .serve import AsyncEngine, build_app
    from .serve.admission import Admission
    from .serve.metrics import ServerMetrics
    try:
        policy = serving_policy(args)
        admission = Admission(args.max_waiting_requests, args.max_queued_prompt_tokens)
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                  tpot_slo=args.tpot_slo,
                  tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size,
                  sequence_parallel=args.sequence_parallel)
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
    from .serve.admission import Limits
    from .serve.gateway import ServingPolicy, make_access_logger
    from .serve.security import (ApiKeys, ContentFilter, KeySpec, RateLimiter, load_callable,
                                 parse_key_file)
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


if __name__ == "__main__":
    sys.exit(main())
