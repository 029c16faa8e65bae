"""Key numbers a chapter measured, recorded where the report can find them.

    from workbench.course.results import record
    record("speedup_sdpa", speedup, "x", "SDPA vs naive attention at S=1024")

`record` displays the number (a one-line text a learner sees under the cell) together with a
machine-readable copy under its own MIME type. Papermill keeps every cell's outputs, so the report
(`python -m workbench.course.report`) reads the numbers back from the executed notebook: no side files, no
global state, and a number exists only if the cell that measured it ran.
"""
from __future__ import annotations

import glob
import json
import math
import numbers
from pathlib import Path
from typing import Sequence

MIME_TYPE = "application/vnd.workbench.result+json"


def _check(key: str, value) -> float:
    if not isinstance(key, str) or not key.replace("_", "").isalnum():
        raise ValueError(f"key={key!r} is invalid: use letters, digits and underscores")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"value={value!r} for {key!r} is invalid: a real number is required")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"value={value!r} for {key!r} is invalid: it must be finite")
    return value


def format_value(value: float, unit: str = "") -> str:
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if not unit:
        return text
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}"


def record(key: str, value, unit: str = "", label: str = "") -> dict:
    """Show one measured number and mark it for the report. Returns the record."""
    from IPython.display import display
    entry = {"key": key, "value": _check(key, value), "unit": unit, "label": label or key}
    text = f"recorded {entry['label']}: {format_value(entry['value'], unit)}"
    display({MIME_TYPE: entry, "text/plain": text}, raw=True)
    return entry


def records_in(nb) -> list[dict]:
    """Every record in an executed notebook (an nbformat node or its dict), in cell order; a key
    recorded twice keeps its last value."""
    found: dict[str, dict] = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data", {}) if out.get("output_type") in ("display_data",
                                                                      "execute_result") else {}
            if MIME_TYPE in data:
                entry = dict(data[MIME_TYPE])
                found.pop(entry["key"], None)
                found[entry["key"]] = entry
    return list(found.values())


def find_results(pattern: str, start: Path | str | None = None,
                 extra_roots: Sequence[Path | str] = ()) -> list[dict]:
    """Committed benchmark results matching `pattern` (e.g. "results/cpu/speed-*.json"), found
    from `start` (default: the working directory) and its parents, and from `extra_roots`; each
    dict gains a "file" key. Sorted by date."""
    roots = [Path(start or Path.cwd()).resolve()]
    roots += list(roots[0].parents)[:3] + [Path(r) for r in extra_roots]
    seen, found = set(), []
    for root in roots:
        for name in sorted(glob.glob(str(root / pattern))):
            path = Path(name).resolve()
            if path in seen:
                continue
            seen.add(path)
            data = json.loads(path.read_text(encoding="utf-8"))
            data["file"] = path.name
            found.append(data)
    return sorted(found, key=lambda d: str(d.get("date", "")))
