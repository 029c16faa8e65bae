"""python -m workbench generate "prompt" | info: stream one generation, or load the model and say
what the engine chose (LLM.describe)."""
from __future__ import annotations

import argparse
import sys

from workbench.cli.engine_args import add_engine_args, engine_kwargs
from workbench.llm import LLM
from workbench.sampling_params import SamplingParams


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)


def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None, help="the sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens")
    add_engine_args(gen, skip=("seed",))     # --seed is the request's sampling seed here


def info(args) -> int:
    try:
        LLM(**engine_kwargs(args)).close()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(args) -> int:
    try:
        llm = LLM(**engine_kwargs(args))
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
