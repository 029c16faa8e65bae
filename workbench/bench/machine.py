"""What a benchmark's JSON says about where it ran: the machine, the versions and the commit."""
from __future__ import annotations

import os
import platform
import subprocess

import torch

from workbench.config import cpu_has_native_bf16
from workbench.kernels.cpu import best_isa, cpu_flags


def measured_commit() -> str | None:
    """The commit of the repository holding this package ("-dirty" when tracked files are
    modified; untracked ones do not count), None without git or outside a repository."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        status = subprocess.run(["git", "-C", here, "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=30, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    if status.returncode != 0:
        return head.stdout.strip() + "-dirty?"   # the working tree's state is unknown
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC ..."), or the architecture where none is listed."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(commit: str | None) -> dict:
    """Processor, cores, versions, the kernels/cpu build that ran, whether bf16 is native, any ISA
    forced lower than the CPU's (WORKBENCH_ISA and torch's own variables), and `commit`."""
    return {"processor": platform.processor() or platform.machine(), "cpu": cpu_model(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "kernels_isa": best_isa(),
            "native_bf16": cpu_has_native_bf16(),
            "forced_isa": {k: os.environ[k] for k in ("WORKBENCH_ISA", "ATEN_CPU_CAPABILITY",
                                                      "ONEDNN_MAX_CPU_ISA") if k in os.environ},
            "isa_flags": sorted(f for f in cpu_flags()
                                if f.startswith(("avx", "amx", "fma", "f16c"))),
            "commit": commit}
