"""Batch-invariant execution (`LLM(batch_invariant=True)`): a sequence's numbers do not depend on
which other sequences share its steps, so a request gives the same tokens alone and in any batch.

Why they move at all (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025): a
matmul library picks its kernel, and with it the order of the sums along K, by the number of rows.
On torch 2.13's CPU fp32 GEMM, a row's result at small row counts (1-3 rows for a 1536 x 576
layer, up to 9 for a 576 x 576 one) differs in the last bits from the same row at 12 or more rows (`python -m workbench.models.batch_invariant` checks this
machine). The hand-written 1-2-row loops of kernels/cpu differ from the GEMM in the same way, and
padded attention over a group of sequences differs from one sequence alone.

What this mode does, as vLLM's batch-invariant mode does with its own kernels:
- the layers on kernels/cpu's loops (cpu_gemv) run them for every row count, with the same
  accumulator chains for every row (gemv.cpp's row-invariant mode, switched on for each step by
  runner.py), so a row's sums never depend on M;
- every other linear layer sees at least MIN_ROWS rows (zero rows appended, their outputs
  dropped), the range in which torch's GEMM keeps one per-row order;
- attention runs each sequence on its own (attention/torch_backend.py, `per_sequence`);
- fused_decode stays off and compile is refused (config.py).
The cost is the loops where torch's GEMM is faster (long prefills) and padding at small batches
on torch's kernels; `python -m workbench.bench speed` measures it on offline-mixed.
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.layers.linear import QuantLinear

MIN_ROWS = 16


class InvariantRows:
    """Mixed in before a linear layer's class: pads the rows up to MIN_ROWS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if n >= MIN_ROWS or getattr(self, "runs_loops", _never)(x):
            return super().forward(x)
        padded = torch.cat([rows, rows.new_zeros(MIN_ROWS - n, rows.shape[1])])
        out = super().forward(padded)[:n]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _never(x: torch.Tensor) -> bool:
    return False


_classes: dict[type, type] = {}


def make_batch_invariant(model: nn.Module) -> int:
    """Switch every linear layer of `model` in place; returns how many."""
    switched = 0
    for m in model.modules():
        cls = type(m)
        if isinstance(m, InvariantRows) or not isinstance(m, (nn.Linear, QuantLinear)):
            continue
        if cls not in _classes:
            _classes[cls] = type(f"BatchInvariant{cls.__name__}", (InvariantRows, cls), {})
        m.__class__ = _classes[cls]
        switched += 1
    return switched


def rows_that_differ(dtype: torch.dtype, n: int = 1536, k: int = 576, max_rows: int = 64) -> list[int]:
    """Row counts at which torch's linear gives row 0 another value than at max_rows rows."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(max_rows, k, generator=g).to(dtype)
    full = torch.nn.functional.linear(x, w)[0]
    return [m for m in range(1, max_rows) if not torch.equal(torch.nn.functional.linear(x[:m], w)[0], full)]


if __name__ == "__main__":
    for dt in (torch.float32, torch.bfloat16):
        bad = rows_that_differ(dt)
        print(f"{str(dt).removeprefix('torch.'):>9}: row 0 differs from its 64-row value at "
              f"{bad or 'no row count'}" + (f"; MIN_ROWS={MIN_ROWS} covers them"
                                            if all(m < MIN_ROWS for m in bad) else
                                            f"; some are >= MIN_ROWS={MIN_ROWS}!"))
