"""Timing claims: asserted on a quiet machine, skipped for load (named, with the share of the CPU
others used) on a busy one, and counted back from a notebook's outputs."""
from __future__ import annotations

import IPython.display
import pytest

from workbench.course.claims import ASSERTED, MIME_TYPE, SKIPPED, claims_in, count, timing_claim


class Meter:
    def __init__(self, share: float):
        self.share = share

    def quiet(self) -> bool:
        return self.share <= 0.25

    def current_share(self) -> float:
        return self.share


@pytest.fixture
def shown(monkeypatch):
    outputs = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda data, raw: outputs.append({"output_type": "display_data", "data": data}))
    return outputs


def test_a_quiet_machine_asserts_the_claim(shown):
    with timing_claim("fast beats slow", Meter(0.1)):
        assert 1 < 2
    with pytest.raises(AssertionError, match="slow"):
        with timing_claim("slow beats fast", Meter(0.1)):
            assert 2 < 1, "slow"
    with pytest.raises(AssertionError):
        with timing_claim("without a meter, always asserted"):
            assert False
    assert [o["data"][MIME_TYPE] for o in shown] == [
        {"name": "fast beats slow", "status": ASSERTED, "held": True}]
    assert shown[0]["data"]["text/plain"] == "claim asserted: fast beats slow"


def test_a_busy_machine_skips_the_claim_and_says_why(shown):
    with timing_claim("slow beats fast", Meter(0.42)):
        assert 2 < 1
    with timing_claim("fast beats slow", Meter(0.42)):
        assert 1 < 2
    entries = [o["data"][MIME_TYPE] for o in shown]
    assert entries[0] == {"name": "slow beats fast", "status": SKIPPED, "share": 0.42,
                          "reason": "other programs used 42% of the CPU", "held": False}
    assert entries[1]["held"] is True and entries[1]["status"] == SKIPPED
    assert "other programs used 42% of the CPU" in shown[0]["data"]["text/plain"]
    assert "did not hold" in shown[0]["data"]["text/plain"]


def test_errors_that_are_not_failed_asserts_always_propagate(shown):
    with pytest.raises(KeyError):
        with timing_claim("a bug is never excused", Meter(0.9)):
            {}["missing"]
    with pytest.raises(ValueError, match="name=''"):
        with timing_claim(""):
            pass
    assert shown == []


def test_claims_are_counted_from_a_notebooks_outputs(shown):
    with timing_claim("a", Meter(0.0)):
        pass
    with timing_claim("b", Meter(0.5)):
        assert False
    nb = {"cells": [{"cell_type": "code", "outputs": shown[:1]}, {"cell_type": "markdown"},
                    {"cell_type": "code", "outputs": [{"output_type": "stream", "text": "x"}, shown[1]]}]}
    found = claims_in(nb)
    assert [c["name"] for c in found] == ["a", "b"] and count(found) == (1, 1)
