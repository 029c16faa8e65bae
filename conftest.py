"""Memory and skipped timing claims of the chapters and labs under nbval.

Timing claims (workbench/course/claims.py) are asserted only when the machine was quiet; each
outcome is a cell output, read here from every notebook cell's outputs, and the count of claims
asserted and skipped for load (with their names and reasons) is printed per notebook at the end.

Memory, against Binder's 1-2 GB:

Each notebook's kernel together with every process it starts (parallel workers, servers) is
sampled every 0.2 s (summed PSS) and its peak printed at the end of the run. With
WORKBENCH_MEMORY_BUDGET_MIB set and SMOKE sizes, a notebook that peaks over it fails (an error on
its last cell). `./run test` does not set it: chapter 07 peaks at 1.96-2.02 GiB, at Binder's
2 GiB, and chapter 09 needs about 3 GiB, which its first cell says
(`WORKBENCH_MEMORY_BUDGET_MIB=2048 ./run test notebooks` checks them)."""
from __future__ import annotations

import os

import pytest

from workbench.course.claims import SKIPPED, claims_in_outputs, count
from workbench.memory import PeakMemory

BUDGET_MIB = float(os.environ.get("WORKBENCH_MEMORY_BUDGET_MIB", "2048"))
ENFORCED = ("WORKBENCH_MEMORY_BUDGET_MIB" in os.environ
            and os.environ.get("WORKBENCH_SMOKE") in ("1", "true"))   # full sizes are for real machines
_samplers: dict[str, PeakMemory] = {}
_peaks: dict[str, float] = {}
_claims: dict[str, list[dict]] = {}


def _kernel_pid(item) -> int | None:
    kernel = getattr(item.parent, "kernel", None)
    provisioner = getattr(getattr(kernel, "km", None), "provisioner", None)
    return getattr(provisioner, "pid", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield                                   # the notebook's kernel starts in its parent's setup
    name = item.parent.nodeid          # notebooks/00_tour.ipynb: the labs share chapter file names
    if name not in _samplers and name.endswith(".ipynb"):
        pid = _kernel_pid(item)
        if pid:
            _samplers[name] = PeakMemory(pid).start()


def pytest_runtest_teardown(item, nextitem):
    name = item.parent.nodeid          # notebooks/00_tour.ipynb: the labs share chapter file names
    claims = claims_in_outputs(getattr(item, "test_outputs", None))    # nbval's cells only
    if claims:
        _claims.setdefault(name, []).extend(claims)
    if name not in _samplers or (nextitem is not None and nextitem.parent is item.parent):
        return
    peak_mib = _samplers.pop(name).stop() / 2**20
    _peaks[name] = peak_mib
    if ENFORCED and peak_mib > BUDGET_MIB:
        raise AssertionError(
            f"{name} peaked at {peak_mib:,.0f} MiB (kernel and its child processes, PSS) at SMOKE "
            f"sizes, over the {BUDGET_MIB:,.0f} MiB budget: it would not run on Binder")


def pytest_terminal_summary(terminalreporter):
    if _claims:
        terminalreporter.write_sep("-", "timing claims per notebook (skipped: the machine was busy)")
        for name, claims in _claims.items():
            asserted, skipped = count(claims)
            terminalreporter.write_line(f"{name:48s} {asserted:3d} asserted {skipped:3d} skipped for load")
            for c in claims:
                if c["status"] == SKIPPED:
                    terminalreporter.write_line(f"    skipped: {c['name']} ({c['reason']}; "
                                                f"{'held anyway' if c['held'] else 'did not hold'})")
        asserted, skipped = count([c for claims in _claims.values() for c in claims])
        terminalreporter.write_line(f"{'total':48s} {asserted:3d} asserted {skipped:3d} skipped for load")
    if _peaks:
        terminalreporter.write_sep("-", "peak memory per notebook (kernel + children, PSS)")
        for name, mib in _peaks.items():
            terminalreporter.write_line(f"{name:48s} {mib:8,.0f} MiB"
                                        + ("  over 2 GB" if mib > 2048 else ""))
