"""How busy the machine was with *other* programs while we timed something.

On a shared machine with few cores (2 in CI, Binder's 1-2) a busy neighbour makes every timing
slower and noisier: with torch's threads on oversubscribed cores operators slow unevenly, by far
more than the share of the CPU the neighbour takes (`note()` says how busy it was). The chapters
time things and assert claims about the timings; they assert them only when the machine was
quiet, and otherwise say how busy it was, so a learner knows to rerun.

    meter = LoadMeter().start()
    ... timed work ...
    if meter.quiet():
        assert fast < slow, meter.note()

A chapter that times in several cells calls `meter.check()` at the end of each: it prints a
warning if others were busy, keeps that share for the next claims' quiet() and note(), and starts
a new window.
"""
from __future__ import annotations

import os
import time

import psutil

QUIET_SHARE = 0.25   # timing claims are asserted only below this share of the CPU used by others
NOTE_SHARE = 0.15    # above this, results carry a note saying how busy the machine was


def _busy(c) -> float:
    return c.user + c.system + getattr(c, "nice", 0.0) + getattr(c, "steal", 0.0)


class LoadMeter:
    """The share of all CPU cores that other programs used since start()."""

    def start(self) -> "LoadMeter":
        self.t, self.cpu = time.perf_counter(), psutil.cpu_times()
        self.own = psutil.Process().cpu_times()
        self.checked = None          # the share of the window that check() closed last
        return self

    def share(self) -> float:
        wall = time.perf_counter() - self.t
        cpu, own = psutil.cpu_times(), psutil.Process().cpu_times()
        mine = (own.user - self.own.user) + (own.system - self.own.system)
        others = _busy(cpu) - _busy(self.cpu) - mine
        return max(0.0, others) / max(wall * (os.cpu_count() or 1), 1e-9)

    def check(self) -> float:
        """Close the window: warn if other programs were busy, keep their share for quiet() and
        note(), start a new window. Returns the share."""
        share = self.share()
        self.start()
        self.checked = share
        if share > NOTE_SHARE:
            print(f"warning: other programs used {share:.0%} of the CPU during these "
                  "measurements; the timings are slower and noisier than this machine can do")
        return share

    def _current(self) -> float:
        return self.share() if self.checked is None else self.checked

    def quiet(self) -> bool:
        return self._current() <= QUIET_SHARE

    def note(self) -> str:
        share = self._current()
        return (f" (other programs used {share:.0%} of the CPU during the measurement; rerun on a "
                "quieter machine)") if share > NOTE_SHARE else ""
