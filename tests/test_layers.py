"""The layers of docs/architecture.md hold: import-linter's contracts in pyproject.toml (no module
imports a higher layer, no import cycle inside any package, the kernels imported only as
workbench.kernels), and imports of the workbench's own modules sit at the top of each module,
where the linter and a reader see them, except the few listed here with their reason."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> why its imports of workbench modules are inside functions
LAZY = {
    "workbench/__init__.py": "PEP 562: `import workbench` stays cheap (no torch for the router)",
    "workbench/cli/__init__.py": "only the chosen command's module is imported",
    "workbench/layers/ops.py": "the Triton kernels need triton, an optional dependency",
    "workbench/attention/backends.py": "the Triton backend needs triton, an optional dependency",
    "workbench/layers/linear.py": "the Triton INT8/INT4 kernels need triton, on CUDA only",
}


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout), result.stdout[-2000:]


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                    ("workbench", "kernels"))):
                out.append((node.lineno, node.module or "."))
            elif isinstance(node, ast.Import) and any(
                    a.name.startswith(("workbench", "kernels")) for a in node.names):
                out.append((node.lineno, node.names[0].name))
    return out


def test_internal_imports_are_at_module_level():
    found = {}
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in LAZY:
            continue
        hits = _function_level_imports(path)
        if hits:
            found[rel] = hits
    assert not found, ("imports of workbench modules inside functions hide the layers from the "
                       f"linter; move them to the top of the module: {found}")


def test_nothing_imports_the_top_level_kernels_name():
    """The repository's kernels/ is installed as workbench.kernels: the top-level name is Hugging
    Face's `kernels`, and loading the folder under two names would register its operators twice."""
    pattern = re.compile(r"^\s*(from\s+kernels[.\s]|import\s+kernels\b)", re.M)
    offenders = []
    for folder in ("workbench", "kernels", "tests", "notebooks", "labs", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".ipynb", ".sh") and pattern.search(path.read_text()):
                offenders.append(path.relative_to(ROOT).as_posix())
    assert not offenders, offenders
