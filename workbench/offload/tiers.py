"""The slow tier that offloaded layers live in: flat files on disk, or (pinned) CPU memory.

Each offloaded layer is one flat byte array (weights.py: `LayerLayout`), written once. The disk
tier reads a layer back with `os.preadv` straight into the caller's buffer (no intermediate copy,
and the GIL is released while the read runs) and then drops the file's pages from the OS page
cache with POSIX_FADV_DONTNEED, so the next read really comes from the device; keep_page_cache=True
leaves them cached, which measures what a warm page cache gives instead.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch


def _drop_page_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class DiskTier:
    """One file per offloaded layer under `directory` (a temporary directory if None, removed by
    `close` or when the tier is garbage-collected)."""

    name = "disk"

    def __init__(self, directory: str | None = None, keep_page_cache: bool = False):
        if directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="workbench-offload-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        else:
            self.directory = Path(directory)
            self.directory.mkdir(parents=True, exist_ok=True)
            self._cleanup = None
        self.keep_page_cache = keep_page_cache
        self.paths: dict[int, Path] = {}
        self.sizes: dict[int, int] = {}

    def store(self, index: int, flat: torch.Tensor) -> None:
        """Write layer `index`'s bytes (a CPU uint8 tensor) to its file, flushed to the device."""
        path = self.directory / f"layer_{index:03d}.bin"
        with open(path, "wb") as f:
            f.write(memoryview(flat.numpy()))
            f.flush()
            os.fsync(f.fileno())              # dirty pages cannot be dropped from the cache
            if not self.keep_page_cache:
                _drop_page_cache(f.fileno())
        self.paths[index], self.sizes[index] = path, flat.numel()

    def read_into(self, index: int, dest: torch.Tensor) -> None:
        """Read layer `index` into the first bytes of `dest` (a contiguous CPU uint8 tensor)."""
        size = self.sizes[index]
        view = memoryview(dest.numpy())[:size]
        fd = os.open(self.paths[index], os.O_RDONLY)
        try:
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise OSError(f"offload file {self.paths[index]} ended after {done} of "
                                  f"{size} bytes")
                done += n
            if not self.keep_page_cache:
                _drop_page_cache(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()                   # the temporary directory and everything in it
        else:
            for path in self.paths.values():
                path.unlink(missing_ok=True)
        self.paths.clear()


class CpuTier:
    """Each offloaded layer as one CPU tensor; pinned when the fast memory is a GPU, so the copy
    to it is a DMA that runs beside the compute."""

    name = "cpu"

    def __init__(self, pin: bool):
        self.pin = pin
        self.tensors: dict[int, torch.Tensor] = {}

    def store(self, index: int, flat: torch.Tensor) -> None:
        self.tensors[index] = flat.pin_memory() if self.pin else flat.clone()

    def read_into(self, index: int, dest: torch.Tensor) -> None:
        src = self.tensors[index]
        dest[:src.numel()].copy_(src)

    def close(self) -> None:
        self.tensors.clear()


def make_tier(kind: str, device: torch.device, directory: str | None, keep_page_cache: bool):
    if kind == "disk":
        return DiskTier(directory, keep_page_cache)
    return CpuTier(pin=device.type == "cuda")
