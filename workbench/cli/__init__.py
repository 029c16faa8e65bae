"""The command line, one module per command:

    python -m workbench generate "prompt" [--chat] [-tp N] [-pp N]   stream one generation
    python -m workbench info                                         what the engine chose
    python -m workbench serve [--port 8000] [--api-key K] [...]       the OpenAI-compatible server
    python -m workbench router --replica URL --replica URL           prefix-aware routing
    python -m workbench distill --student DIR --out DIR [...]         distil a pruned student

Every engine argument of LLM(...) is a flag of generate, info and serve (engine_args.py). Only
the chosen command's module is imported: the router starts without torch. Under torchrun every
rank runs the same command; ranks other than 0 serve steps (executor/launch.py).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, its argument builder, its entry point, help)
COMMANDS = {
    "generate": ("generate", "add_arguments", "main", "generate text for a prompt, streaming it"),
    "info": ("generate", "add_info_arguments", "info", "load the model and print what the "
                                                       "engine chose"),
    "serve": ("serve", "add_arguments", "main", "an OpenAI-compatible HTTP server"),
    "router": ("router", "add_arguments", "main", "route /v1 requests over several servers"),
    "distill": ("distill", "add_arguments", "main", "distil a pruned student from its teacher"),
}
ENGINE_COMMANDS = ("generate", "info", "serve")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        top = argparse.ArgumentParser(prog="python -m workbench",
                                      description="The inference workbench.")
        sub = top.add_subparsers(dest="command", required=True)
        for name, (*_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=help_text, add_help=False)
        top.parse_args(argv[:1])      # prints the commands (and exits) on --help or a bad one
        return 2
    name = argv[0]
    module_name, build, run, help_text = COMMANDS[name]
    module = importlib.import_module(f"workbench.cli.{module_name}")
    parser = argparse.ArgumentParser(prog=f"python -m workbench {name}", description=help_text)
    getattr(module, build)(parser)
    args = parser.parse_args(argv[1:])
    if name in ENGINE_COMMANDS:
        from workbench.executor.launch import serve_rank, torchrun_rank
        ranked = torchrun_rank()
        if ranked is not None and ranked[0] != 0:     # under torchrun, only rank 0 drives
            return serve_rank()
    return getattr(module, run)(args)
