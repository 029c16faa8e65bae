"""Peak memory of a process and everything it starts (a notebook kernel, its worker processes and
servers), sampled in a background thread.

The sum of PSS (proportional set size: each shared page divided among the processes sharing it)
is what the tree really occupies; plain RSS would count torch's shared libraries once per worker.
It is what Binder's memory limit (a cgroup) sees, up to the page cache.
"""
from __future__ import annotations

import threading

import psutil


def tree_bytes(pid: int, include_root: bool = True) -> int:
    """PSS of the process and its descendants (RSS where PSS cannot be read)."""
    try:
        root = psutil.Process(pid)
        procs = [root] * include_root + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += getattr(p.memory_full_info(), "pss", None) or p.memory_info().rss
        except psutil.AccessDenied:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        except psutil.Error:       # the process ended between listing and reading
            pass
    return total


class PeakMemory:
    """`with PeakMemory(pid) as m: ...` then `m.peak_bytes`; or start() and stop()."""

    def __init__(self, pid: int, interval_s: float = 0.2, include_root: bool = True):
        """include_root=False: only the descendants (a report counts its kernels, not itself)."""
        self.pid, self.interval_s, self.include_root = pid, interval_s, include_root
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, tree_bytes(self.pid, self.include_root))
            self._stop.wait(self.interval_s)

    def start(self) -> "PeakMemory":
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, tree_bytes(self.pid, self.include_root))
        return self.peak_bytes

    def __enter__(self) -> "PeakMemory":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS: glibc keeps freed memory for reuse, so
    a deleted model still counts against a memory limit (Binder's) until malloc_trim."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):      # not glibc: nothing to hand back
        pass
