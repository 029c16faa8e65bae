"""The chapters' house rules, checked without running them (nbval executes them; see the README).

Every notebooks/*.ipynb
- is committed without outputs and without execution counts;
- starts (after its title) with a code cell tagged `parameters` that defines DEVICE and SMOKE, so
  papermill and CI can set them;
- checks itself: at least one `assert` statement in a code cell;
- records its key numbers for the report: at least one `workbench.course.results.record(...)` call;
- draws at least one plotly figure (plotly graph_objects or a `workbench.course.viz` figure);
- ends its arc with "On a GPU" and "Further reading" sections.

And a notebook that `./run test` runs beside the tests (conftest.py: BESIDE_THE_TESTS) makes no
timing claim and measures no load.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
IDS = [p.name for p in NOTEBOOKS]


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def parse(code: str) -> ast.Module:
    """Parse a cell as Python, with IPython magics and shell escapes blanked out."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines()]
    return ast.parse("\n".join(lines))


def test_there_are_chapters():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb files"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_valid_nbformat(path):
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.read(str(path), as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_without_outputs(path):
    for i, cell in enumerate(code_cells(load(path))):
        assert cell.get("outputs") == [], (
            f"{path.name}: code cell {i} has outputs; clear them before committing "
            "(Kernel > Restart Kernel and Clear Outputs of All Cells)")
        assert cell.get("execution_count") is None, (
            f"{path.name}: code cell {i} has an execution count; clear outputs before committing")


SMOKE_LINE = re.compile(r'^SMOKE = os\.environ\.get\("WORKBENCH_SMOKE"\) in \("1", "true"\)', re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_first_code_cell_is_parameters(path):
    nb = load(path)
    cells = code_cells(nb)
    assert cells, f"{path.name} has no code cells"
    first = cells[0]
    assert "parameters" in first.get("metadata", {}).get("tags", []), (
        f"{path.name}: the first code cell must be tagged 'parameters' (papermill injects after it)")
    assert nb["cells"][0]["cell_type"] == "markdown" and source(nb["cells"][0]).lstrip().startswith("# "), (
        f"{path.name}: the notebook must open with a markdown title cell ('# ...')")
    assigned = {t.id for node in parse(source(first)).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)}
    missing = {"DEVICE", "SMOKE"} - assigned
    assert not missing, f"{path.name}: the parameters cell does not assign {sorted(missing)}"
    # one way to read WORKBENCH_SMOKE in every chapter (./run test and Binder set it to 1)
    assert SMOKE_LINE.search(source(first)), (
        f"{path.name}: the parameters cell must set SMOKE as: {SMOKE_LINE.pattern}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_papermill_reads_every_parameter(path, caplog):
    # papermill skips (with a warning) any line holding a second "=", so the report's injected
    # SMOKE and DEVICE would count as unknown parameters
    from papermill.translators import PythonTranslator
    first = code_cells(load(path))[0]
    with caplog.at_level("WARNING", logger="papermill"):
        names = {p.name for p in PythonTranslator.inspect({"source": source(first)})}
    assert {"DEVICE", "SMOKE"} <= names, f"{path.name}: papermill finds only {sorted(names)}"
    assert not caplog.records, f"{path.name}: {[r.getMessage() for r in caplog.records]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_has_assert_cells(path):
    asserts = sum(isinstance(node, ast.Assert)
                  for cell in code_cells(load(path)) for node in ast.walk(parse(source(cell))))
    assert asserts >= 1, f"{path.name}: no assert statement; back the chapter's claims with asserts"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_records_key_numbers(path):
    # `./run report` tabulates what each chapter passed to record(); without a call its row is empty.
    calls = [node for cell in code_cells(load(path)) for node in ast.walk(parse(source(cell)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "record"]
    imported = any(isinstance(node, ast.ImportFrom) and node.module == "workbench.course.results"
                   and any(a.name == "record" for a in node.names)
                   for cell in code_cells(load(path)) for node in ast.walk(parse(source(cell))))
    assert calls and imported, (
        f"{path.name}: no record(...) call; record the chapter's key measured numbers right after "
        "the asserts they back (from workbench.course.results import record)")


# go.Figure directly, plotly express, or a figure helper of workbench.course.viz (named *_figure).
FIGURE = re.compile(r"\bgo\.Figure\(|\b\w+_figure\(|\bplotly\.express\b|\bpx\.\w+\(")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_draws_a_plotly_figure(path):
    code = "\n".join(source(c) for c in code_cells(load(path)))
    assert "plotly" in code or "workbench import viz" in code or "workbench.course.viz" in code, (
        f"{path.name}: figures are drawn with plotly (directly or through workbench.course.viz)")
    assert FIGURE.search(code), f"{path.name}: no plotly figure is built"
    assert re.search(r"\.show\(|display\(", code), f"{path.name}: no figure is shown"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_chapter_arc_ends_with_gpu_and_reading(path):
    headings = [line.lstrip("#").strip().lower() for c in load(path)["cells"]
                if c["cell_type"] == "markdown" for line in source(c).splitlines()
                if line.startswith("#")]
    for wanted in ("on a gpu", "further reading"):
        assert any(wanted in h for h in headings), f"{path.name}: no '{wanted}' section heading"


def _root_conftest():
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("workbench_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebooks_beside_the_tests_assert_no_timing():
    root = Path(__file__).resolve().parents[1]
    conftest = _root_conftest()
    beside = [p for p in sorted(root.glob("notebooks/*.ipynb")) + sorted(root.glob("labs/*.ipynb"))
              if conftest.runs_beside_the_tests(p.relative_to(root).as_posix())]
    assert any(p.parent.name == "notebooks" for p in beside), "no chapter runs beside the tests"
    for path in beside:
        text = "".join(source(c) for c in code_cells(load(path)))
        for word in ("timing_claim(", "LoadMeter"):
            assert word not in text, (f"{path.name} runs beside the tests (conftest.py: "
                                      f"BESIDE_THE_TESTS) but measures timings ({word})")
    assert not conftest.runs_beside_the_tests("notebooks/01_anatomy_of_speed.ipynb")
