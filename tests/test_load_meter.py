"""The load meter: what counts as this process's own CPU time and what as other programs'.

Children burn a fixed amount of their own CPU time (time.process_time), so the counts are exact
however busy the machine is; only other programs' share, which includes everyone else, is a
lower bound."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from workbench.bench.load_meter import LoadMeter, tree_cpu_seconds

BURN_S = 0.6
TICKS = 0.05     # /proc counts CPU time in clock ticks (10 ms); process_time is finer
BURN = ("import sys, time\n"
        f"while time.process_time() < {BURN_S}: pass\n"
        "sys.stdout.write('done\\n'); sys.stdout.flush()\n"
        "sys.stdin.read()\n")          # then waits (without CPU) until its stdin closes


def burn_child() -> subprocess.Popen:
    """A child that burns BURN_S CPU seconds and stays alive until its stdin is closed."""
    p = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "done\n"
    return p


def test_a_child_that_ended_in_the_window_is_ours():
    meter = LoadMeter().start()
    subprocess.run([sys.executable, "-c", BURN], input="", capture_output=True, check=True)
    _, mine, _ = meter.seconds()
    assert mine >= BURN_S - TICKS, mine


def test_a_running_child_and_grandchild_are_ours():
    meter = LoadMeter().start()
    nested = ("import subprocess, sys\n"
              f"p = subprocess.Popen([sys.executable, '-c', {BURN!r}], stdin=subprocess.PIPE,\n"
              "                     stdout=subprocess.PIPE, text=True)\n"
              "sys.stdout.write(p.stdout.readline()); sys.stdout.flush()\n"
              "sys.stdin.read(); p.stdin.close(); p.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", nested], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "done\n"     # the grandchild has burned and still runs
        assert len(psutil.Process(parent.pid).children()) == 1
        _, mine, _ = meter.seconds()
        assert mine >= BURN_S - TICKS, mine
    finally:
        parent.stdin.close()
        parent.wait()
    _, mine_after, _ = meter.seconds()         # both ended and were waited for: still ours
    assert mine_after >= mine >= BURN_S - TICKS, (mine, mine_after)


def test_a_child_that_exited_without_being_waited_for_is_ours():
    meter = LoadMeter().start()
    p = burn_child()
    p.stdin.close()
    deadline = time.time() + 10
    while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.02)
    try:
        _, mine, _ = meter.seconds()
        assert mine >= BURN_S - TICKS, mine
    finally:
        p.wait()


def test_a_process_outside_the_tree_is_others_load():
    meter = LoadMeter().start()
    # sh starts the burner in the background and exits at once: the burner is orphaned, so it is
    # no longer this process's descendant while it burns
    sh = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{BURN}" </dev/null >/dev/null & echo $!'],
                        capture_output=True, text=True, check=True)
    stranger = psutil.Process(int(sh.stdout))
    try:
        assert stranger.pid not in {c.pid for c in psutil.Process().children(recursive=True)}
        deadline = time.time() + 30
        while stranger.is_running() and stranger.status() != psutil.STATUS_ZOMBIE \
                and sum(stranger.cpu_times()[:2]) < BURN_S and time.time() < deadline:
            time.sleep(0.05)
        _, mine, others = meter.seconds()
    finally:
        if stranger.is_running():
            stranger.kill()
    assert mine < BURN_S / 2, mine
    assert others >= 0.9 * BURN_S, others          # others also holds everyone else's load


def test_tree_cpu_seconds_of_a_missing_process_is_zero():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()                                 # ended and waited for: its pid names no process
    assert tree_cpu_seconds(p.pid) == 0.0


@pytest.mark.parametrize("share, quiet", [(0.1, True), (0.4, False)])
def test_quiet_and_note_judge_the_window_check_closed(share, quiet):
    meter = LoadMeter().start()
    meter.checked = share
    assert meter.current_share() == share and meter.quiet() is quiet
    assert ("40%" in meter.note()) is (not quiet)
