"""python -m workbench.course.labs list | grade SUBMISSIONS [--csv F] [--json F] [--timeout S] [-v]"""
from __future__ import annotations

import argparse
import sys

from workbench.course.labs import load_all
from workbench.course.labs.grade import child_main
from workbench.course.labs.grade import main as grade_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:          # the per-notebook grading process (see grade.py)
        return child_main()
    ap = argparse.ArgumentParser(prog="python -m workbench.course.labs", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list every exercise and the lab it belongs to")
    g = sub.add_parser("grade", help="grade a folder of submitted lab notebooks")
    g.add_argument("submissions", help="folder searched recursively for .ipynb files")
    g.add_argument("--csv", help="also write the table as CSV")
    g.add_argument("--json", help="also write every result (messages and hints) as JSON")
    g.add_argument("--timeout", type=float, default=120.0,
                   help="seconds one notebook may take (default 120)")
    g.add_argument("-j", "--jobs", type=int, default=None,
                   help="notebooks graded at once (default: one per CPU core)")
    g.add_argument("-v", "--verbose", action="store_true", help="print why each failure failed")
    args = ap.parse_args(argv)
    if args.command == "list":
        for ex in sorted(load_all().values(), key=lambda e: e.chapter):   # stable: lab order
            print(f"{ex.chapter:28s} {ex.id:32s} {ex.function}: {ex.title}")
        return 0
    return grade_main(args)


if __name__ == "__main__":
    sys.exit(main())
