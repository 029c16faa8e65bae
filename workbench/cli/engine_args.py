"""The engine's arguments as command-line flags, generated from EngineConfig's fields: one flag
per field (`max_num_seqs` -> `--max-num-seqs`), its type from the default, its help from the
field. A JSON value sets a dict field (`--speculative-config '{"method": "ngram", ...}'`)."""
from __future__ import annotations

import argparse
import json
from dataclasses import fields

from workbench.config import EngineConfig

SHORT = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp",
         "expert_parallel_size": "-ep", "sequence_parallel": "-sp"}
DICTS = ("moe_config", "quantization_config", "pruning_config", "speculative_config")
AUTO_BOOLS = {"auto": None, "true": True, "false": False}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_dict(name: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"{flag(name)} takes a JSON object: {err}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag(name)} takes a JSON object, not {text!r}")
        return value
    return parse


def _auto_bool(text: str):
    if text.lower() not in AUTO_BOOLS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, true, false")
    return AUTO_BOOLS[text.lower()]


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict | None = None,
                    skip: tuple[str, ...] = ()) -> None:
    """Every EngineConfig field as a flag (except `skip`); `defaults` overrides the config's
    defaults for this command (the server decodes more sequences at once, for one)."""
    group = parser.add_argument_group("engine arguments (EngineConfig; LLM(...) takes the same)")
    defaults = defaults or {}
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        names = [flag(f.name)] + ([SHORT[f.name]] if f.name in SHORT else [])
        help_text = f.metadata["help"] + (f" (default: {default})" if default is not None else "")
        kwargs = dict(default=default, help=help_text, dest=f.name)
        if f.name in DICTS:
            kwargs.update(type=_json_dict(f.name), metavar="JSON")
        elif f.default is None and f.name in ("cpu_gemv", "fused_decode"):
            kwargs.update(type=_auto_bool, metavar="{auto,true,false}")
        elif isinstance(f.default, bool):
            kwargs.update(action=argparse.BooleanOptionalAction)
        elif isinstance(f.default, int) or "int" in str(f.type):
            kwargs.update(type=float if "float" in str(f.type) else int)
        elif "float" in str(f.type):
            kwargs.update(type=float)
        group.add_argument(*names, **kwargs)
    parser.set_defaults(engine_fields=tuple(f.name for f in fields(EngineConfig)
                                            if f.name not in skip))
    group.add_argument("--moe-experts", type=int, default=None,
                       help="cut each MLP into this many experts (sets moe_config)")
    group.add_argument("--moe-top-k", type=int, default=None,
                       help="experts per token, with --moe-experts (default: all of them)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...)'s keyword arguments from parsed flags."""
    out = {name: getattr(args, name) for name in args.engine_fields}
    if args.moe_experts is not None:
        out["moe_config"] = {"num_experts": args.moe_experts,
                             "top_k": args.moe_top_k or args.moe_experts}
    return out
