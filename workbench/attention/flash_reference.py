"""FlashAttention's algorithms, small and in plain PyTorch, with the counting that explains them.

    from workbench.attention.flash_reference import online_softmax_steps, tile_map
    steps = online_softmax_steps(scores, v, block_n=8)       # one record per key tile

- counting: FLOPs and HBM bytes of naive and tiled attention, and the tile map a causal kernel
  walks (computed with the same bounds formula as `workbench.kernels.flash_attention._flash_attention_fwd`);
- the algorithms: the online softmax one key tile at a time, recording its state, and the split-KV
  partial results of Flash-Decoding with their merge (phase 2 of `kernels/paged_decode.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SKIP, MASKED, FULL = 0, 1, 2   # codes of the tile map


def attention_flops(seq_q: int, seq_k: int, head_dim: int, causal: bool = False, batch: int = 1,
                    heads: int = 1) -> float:
    """Forward attention FLOPs by the usual convention: two matmuls (QK^T and PV) of
    2 * Sq * Sk * D each, halved when causal (the masked half is useless work)."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    return flops / 2 if causal else flops


def naive_attention_bytes(seq_len: int, head_dim: int, elem_bytes: int = 2,
                          score_bytes: int | None = None) -> int:
    """HBM bytes one (batch, head) moves when attention runs as separate kernels that keep the
    (S, S) matrix in memory: read Q, K, V and write O (4 S D), write the scores and read them back
    for the softmax, write the probabilities and read them back for P @ V (4 S^2). A causal mask
    does not help: the whole matrix is still written and read."""
    score_bytes = elem_bytes if score_bytes is None else score_bytes
    return 4 * seq_len * head_dim * elem_bytes + 4 * seq_len * seq_len * score_bytes


def kernel_bounds(m0: int, q_len: int, kv_len: int, block_m: int, block_n: int,
                  causal: bool) -> tuple[int, int]:
    """(full_end, diag_end) of the query tile starting at row m0, exactly as the kernel computes
    them: key tiles in [0, full_end) need no mask, those in [full_end, diag_end) are masked, the
    rest are never loaded. The causal mask is aligned bottom-right (query i is at i + kv - q)."""
    if causal:
        shift = kv_len - q_len
        full_end = min((m0 + shift + 1) // block_n * block_n, kv_len // block_n * block_n)
        diag_end = min(m0 + block_m + shift, kv_len)
    else:
        full_end, diag_end = kv_len // block_n * block_n, kv_len
    return max(full_end, 0), diag_end


def tile_map(seq_q: int, seq_k: int, block_m: int, block_n: int,
             causal: bool = True) -> list[list[int]]:
    """For every (query tile, key tile): SKIP, MASKED or FULL, from `kernel_bounds`."""
    rows = []
    for m0 in range(0, seq_q, block_m):
        full_end, diag_end = kernel_bounds(m0, seq_q, seq_k, block_m, block_n, causal)
        row = []
        for n0 in range(0, seq_k, block_n):
            # the kernel's loops: range(0, full_end, BN) then range(full_end, diag_end, BN)
            row.append(FULL if n0 < full_end else MASKED if n0 < diag_end else SKIP)
        rows.append(row)
    return rows


def skipped_fraction(seq_len: int, block_m: int, block_n: int) -> float:
    """Share of the (query tile, key tile) pairs a causal kernel never loads, for Sq = Sk."""
    tiles = [c for row in tile_map(seq_len, seq_len, block_m, block_n, True) for c in row]
    return tiles.count(SKIP) / len(tiles)


def flash_attention_bytes(seq_len: int, head_dim: int, elem_bytes: int = 2, block_m: int = 128,
                          block_n: int = 64, causal: bool = False) -> int:
    """HBM bytes one (batch, head) moves in the tiled kernel when nothing is cached between
    programs: each query tile reads its Q rows once, reads every K and V tile it computes
    (so K and V are re-read once per query tile), and writes its O rows once."""
    total = 0
    for i, row in enumerate(tile_map(seq_len, seq_len, block_m, block_n, causal)):
        rows = min(block_m, seq_len - i * block_m)
        keys = sum(min(block_n, seq_len - j * block_n) for j, c in enumerate(row) if c != SKIP)
        total += 2 * rows * head_dim + 2 * keys * head_dim   # Q in + O out, K and V in
    return total * elem_bytes


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity, FLOP per byte moved."""
    return flops / nbytes


@dataclass
class SoftmaxStep:
    """The state of the online softmax after one more key tile (rows = queries)."""
    tile: int
    start: int            # keys [start, end) were added in this step
    end: int
    tile_max: torch.Tensor   # (rows,) max score inside this tile
    m: torch.Tensor          # (rows,) running max after this tile
    alpha: torch.Tensor      # (rows,) exp(m_old - m_new): how much the old state shrinks
    l: torch.Tensor          # (rows,) running sum of exp(s - m)
    acc: torch.Tensor        # (rows, D) unnormalized output, sum of exp(s - m) v
    out: torch.Tensor        # (rows, D) acc / l: the answer if the keys ended here


def online_softmax_steps(scores: torch.Tensor, v: torch.Tensor, block_n: int) -> list[SoftmaxStep]:
    """softmax(scores) @ v computed one key tile at a time, the way the kernel's loop does it,
    keeping every intermediate state. scores (rows, N), v (N, D); fp32 throughout.

    The kernel works in base 2 (scores pre-multiplied by log2(e), then exp2): the same numbers."""
    scores, v = scores.float(), v.float()
    rows, n = scores.shape
    m = torch.full((rows,), float("-inf"))
    l = torch.zeros(rows)
    acc = torch.zeros(rows, v.shape[1])
    steps = []
    for t, start in enumerate(range(0, n, block_n)):
        s = scores[:, start:start + block_n]
        tile_max = s.max(dim=1).values
        m_new = torch.maximum(m, tile_max)
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)              # exp(-inf) = 0 on the first tile
        l = l * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v[start:start + block_n]
        m = m_new
        steps.append(SoftmaxStep(t, start, min(start + block_n, n), tile_max, m.clone(),
                                 alpha.clone(), l.clone(), acc.clone(), acc / l[:, None]))
    return steps


def split_partials(scores: torch.Tensor, v: torch.Tensor, split_len: int):
    """Flash-Decoding's phase 1 in plain PyTorch: for each range of `split_len` keys, the output
    normalized over that range alone and its log-sum-exp (natural log; the kernel uses log2).
    scores (rows, N), v (N, D) -> outs (splits, rows, D), lse (splits, rows), bounds [(start, end)]."""
    scores, v = scores.float(), v.float()
    outs, lses, bounds = [], [], []
    for start in range(0, scores.shape[1], split_len):
        s = scores[:, start:start + split_len]
        outs.append(s.softmax(dim=1) @ v[start:start + split_len])
        lses.append(torch.logsumexp(s, dim=1))
        bounds.append((start, min(start + split_len, scores.shape[1])))
    return torch.stack(outs), torch.stack(lses), bounds


def merge_partials(outs: torch.Tensor, lse: torch.Tensor):
    """Phase 2: weight each split by its share of the softmax mass, exp(lse_s) / sum exp(lse),
    computed stably by subtracting the largest lse first. Returns (out (rows, D), weights
    (splits, rows)) with the weights summing to 1 over the splits."""
    w = torch.exp(lse - lse.max(dim=0).values)
    w = w / w.sum(dim=0)
    return (outs * w[..., None]).sum(dim=0), w


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
