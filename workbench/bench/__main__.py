"""python -m workbench.bench [single-stream] [--dtypes float32 bfloat16] [--repeats 3] [--json F]"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch

from . import single_stream

WORKLOADS = {"single-stream": single_stream}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench", description=__doc__)
    ap.add_argument("workload", nargs="?", default="single-stream", choices=sorted(WORKLOADS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=single_stream.NEW_TOKENS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    module = WORKLOADS[args.workload]
    result = module.run(dtypes=args.dtypes, repeats=args.repeats, new_tokens=args.new_tokens,
                        model=args.model)
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["machine"] = {"processor": platform.processor() or platform.machine(),
                         "torch": torch.__version__, "python": platform.python_version()}
    print(module.format_table(result))
    if args.json:
        for d in result["dtypes"].values():
            d.pop("tokens", None)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
