"""Tensor parallelism, Megatron-LM style (Shoeybi et al. 2019): each rank holds a slice of every
weight matrix, and a layer needs two all-reduces, one after attention and one after the MLP.

    x ──► qkv_proj  [column-parallel: this rank's query heads and KV heads]  ──► attention on them
      ──► o_proj    [row-parallel: the matching input columns] ──► partial sum ──► all-reduce
    x ──► gate_up   [column-parallel: this rank's slice of the intermediate neurons]
      ──► down_proj [row-parallel] ──► partial sum ──► all-reduce
    embedding and LM head: vocabulary-parallel (each rank holds V / N rows of the table);
    the embedding masks ids outside its rows and all-reduces, the head all-gathers its logits.

A column-parallel layer needs no communication: its output slice is exactly what the next
row-parallel layer consumes. `shard_model` rewrites a loaded LlamaModel in place for one rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.parallel.comm import Comm


def check_tensor_parallel(args, size: int) -> None:
    """A clear error when the heads or the MLP do not split evenly over `size` ranks."""
    for name, value in (("num_attention_heads", args.num_attention_heads),
                        ("num_key_value_heads", args.num_key_value_heads),
                        ("intermediate_size", args.intermediate_size)):
        if value % size:
            divisors = [d for d in range(1, value + 1)
                        if args.num_attention_heads % d == 0 and args.num_key_value_heads % d == 0
                        and args.intermediate_size % d == 0]
            raise ValueError(f"tensor_parallel_size={size} is invalid for this model: {name}="
                             f"{value} does not split over {size} ranks; allowed sizes are "
                             + ", ".join(map(str, divisors)))


class RowParallelLinear(nn.Module):
    """y = x_r @ W_r^T on this rank's input slice, then the sum over ranks (the all-reduce)."""

    def __init__(self, weight: torch.Tensor, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the table; other ids look up zeros, and the sum over ranks
    leaves each token exactly its own row (a sum of one row and zeros: no rounding)."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.start, self.comm = start, comm
        self.split = None    # a sequence.TokenSplit: reduce-scatter over tokens, not all-reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.comm.all_reduce(x) if self.split is None else self.split.scatter(x)


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary rows; all-gathered so every rank has the full row."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm: Comm):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else \
            nn.Parameter(weight.contiguous(), requires_grad=False)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.comm.all_gather_cat(F.linear(hidden, self.weight))
        return logits[..., :self.vocab_size]          # drop the padding rows of the last rank


def _rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w[start:start + n].clone()


def shard_model(model, rank: int, size: int, comm: Comm) -> None:
    """Keep this rank's slices of every weight; the model then computes its share of each layer."""
    check_tensor_parallel(model.args, size)
    for layer in model.layers:
        shard_layer(layer, model.args, rank, size, comm)
    shard_vocabulary(model, rank, size, comm)


def shard_layer(layer, args, rank: int, size: int, comm: Comm) -> None:
    """One decoder layer: column-parallel qkv and gate/up, row-parallel o_proj and down_proj.
    Also usable while loading (models/loader.py's on_layer), one layer at a time."""
    attn = layer.self_attn
    # The layer's own query heads (a head-pruned layer has fewer than args.num_attention_heads);
    # rank r's consecutive query heads then read its consecutive KV heads in every layer.
    if attn.num_heads % size or attn.num_kv_heads % size:
        raise ValueError(f"tensor_parallel_size={size} is invalid for this model: a layer has "
                         f"{attn.num_heads} query and {attn.num_kv_heads} KV heads, which do not "
                         f"split over {size} ranks")
    heads, kv_heads = attn.num_heads // size, attn.num_kv_heads // size
    d = args.head_dim
    inter = args.intermediate_size // size
    w = attn.qkv_proj.weight.data
    q, k, v = w.split([attn.q_size, attn.kv_size, attn.kv_size])
    qkv = torch.cat([_rows(q, rank * heads * d, heads * d), _rows(k, rank * kv_heads * d,
                     kv_heads * d), _rows(v, rank * kv_heads * d, kv_heads * d)])
    attn.qkv_proj = nn.Linear(qkv.shape[1], qkv.shape[0], bias=False, device=w.device,
                              dtype=w.dtype)
    attn.qkv_proj.weight.data = qkv
    cols = slice(rank * heads * d, (rank + 1) * heads * d)
    attn.o_proj = RowParallelLinear(attn.o_proj.weight.data[:, cols], comm)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * d, kv_heads * d
    mlp = layer.mlp
    gate, up = mlp.gate_up_proj.weight.data.chunk(2)
    gu = torch.cat([_rows(gate, rank * inter, inter), _rows(up, rank * inter, inter)])
    mlp.gate_up_proj = nn.Linear(gu.shape[1], gu.shape[0], bias=False, device=gu.device,
                                 dtype=gu.dtype)
    mlp.gate_up_proj.weight.data = gu
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data[:, rank * inter:(rank + 1)
                                                                * inter], comm)


def shard_vocabulary(model, rank: int, size: int, comm: Comm) -> None:
    """The embedding and the LM head: vocabulary-parallel rows."""
    args = model.args
    per_rank = -(-args.vocab_size // size)         # the last rank's slice is padded with zeros
    tied = model.lm_head.weight is model.embed_tokens.weight
    start = rank * per_rank
    model.embed_tokens = VocabParallelEmbedding(
        _vocab_rows(model.embed_tokens.weight.data, start, per_rank), start, comm)
    if tied:
        head = model.embed_tokens.weight
    else:
        head = _vocab_rows(model.lm_head.weight.data, start, per_rank)
    model.lm_head = VocabParallelLMHead(head, args.vocab_size, comm)


def _vocab_rows(table: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of a vocabulary table, zeros past its end (no padded full copy)."""
    out = torch.zeros(n, table.shape[1], dtype=table.dtype, device=table.device)
    end = min(start + n, table.shape[0])
    if end > start:
        out[:end - start] = table[start:end]
    return out
