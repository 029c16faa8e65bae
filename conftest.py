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
(`WORKBENCH_MEMORY_BUDGET_MIB=2048 ./run test notebooks` checks them).

Under pytest-xdist (`./run test` runs the tests, and the notebooks without timing claims, in two
processes), each worker and every process it starts, notebook kernels included, get cores / workers
torch threads, and the workers' claims and peaks are gathered into the controller's summary. A
notebook that asserts timings (every chapter but those in BESIDE_THE_TESTS) is marked `quiet`:
`./run test` runs those afterwards, one at a time, on an otherwise quiet machine."""
from __future__ import annotations

import json
import os

# pytest-xdist's workers share the cores: with torch's default of one thread per core in every
# worker, the threads outnumber the cores and each parallel region waits for a descheduled one.
# So each worker, and every process it starts, gets cores / workers threads (`pytest -n 2
# tests/test_compress_distill.py tests/test_quant_methods.py tests/test_pruning.py` with and
# without OMP_NUM_THREADS=1 measures it). Set before torch is imported, which reads it.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1)
                                            // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402

from workbench.course.claims import SKIPPED, claims_in_outputs, count  # noqa: E402
from workbench.memory import PeakMemory  # noqa: E402

BUDGET_MIB = float(os.environ.get("WORKBENCH_MEMORY_BUDGET_MIB", "2048"))
ENFORCED = ("WORKBENCH_MEMORY_BUDGET_MIB" in os.environ
            and os.environ.get("WORKBENCH_SMOKE") in ("1", "true"))   # full sizes are for real machines
_samplers: dict[str, PeakMemory] = {}
_peaks: dict[str, float] = {}
_claims: dict[str, list[dict]] = {}


# The notebooks whose asserts hold however busy the CPU is (no timing among them): the labs, the
# paged KV cache's block arithmetic and the parallel workers' equality. `./run test` runs them beside
# the tests; every other chapter asserts timings and runs alone (tests/test_notebooks.py keeps
# timing claims out of this list).
BESIDE_THE_TESTS = ("labs/", "notebooks/03_paged_kv_cache.ipynb", "notebooks/07_parallelism.ipynb")


def runs_beside_the_tests(nodeid: str) -> bool:
    return not nodeid.endswith(".ipynb") or nodeid.startswith(BESIDE_THE_TESTS)


def pytest_collection_modifyitems(items):
    for item in items:
        if not runs_beside_the_tests(item.nodeid.split("::")[0]):
            item.add_marker(pytest.mark.quiet)


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


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)    # an xdist worker: report up
    if workeroutput is not None:
        workeroutput["workbench_notebooks"] = json.dumps({"claims": _claims, "peaks": _peaks})


class _GatherFromWorkers:
    """The controller's side under xdist: each worker's claims and peaks, when it shuts down."""

    @pytest.hookimpl
    def pytest_testnodedown(self, node, error):
        report = json.loads(getattr(node, "workeroutput", {}).get("workbench_notebooks", "{}"))
        for name, claims in report.get("claims", {}).items():
            _claims.setdefault(name, []).extend(claims)
        _peaks.update(report.get("peaks", {}))


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_GatherFromWorkers(), "workbench-notebooks-gather")


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
