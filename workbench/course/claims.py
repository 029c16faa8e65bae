"""Timing claims, asserted when the machine was quiet and counted either way.

    from workbench.course.claims import timing_claim
    with timing_claim("INT8 decodes faster than bf16", meter):
        assert speedup["int8"] > 1.1, speedup

The block runs in every case. When the load meter (workbench.bench.load_meter) says the machine
was quiet while the chapter timed, its asserts are the chapter's asserts: a failure fails the cell.
When other programs used more of the CPU than QUIET_SHARE, a failed assert does not fail the
cell: the claim is skipped for load, and the outcome says so with the claim's name, the share of
the CPU others used and whether the claim held anyway. Without a meter the claim is always
asserted. Errors other than a failed assert always propagate.

Each outcome is displayed (a line a learner sees under the cell) with a machine-readable copy
under its own MIME type, as results.record does for numbers: pytest's nbval run (the root
conftest.py) and the report (`python -m workbench.course.report`) count them per notebook from
the cells' outputs.
"""
from __future__ import annotations

from contextlib import contextmanager

MIME_TYPE = "application/vnd.workbench.claim+json"
ASSERTED, SKIPPED = "asserted", "skipped for load"


def _show(entry: dict) -> None:
    from IPython.display import display
    if entry["status"] == ASSERTED:
        text = f"claim asserted: {entry['name']}"
    else:
        text = (f"claim not asserted, {entry['reason']} (rerun on a quieter machine): "
                f"{entry['name']}; in this run it {'held' if entry['held'] else 'did not hold'}")
    display({MIME_TYPE: entry, "text/plain": text}, raw=True)


@contextmanager
def timing_claim(name: str, meter=None):
    """Assert the block's claim if `meter` (a LoadMeter, or None) says the machine was quiet;
    otherwise record it as skipped for load, with the share of the CPU others used."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name={name!r} is invalid: a claim needs a non-empty name")
    quiet = meter is None or meter.quiet()
    entry = {"name": name, "status": ASSERTED if quiet else SKIPPED}
    if not quiet:
        share = meter.current_share()
        entry.update(share=round(share, 3), reason=f"other programs used {share:.0%} of the CPU")
    try:
        yield
    except AssertionError:
        if quiet:
            raise
        entry["held"] = False
    else:
        entry["held"] = True
    _show(entry)


def claims_in_outputs(outputs) -> list[dict]:
    """The claim outcomes among one cell's outputs (nbformat nodes or dicts), in order."""
    found = []
    for out in outputs or []:
        if out.get("output_type") in ("display_data", "execute_result"):
            entry = out.get("data", {}).get(MIME_TYPE)
            if entry is not None:
                found.append(dict(entry))
    return found


def claims_in(nb) -> list[dict]:
    """Every claim outcome in an executed notebook (an nbformat node or its dict), in cell order."""
    return [c for cell in nb["cells"] if cell.get("cell_type") == "code"
            for c in claims_in_outputs(cell.get("outputs"))]


def count(claims: list[dict]) -> tuple[int, int]:
    """(asserted, skipped for load)."""
    asserted = sum(c.get("status") == ASSERTED for c in claims)
    return asserted, len(claims) - asserted
