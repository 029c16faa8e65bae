"""How busy the machine was with *other* programs while we timed something.

On a shared machine with few cores (2 in CI, Binder's 1-2) a busy neighbour makes every timing
slower and noisier: with torch's threads on oversubscribed cores operators slow unevenly, by far
more than the share of the CPU the neighbour takes (`note()` says how busy it was). The chapters time things and assert claims about the timings; they assert them only when
the machine was quiet (workbench.course.claims.timing_claim), and otherwise say how busy it was,
so a learner knows to rerun.

    meter = LoadMeter().start()
    ... timed work ...
    with timing_claim("fast beats slow", meter):
        assert fast < slow

"Ours" is this process and every process it started: torch.compile's worker processes, a C++
build, parallel workers, servers. Their CPU counts as ours whether they are still running at the
end of the window or ended during it (the parent that waited for a process inherits its CPU time
as `children_user` / `children_system`), so only the rest of the machine counts as others' load.

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


def tree_cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds of a process and all its descendants over their lives: the running ones' own
    time plus what each has collected from the children it waited for. A process that ends moves
    its time into its parent's `children_*` when the parent waits for it, so the sum only grows;
    a descendant orphaned before it ends (its parent exited without waiting) leaves the tree.
    Each parent is read before its children: a child that ends between the two reads is missed,
    never counted twice."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:       # it ended and was reaped between listing and reading
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class LoadMeter:
    """The share of all CPU cores that other programs used since start()."""

    def start(self) -> "LoadMeter":
        self.t, self.cpu = time.perf_counter(), psutil.cpu_times()
        self.own = tree_cpu_seconds()
        self.checked = None          # the share of the window that check() closed last
        return self

    def seconds(self) -> tuple[float, float, float]:
        """(wall, ours, others): seconds since start(); CPU seconds of this process tree and of
        every other program."""
        wall = time.perf_counter() - self.t
        mine = tree_cpu_seconds() - self.own
        others = _busy(psutil.cpu_times()) - _busy(self.cpu) - mine
        return wall, mine, max(0.0, others)

    def share(self) -> float:
        wall, _, others = self.seconds()
        return others / max(wall * (os.cpu_count() or 1), 1e-9)

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

    def current_share(self) -> float:
        """The share that quiet() and note() judge: the window check() closed last, else the
        window open now."""
        return self.share() if self.checked is None else self.checked

    def quiet(self) -> bool:
        return self.current_share() <= QUIET_SHARE

    def note(self) -> str:
        share = self.current_share()
        return (f" (other programs used {share:.0%} of the CPU during the measurement; rerun on a "
                "quieter machine)") if share > NOTE_SHARE else ""
