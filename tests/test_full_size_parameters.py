"""Every chapter's size logic at full size, in seconds: CI executes the notebooks at SMOKE size, so
the parameters cell and the "sizes derived from the parameters" cell (with its asserts, e.g. that
chapter 00's longest prompt needs several prefill chunks) also run here with SMOKE = False, as
`./run report` runs them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def size_cells(notebook: Path) -> str:
    """The parameters cell, papermill's override of SMOKE, then the sizes cell."""
    code = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    params = next(i for i, c in enumerate(code) if "parameters" in c.get("metadata", {}).get("tags", []))
    sizes = "".join(code[params + 1]["source"])
    assert sizes.startswith("# Sizes derived from the parameters"), notebook.name
    return "".join(code[params]["source"]) + "\nSMOKE = False\n" + sizes


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
def test_full_size_parameters_hold(notebook):
    done = subprocess.run([sys.executable, "-c", size_cells(notebook)], cwd=notebook.parent,
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "WORKBENCH_SMOKE": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
