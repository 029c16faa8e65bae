"""The disk tier's files: one file per KV block, named by its chained hash in hex, and a manifest.

A block file holds the block's keys and values for every layer, raw, in the cache's own layout
(layers, 2, block_size, kv_heads, row). The manifest says what the files were written for; a
directory written for another model, dtype, cache format or block size is never read, since a
hash names token ids only, not the numbers that a particular model computed for them.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUFFIX = ".kv"
BLOCK_FILE = re.compile(r"^[0-9a-f]{64}\.kv$")
log = logging.getLogger("workbench.kv")


def block_path(directory: Path, block_hash: bytes) -> Path:
    return directory / (block_hash.hex() + SUFFIX)


def manifest(model: str, quantization, pruning, dtype, kv_cache_dtype, block_size: int,
             args) -> dict:
    """What the block files depend on: an engine with another manifest cannot reuse them."""
    return {"format_version": FORMAT_VERSION, "model": str(model), "quantization": quantization,
            "pruning": pruning, "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": kv_cache_dtype, "block_size": block_size,
            "num_layers": args.num_hidden_layers, "num_kv_heads": args.num_key_value_heads,
            "head_dim": args.head_dim}


def open_directory(directory: Path, manifest: dict) -> list[tuple[bytes, int]]:
    """Prepare `directory` for an engine described by `manifest`; return the block files it may
    reuse as (hash, bytes), oldest first. Files written under another manifest are removed, after
    one log line naming the first field that differs and both values."""
    directory.mkdir(parents=True, exist_ok=True)
    files = sorted((p for p in directory.iterdir() if BLOCK_FILE.match(p.name)),
                   key=lambda p: p.stat().st_mtime_ns)
    stored_path = directory / MANIFEST
    stored = json.loads(stored_path.read_text()) if stored_path.exists() else None
    mismatch = None
    if stored is None and files:
        mismatch = ("manifest", "missing", "present")
    elif stored is not None:
        for key, value in manifest.items():
            if stored.get(key) != value:
                mismatch = (key, stored.get(key), value)
                break
    if mismatch is not None:
        key, old, new = mismatch
        log.warning("kv disk tier %s: %s is %r in the stored manifest and %r here; its %d block "
                    "files are not loaded and are removed", directory, key, old, new, len(files))
        for p in files:
            p.unlink(missing_ok=True)
        files = []
    stored_path.write_text(json.dumps(manifest, indent=1))
    return [(bytes.fromhex(p.name[:-len(SUFFIX)]), p.stat().st_size) for p in files]


def write_block(directory: Path, block_hash: bytes, data: torch.Tensor,
                drop_page_cache: bool) -> None:
    """Write one block; with drop_page_cache the file's pages leave the page cache, so that its
    next read comes from the disk itself."""
    raw = data.contiguous().view(torch.uint8).numpy()
    path = block_path(directory, block_hash)
    with open(path, "wb") as f:
        raw.tofile(f)
        if drop_page_cache:
            f.flush()
            os.fsync(f.fileno())     # dirty pages cannot be dropped before they are written
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_block(directory: Path, block_hash: bytes, shape: tuple,
               dtype: torch.dtype) -> torch.Tensor:
    raw = np.fromfile(block_path(directory, block_hash), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def delete_block(directory: Path, block_hash: bytes) -> None:
    block_path(directory, block_hash).unlink(missing_ok=True)
