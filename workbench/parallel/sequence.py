"""Sequence parallelism, Megatron-LM style (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"): between the attention and MLP blocks each rank keeps
only its 1/N of the step's tokens, so the residual stream, the residual adds and the RMSNorms
run on T/N rows per rank instead of all T.

    x_r (T/N rows) ──► RMSNorm ──► all-gather tokens ──► qkv_proj / gate_up [column-parallel]
      ──► ... ──► o_proj / down_proj [row-parallel: partial sums of all T rows]
      ──► reduce-scatter tokens ──► x_r (T/N rows) + residual_r

The all-reduce of plain tensor parallelism is a reduce-scatter followed by an all-gather; SP
moves the all-gather to just before the next column-parallel layer, so the bytes on the wire are
the same and the norm and residual work between them is split. The embedding's all-reduce becomes
a reduce-scatter; the final norm runs on the slice, and its output is all-gathered before the LM
head (runner.logits picks the rows it needs from all T).

Padding: the T packed tokens of a step are padded with zero rows to T_pad = ceil(T / N) * N;
rank r holds rows [r * T_pad / N, (r + 1) * T_pad / N), so the padding sits at the end of the
last ranks' slices. Every all-gather strips the result back to T rows before attention or the
LM head sees it, and every reduce-scatter pads its T-row input again. Padded rows stay zero
(RMSNorm of zeros is zero) and are never read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.parallel.comm import Comm


class TokenSplit:
    """The step's token count and this rank's slice of it; one per rank, shared by its layers.
    The stage sets `tokens` before the layers run."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.tokens = 0

    @property
    def padded(self) -> int:
        return -(-self.tokens // self.comm.size) * self.comm.size

    @property
    def local(self) -> int:
        """Rows this rank holds between blocks (T_pad / N)."""
        return self.padded // self.comm.size

    def scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """(T, H) partial sums -> this rank's (T_pad / N, H) rows of their sum over ranks."""
        pad = self.padded - partial.shape[0]
        if pad:
            partial = F.pad(partial, (0, 0, 0, pad))
        return self.comm.reduce_scatter(partial, rows=self.tokens)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's (T_pad / N, H) rows -> all (T, H) rows, padding stripped."""
        return self.comm.all_gather_rows(rows, rows=self.tokens)[:self.tokens]


class GatherColumnLinear(nn.Module):
    """A column-parallel layer whose input is sequence-parallel: all-gather the tokens first."""

    def __init__(self, linear: nn.Linear, split: TokenSplit):
        super().__init__()
        self.weight = linear.weight
        self.split = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.split.gather(x), self.weight)


class ScatterRowLinear(nn.Module):
    """A row-parallel layer whose output is sequence-parallel: reduce-scatter over tokens
    instead of the all-reduce."""

    def __init__(self, weight: torch.Tensor, split: TokenSplit):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.split = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.split.scatter(F.linear(x, self.weight))


def sequence_parallel_layer(layer, split: TokenSplit) -> None:
    """Rewrite a tensor-parallel layer (tensor.shard_layer's output) to keep 1/N of the tokens
    between blocks."""
    attn, mlp = layer.self_attn, layer.mlp
    attn.qkv_proj = GatherColumnLinear(attn.qkv_proj, split)
    attn.o_proj = ScatterRowLinear(attn.o_proj.weight.data, split)
    mlp.gate_up_proj = GatherColumnLinear(mlp.gate_up_proj, split)
    mlp.down_proj = ScatterRowLinear(mlp.down_proj.weight.data, split)
