"""Command line: `python -m workbench generate "prompt"`, `python -m workbench info`.

Later capabilities add their subcommands here (serve, bench, ...).
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
    for p in (gen, info):
        p.add_argument("--model", default="smollm2-135m")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--device", default="auto")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
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
    from . import LLM, SamplingParams
    moe = None
    if args.moe_experts is not None:
        moe = {"num_experts": args.moe_experts, "top_k": args.moe_top_k or args.moe_experts}
    try:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
                  tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size,
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


if __name__ == "__main__":
    sys.exit(main())
