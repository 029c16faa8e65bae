"""Grade a folder of submitted lab notebooks: who passed what.

    python -m workbench.course.labs grade submissions/                 # table on stdout
    python -m workbench.course.labs grade submissions/ --csv grades.csv --json grades.json

Each notebook runs in its own Python process (so one learner's crash, infinite loop or stray
global cannot touch another's), with a time limit. The process executes the notebook's code cells
in order (a cell that raises is recorded and skipped, as in a notebook run cell by cell), then, for
every cell whose first line is `# EXERCISE: <id>`, runs that exercise's checker on the function
the cell defines. Cells are run, not trusted: run grading as a user who may run learners' code.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from workbench.course.labs import check, get, load_all
from workbench.course.labs.core import FAILED, NOT_ATTEMPTED

EXERCISE_LINE = re.compile(r"^\s*#\s*EXERCISE:\s*(\S+)")
_RESULT_MARK = "@@workbench-labs-result@@"


def notebook_cells(path: Path) -> list[str]:
    """Code cells' sources, with IPython magics and shell escapes blanked out."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        cells.append("\n".join("" if line.lstrip().startswith(("%", "!")) else line
                               for line in src.splitlines()))
    return cells


def exercises_in(cells: list[str]) -> list[str]:
    ids = []
    for src in cells:
        m = EXERCISE_LINE.match(src.lstrip("\n").split("\n", 1)[0]) if src.strip() else None
        if m and m.group(1) not in ids:
            ids.append(m.group(1))
    return ids


def run_cells_and_check(cells: list[str]) -> list[dict]:
    """In this process: run the cells, then every exercise's checker. Used by the child process."""
    import contextlib
    import io

    namespace: dict = {"__name__": "__main__"}
    cell_errors = []
    for i, src in enumerate(cells):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(src, f"<cell {i}>", "exec"), namespace)
        except Exception as exc:  # a broken cell: note it, carry on like a notebook would
            cell_errors.append(f"cell {i}: {type(exc).__name__}: {exc}")
    results = []
    for ex_id in exercises_in(cells):
        try:
            ex = get(ex_id)
        except ValueError as exc:
            results.append({"exercise": ex_id, "status": FAILED, "message": str(exc), "hint": ""})
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            fb = check(ex_id, namespace.get(ex.function))
        d = fb.to_dict()
        if fb.status != "passed" and cell_errors:
            d["message"] += "\n(cells that raised: " + "; ".join(cell_errors)[:500] + ")"
        results.append(d)
    return results


def grade_notebook(path: Path, timeout: float) -> list[dict]:
    """Grade one notebook in a child process; a timeout or a crash fails its exercises."""
    cells = notebook_cells(path)
    ids = exercises_in(cells)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        proc = subprocess.run([sys.executable, "-m", "workbench.course.labs", "_child"],
                              input=json.dumps(cells), capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [{"exercise": i, "status": FAILED, "hint": "",
                 "message": f"the notebook did not finish within {timeout:g} s"} for i in ids]
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return [{"exercise": i, "status": FAILED, "hint": "",
             "message": f"grading process exited {proc.returncode}: {' | '.join(tail)}"}
            for i in ids]


def child_main() -> int:
    results = run_cells_and_check(json.loads(sys.stdin.read()))
    sys.stdout.write("\n" + _RESULT_MARK + json.dumps(results) + "\n")
    return 0


def grade_folder(folder: Path, timeout: float = 120.0, jobs: int | None = None
                 ) -> dict[str, dict[str, dict]]:
    """{submission (path relative to folder, no suffix): {exercise id: result}}. `jobs` notebooks
    are graded at once (default: one per CPU core), each in its own process."""
    from concurrent.futures import ThreadPoolExecutor
    if not folder.is_dir():
        raise ValueError(f"submissions={str(folder)!r} is not a folder")
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs={jobs} is invalid: at least 1 notebook at a time")
    notebooks = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        graded = list(pool.map(lambda p: grade_notebook(p, timeout), notebooks))
    return {str(p.relative_to(folder).with_suffix("")): {r["exercise"]: r for r in results}
            for p, results in zip(notebooks, graded)}


def table(grades: dict[str, dict[str, dict]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per submission, one column per exercise, then the count."""
    order = {ex_id: (ex.chapter, i) for i, (ex_id, ex) in enumerate(load_all().items())}
    # Chapter by chapter, each lab's exercises in the order its notebook asks them.
    exercises = sorted({ex for results in grades.values() for ex in results},
                       key=lambda ex: order.get(ex, ("~", 0, ex)))
    header = ["submission", *exercises, "passed"]
    rows = []
    for name, results in grades.items():
        cells = [results[ex]["status"] if ex in results else "-" for ex in exercises]
        rows.append([name, *cells, f"{sum(c == 'passed' for c in cells)}/{len(results)}"])
    return header, rows


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def main(args) -> int:
    grades = grade_folder(Path(args.submissions), args.timeout, args.jobs)
    if not grades:
        print(f"no notebooks under {args.submissions}", file=sys.stderr)
        return 1
    header, rows = table(grades)
    print(format_table(header, rows))
    if args.verbose:
        for name, results in grades.items():
            for r in results.values():
                if r["status"] == FAILED:
                    print(f"\n{name} / {r['exercise']}: {r['message']}")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([header, *rows])
    if args.json:
        Path(args.json).write_text(json.dumps(grades, indent=1), encoding="utf-8")
    return 0


__all__ = ["grade_folder", "grade_notebook", "table", "format_table", "exercises_in",
           "NOT_ATTEMPTED"]
