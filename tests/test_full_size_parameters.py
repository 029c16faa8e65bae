"""Every chapter's size logic at full size, in seconds: CI executes the notebooks at SMOKE size, so
the parameters cell and the "sizes derived from the parameters" cell (with its asserts, e.g. that
chapter 00's longest prompt needs several prefill chunks) also run here with SMOKE = False, as
`./run report` runs them. All chapters run in one subprocess (torch and the notebook stack are
imported once), each in its own namespace, and each chapter's outcome is its own test."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RUNNER = """
import json, sys, traceback
outcomes = {}
for name, source in json.load(sys.stdin).items():
    try:
        exec(compile(source, name, "exec"), {"__name__": "__main__"})
        outcomes[name] = None
    except BaseException:
        outcomes[name] = traceback.format_exc()[-3000:]
print("OUTCOMES " + json.dumps(outcomes))
"""


def size_cells(notebook: Path) -> str:
    """The parameters cell, papermill's override of SMOKE, then the sizes cell."""
    code = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    params = next(i for i, c in enumerate(code) if "parameters" in c.get("metadata", {}).get("tags", []))
    sizes = "".join(code[params + 1]["source"])
    assert sizes.startswith("# Sizes derived from the parameters"), notebook.name
    return "".join(code[params]["source"]) + "\nSMOKE = False\n" + sizes


@pytest.fixture(scope="module")
def outcomes() -> dict:
    """Chapter stem -> None, or the traceback of its size cells at full size."""
    sources = {nb.stem: size_cells(nb) for nb in CHAPTERS}
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(sources), cwd=ROOT / "notebooks",
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WORKBENCH_SMOKE": "0"})
    line = next((l for l in done.stdout.splitlines() if l.startswith("OUTCOMES ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line.removeprefix("OUTCOMES "))


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_full_size_parameters_hold(notebook, outcomes):
    assert notebook.stem in outcomes, sorted(outcomes)
    assert outcomes[notebook.stem] is None, outcomes[notebook.stem]
