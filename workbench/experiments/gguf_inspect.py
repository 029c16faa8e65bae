"""A small GGUF inspector: what llama.cpp's file stores, tensor by tensor and block by block.

The embedded SmolLM2 file stores its matrices as Q4_1 (the tied embedding / LM head as Q8_0, the
norms as F32). A Q4_1 block holds 32 consecutive weights of one row in 20 bytes (ggml's
`block_q4_1`):

    bytes 0-1   d, the scale, fp16 (little-endian)
    bytes 2-3   m, the minimum, fp16
    bytes 4-19  qs[16], two 4-bit codes per byte: the low nibble of qs[j] is weight j,
                the high nibble is weight j + 16           (ggml's dequantize_row_q4_1)
    weight_i = d * q_i + m,  q_i in 0..15                     5.0 bits per weight

So every block of 32 has at most 16 distinct values, on an evenly spaced grid. The converted model
(models/loader.py dequantizes the file once) keeps them exactly: an INT4 format whose groups are
these same 32 weights can represent them almost without loss, while groups that straddle two
blocks, or span several, cannot. `grid_stats` measures this on any weight matrix.
"""
from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workbench.models.loader import resolve_checkpoint

Q4_1_BLOCK = 32          # weights per block
Q4_1_BYTES = 20          # 2 (d) + 2 (m) + 16 (codes)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # PyTorch order: (rows = output features, ..., the blocked dimension)
    type: str                # ggml type name: Q4_1, Q8_0, F32, ...
    bytes: int               # bytes in the file
    data_offset: int         # where its data starts in the file


def _reader(path):
    # Parsing the header (a 49k-token vocabulary) takes seconds; the tensor data is memory-mapped,
    # so keeping a reader per file is cheap.
    path = Path(path).resolve()
    return _cached_reader(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int):
    import gguf
    return gguf.GGUFReader(path)


def list_tensors(path: str | Path) -> list[TensorInfo]:
    """Every tensor of a GGUF file, in file order. ggml lists dimensions innermost first; they are
    reversed here so a matrix reads (out_features, in_features) as in PyTorch."""
    return [TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name,
                       int(t.n_bytes), int(t.data_offset)) for t in _reader(path).tensors]


def summary_by_type(path: str | Path) -> dict[str, dict]:
    """Per ggml type: tensors, weights, bytes and bits per weight (bytes include block scales)."""
    out: dict[str, dict] = {}
    for t in list_tensors(path):
        s = out.setdefault(t.type, {"tensors": 0, "weights": 0, "bytes": 0})
        s["tensors"] += 1
        s["weights"] += int(np.prod(t.shape))
        s["bytes"] += t.bytes
    for s in out.values():
        s["bits_per_weight"] = 8 * s["bytes"] / s["weights"]
    return out


def format_summary(path: str | Path) -> str:
    lines = [f"{'type':<6}{'tensors':>9}{'weights':>14}{'MB':>9}{'bits/weight':>13}"]
    for name, s in sorted(summary_by_type(path).items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"{name:<6}{s['tensors']:>9}{s['weights']:>14,}{s['bytes'] / 1e6:>9.1f}"
                     f"{s['bits_per_weight']:>13.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- one Q4_1 block
@dataclass
class Q4_1Block:
    tensor: str
    block_index: int         # in file order: row-major, blocks along the row
    row: int                 # the output feature (row of the PyTorch-order matrix)
    first_column: int        # the block covers columns [first_column, first_column + 32)
    file_offset: int
    raw: bytes               # the 20 bytes as stored
    scale: float             # d
    minimum: float           # m
    codes: list[int]         # q_0 .. q_31, each 0..15
    weights: list[float]     # d * q_i + m, computed in fp32 as ggml does


def _tensor(path, name: str) -> TensorInfo:
    tensors = {t.name: t for t in list_tensors(path)}
    if name not in tensors:
        raise ValueError(f"tensor_name={name!r} is not in {Path(path).name}: it has "
                         f"{', '.join(list(tensors)[:4])}, ... ({len(tensors)} tensors)")
    return tensors[name]


def q4_1_block(path: str | Path, tensor_name: str, block_index: int) -> Q4_1Block:
    """Read one Q4_1 block straight from the file's bytes and decode it by hand."""
    t = _tensor(path, tensor_name)
    if t.type != "Q4_1":
        raise ValueError(f"tensor_name={tensor_name!r} is {t.type}, not Q4_1: pick a Q4_1 tensor "
                         "(the attention and MLP matrices)")
    num_blocks = t.bytes // Q4_1_BYTES
    if isinstance(block_index, bool) or not isinstance(block_index, int) \
            or not 0 <= block_index < num_blocks:
        raise ValueError(f"block_index={block_index!r} is invalid: {tensor_name} has blocks "
                         f"0..{num_blocks - 1}")
    offset = t.data_offset + block_index * Q4_1_BYTES
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(Q4_1_BYTES)
    d, m = struct.unpack("<ee", raw[:4])          # 'e' is IEEE fp16
    qs = raw[4:]
    codes = [b & 0x0F for b in qs] + [b >> 4 for b in qs]   # low nibbles 0..15, high 16..31
    d32, m32 = np.float32(d), np.float32(m)
    weights = [float(d32 * np.float32(q) + m32) for q in codes]   # fp32 products, as ggml
    per_row = t.shape[-1] // Q4_1_BLOCK
    return Q4_1Block(tensor_name, block_index, block_index // per_row,
                     (block_index % per_row) * Q4_1_BLOCK, offset, raw, float(d), float(m),
                     codes, weights)


def q4_1_codes(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(tensor name, (blocks, 32) uint8 codes) for every Q4_1 tensor, decoded in bulk."""
    for t in _reader(path).tensors:
        if t.tensor_type.name == "Q4_1":
            qs = np.asarray(t.data).reshape(-1, Q4_1_BYTES)[:, 4:]
            yield t.name, np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def q4_1_full_range_fraction(path: str | Path) -> float:
    """Fraction of Q4_1 blocks that use both code 0 and code 15. Where a block does, its own
    minimum is m and its maximum m + 15 d, so a min-max INT4 quantizer over the same 32 weights
    finds the same grid (d, m) again, up to rounding."""
    full = total = 0
    for _, codes in q4_1_codes(path):
        full += int(((codes == 0).any(1) & (codes == 15).any(1)).sum())
        total += codes.shape[0]
    return full / total


# --------------------------------------------------------------------------------- the 4-bit grid
@dataclass
class GridStats:
    group_size: int
    offset: int              # columns skipped before the first group
    num_groups: int
    max_distinct: int        # most distinct values in any group
    mean_distinct: float
    fraction_at_most_16: float   # groups that fit a 4-bit grid by value count


def distinct_per_group(weight: torch.Tensor, group_size: int = 32, offset: int = 0) -> torch.Tensor:
    """(rows, groups) number of distinct values in each run of `group_size` consecutive weights of
    a row, starting at column `offset` (a trailing partial group is left out)."""
    if weight.dim() != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: a 2-D matrix is needed")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} is invalid: it must be an integer >= 1")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < weight.shape[1]:
        raise ValueError(f"offset={offset!r} is invalid: it must be in [0, {weight.shape[1]})")
    groups = (weight.shape[1] - offset) // group_size
    if groups == 0:
        raise ValueError(f"group_size={group_size} is invalid here: no whole group fits in "
                         f"{weight.shape[1] - offset} columns")
    g = weight[:, offset:offset + groups * group_size].reshape(weight.shape[0], groups, group_size)
    s = g.sort(dim=-1).values
    return 1 + (s[..., 1:] != s[..., :-1]).sum(-1)


def grid_stats(weight: torch.Tensor, group_size: int = 32, offset: int = 0) -> GridStats:
    """How many distinct values the groups of a weight matrix hold. On a matrix that came from
    Q4_1, aligned groups of 32 hold at most 16; shifted or larger groups hold more."""
    n = distinct_per_group(weight, group_size, offset)
    return GridStats(group_size, offset, n.numel(), int(n.max()), float(n.float().mean()),
                     float((n <= 16).float().mean()))


def converted_weight(name: str, folder: str | Path | None = None) -> torch.Tensor:
    """One tensor of the converted embedded model (transformers names, e.g.
    'model.layers.0.mlp.down_proj.weight'), read alone from its safetensors file."""
    from safetensors import safe_open
    folder = Path(folder) if folder is not None else resolve_checkpoint("smollm2-135m")
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise ValueError(f"name={name!r} is not a tensor of {folder}: use transformers' names, "
                     "e.g. 'model.layers.0.mlp.down_proj.weight'")
