"""What `pip install .` installs: every package of the workbench (the repository's kernels/ folder
as workbench.kernels, never as the top-level `kernels`), the C++ sources the CPU kernels compile
from and the architectures memory_plan knows, and dependencies that leave optional libraries to
extras."""
from __future__ import annotations

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, text=True)
    (path,) = out.glob("llm_workbench-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_every_package_and_no_top_level_kernels(wheel):
    names = set(wheel.namelist())
    assert not any(n.startswith("kernels/") for n in names)
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "workbench").rglob("__init__.py")}
    for p in (ROOT / "kernels").rglob("__init__.py"):
        inner = p.parent.relative_to(ROOT / "kernels").as_posix()
        packages.add("workbench/kernels" + ("" if inner == "." else "/" + inner))
    for package in packages:
        assert f"{package}/__init__.py" in names, package
    for source in (ROOT / "kernels" / "cpu").glob("*.[ch]*"):
        if source.suffix in (".cpp", ".h") and not source.name.startswith("bench"):
            assert f"workbench/kernels/cpu/{source.name}" in names, source.name
    configs = list((ROOT / "workbench" / "plan" / "configs").glob("*.json"))
    assert configs and all(f"workbench/plan/configs/{c.name}" in names for c in configs)


def test_optional_libraries_are_extras(wheel):
    (meta_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(wheel.read(meta_name))
    requires = meta.get_all("Requires-Dist")
    core = {r.split(";")[0].split(">")[0].split("=")[0].strip().lower()
            for r in requires if "extra ==" not in r}
    assert {"torch", "transformers", "fastapi", "uvicorn", "httpx"} <= core
    assert not core & {"xgrammar", "optuna", "plotly", "ipywidgets", "jupyterlab", "triton"}
    assert {"structured", "search", "notebooks", "triton", "test"} <= set(meta.get_all("Provides-Extra"))
