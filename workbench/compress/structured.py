"""Structured pruning: whole decoder layers, MLP channels or query heads removed, so the model is
genuinely smaller and every kernel does less work (unstructured zeros save nothing on dense kernels).

    model + calibration windows
      -> each layer's importance (layers), each MLP channel's (channels) or each query head's
         (heads), on calibration text
      -> the least important removed: layers dropped from the stack; channels sliced out of
         gate_up_proj's rows and down_proj's columns; heads sliced out of qkv_proj's query rows
         and o_proj's columns (each layer keeps its own width and its own number of heads)

- layers (ShortGPT, Men et al., 2024, arXiv 2403.03853): Block Influence
  BI_i = 1 - mean over tokens of cos(h_i, h_i+1), the hidden state entering and leaving layer i,
  all measured on the unpruned model in one pass; the round(ratio * L) layers with the lowest BI,
  those that change the hidden state least, are removed.
- channels: channel j of a layer's MLP scored by ||W_down[:, j]||_2 * sqrt(mean over tokens of
  h_j^2), h = silu(gate) * up being down_proj's input: the root mean square of what channel j adds
  to the layer's output on calibration text (Wanda's score summed over the output column). The
  round(ratio * I) lowest go; layers are pruned in order, each scored on the inputs the layers
  before it, already pruned, produce (as GPTQ and SparseGPT calibrate).
- heads: query head h of layer l scored by sqrt(mean over tokens t of ||W_o[:, cols(h)] a_h(t)||^2),
  a_h being the head's attention output (its D columns of o_proj's input): the root mean square
  of what the head adds to the residual stream on calibration text. It is the channel score
  above with a head's D columns taken together (for D = 1 it is ||W[:, j]|| * rms(x_j) exactly),
  and it refines the activation-based head importance of Minitron (Muralidharan et al., 2024,
  arXiv 2407.14679), the norm of a_h, by what o_proj makes of it: a head whose output o_proj maps
  to little changes little, however large a_h (the point of Kobayashi et al., 2020, arXiv
  2004.10102, on attention analysed by the norms of the transformed vectors). It is computed from
  each head's second moment C_h = sum_t a_h a_h^T as sqrt(tr(W_h^T W_h C_h) / T), every layer on
  the unpruned model in one pass of the calibration windows.
  Grouped-query attention fixes what can go: query heads only, the same number r_l from every KV
  group of layer l, so that query head i still reads KV head i // (g - r_l) (g = H / KVH), every
  group keeps at least one head, and the KV heads and the KV cache are untouched. Each group keeps
  its highest-scoring heads, in their original order. r_l is chosen greedily over all layers:
  removing one more head from each group of layer l costs the sum of that layer's next-lowest
  score in each group, divided by the size of the residual stream entering layer l, sqrt(mean
  over tokens of ||h||^2) (the same units, measured in the same pass), and the cheapest such step
  over all layers is taken until round(ratio * L * H) heads are gone (whole steps of KVH heads,
  so a few more when the count is not a multiple of KVH). The division is what makes layers
  comparable: every reader of the stream sees it through an RMSNorm (Zhang & Sennrich, 2019,
  arXiv 1910.07467), which divides by its RMS, so what a head changes downstream is its
  contribution relative to the stream, and SmolLM2's stream grows from size 3 entering layer 0 to
  ~1500 from layer 12 on (the massive activations of Sun et al., 2024, arXiv 2402.17762).
  Absolute scores would take 2 of every 3 heads in the first ten layers first, which costs far
  more held-out perplexity than the division does (tests/test_head_pruning.py bounds it on
  SmolLM2). A ratio that would empty a group (more than 1 - 1/g of the heads) is refused.

  On SmolLM2-135M (9 query heads in 3 KV groups, 30 layers), `python -m workbench.bench compress
  --variants dense heads-0.25 heads-0.5 --repeats 7` measures which query heads each layer keeps,
  the held-out perplexity and mean KL, and decode tokens/s at batch 1 and 16 over the dense
  engine's (medians of alternating rounds; results/README.md keeps the committed runs). A head is
  2 x 64 x 576 weights (its query rows and o_proj columns), so ratio 0.25 removes 3% of the
  parameters and of the bytes a decode step reads, plus a quarter of the decode attention's query
  work; the KV cache is unchanged: a small cut in bytes, and so a small speedup at best. Channels
  and layers buy more speed per unit of perplexity on this model (results/README.md's compression
  table).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.llama import LlamaModel
from workbench.quant.gptq import LayerwiseRunner
from workbench.compress.masks import squared_sums_accumulator

STRUCTURED = ("channels", "layers", "heads")


def _hidden(chunk: dict) -> torch.Tensor:
    """The residual stream entering the next layer: x + residual (x alone before layer 0)."""
    x, residual = chunk["x"], chunk["residual"]
    return (x if residual is None else x + residual).float()


@torch.no_grad()
def block_influence(model: LlamaModel, calibration: list[list[int]]) -> list[float]:
    """ShortGPT's BI of every decoder layer, on the calibration windows."""
    runner = LayerwiseRunner(model, calibration)
    scores = []
    for index in range(len(model.layers)):
        before = [_hidden(c) for c in runner.chunks]
        runner.run(index, advance=True)
        cos = torch.cat([F.cosine_similarity(b, _hidden(c), dim=-1)
                         for b, c in zip(before, runner.chunks)])
        scores.append(1 - cos.mean().item())
    return scores


def remove_layers(model: LlamaModel, drop: list[int]) -> None:
    """Remove the decoder layers at the indices `drop`; the model's args follow."""
    keep = [layer for i, layer in enumerate(model.layers) if i not in set(drop)]
    model.layers = nn.ModuleList(keep)
    model.args.num_hidden_layers = len(keep)


def channel_scores(down: nn.Linear, input_sq_sums: torch.Tensor) -> torch.Tensor:
    """||W_down[:, j]||_2 * ||h_j||_2 over the calibration tokens, per channel j."""
    return down.weight.detach().float().norm(dim=0) * input_sq_sums.float().sqrt()


def _linear(weight: torch.Tensor) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                    dtype=weight.dtype)
    out.weight.data.copy_(weight)
    return out


def slice_channels(mlp: nn.Module, keep: torch.Tensor) -> None:
    """Keep only the intermediate channels `keep` (sorted indices) of a SwiGLU MLP."""
    w = mlp.gate_up_proj.weight.detach()
    inter = w.shape[0] // 2
    mlp.gate_up_proj = _linear(torch.cat([w[:inter][keep], w[inter:][keep]]))
    mlp.down_proj = _linear(mlp.down_proj.weight.detach()[:, keep])


# ----------------------------------------------------------------------------- heads
def head_counts(model: LlamaModel) -> list[int]:
    """Each layer's number of query heads (fewer than args.num_attention_heads once pruned)."""
    return [layer.self_attn.num_heads for layer in model.layers]


def head_second_moments(num_heads: int, head_dim: int):
    """(moments, add): add(x) accumulates, for (tokens, H * D) inputs of o_proj, each head's
    sum over tokens of a_h a_h^T, (H, D, D) in float64."""
    moments = torch.zeros(num_heads, head_dim, head_dim, dtype=torch.float64)

    def add(x: torch.Tensor) -> None:
        a = x.float().reshape(-1, num_heads, head_dim).transpose(0, 1)      # (H, T, D)
        moments.add_((a.transpose(1, 2) @ a).double())
    return moments, add


def head_scores_from(o_weight: torch.Tensor, moments: torch.Tensor, tokens: int) -> torch.Tensor:
    """sqrt(mean_t ||W_o[:, cols(h)] a_h(t)||^2) per head h = sqrt(tr(W_h^T W_h C_h) / tokens),
    from o_proj's weight (hidden, H * D) and the heads' second moments C (H, D, D)."""
    heads, d, _ = moments.shape
    w = o_weight.detach().double().reshape(-1, heads, d).transpose(0, 1)    # (H, hidden, D)
    gram = w.transpose(1, 2) @ w                                            # W_h^T W_h, (H, D, D)
    return ((gram * moments).sum((1, 2)) / tokens).clamp(min=0).sqrt()


@torch.no_grad()
def head_scores(model: LlamaModel, calibration: list[list[int]]
                ) -> tuple[list[torch.Tensor], list[float]]:
    """Every layer's query-head scores (see the module docstring), (H_l,) float64 each, and the
    RMS over tokens of the residual stream entering each layer, all measured on the model as it
    is, in one pass of the calibration windows."""
    runner = LayerwiseRunner(model, calibration)
    scores, stream = [], []
    for index, layer in enumerate(model.layers):
        hidden = torch.cat([_hidden(c) for c in runner.chunks])
        stream.append(hidden.double().pow(2).sum(-1).mean().sqrt().item())
        attn = layer.self_attn
        moments, add = head_second_moments(attn.num_heads, attn.head_dim)
        runner.run(index, {attn.o_proj: add}, advance=True)
        scores.append(head_scores_from(attn.o_proj.weight, moments, runner.num_tokens))
    return scores, stream


def heads_removed_per_group(scores: list[torch.Tensor], num_kv_heads: int,
                            count: int) -> list[int]:
    """r_l for every layer: how many query heads leave each KV group of layer l, chosen greedily on
    `scores` (prune_heads passes them relative to the residual stream) until at least `count`
    heads are gone (see the module docstring). A group's last head stays; a `count` that would
    need it is a ValueError."""
    ascending = []                               # per layer, (KVH, g_l): each group's sorted scores
    for s in scores:
        if s.numel() % num_kv_heads:
            raise ValueError(f"{s.numel()} query heads do not split into {num_kv_heads} KV groups")
        ascending.append(s.double().reshape(num_kv_heads, -1).sort(dim=1).values)
    capacity = sum(num_kv_heads * (a.shape[1] - 1) for a in ascending)
    if count > capacity:
        raise ValueError(f"removing {count} query heads would empty a KV group: at most "
                         f"{capacity} can go")
    removed, gone = [0] * len(scores), 0
    while gone < count:
        costs = [(a[:, r].sum().item(), l) for l, (a, r) in enumerate(zip(ascending, removed))
                 if r + 1 < a.shape[1]]
        _, layer = min(costs)                    # ties: the lower layer index
        removed[layer] += 1
        gone += num_kv_heads
    return removed


def kept_heads(scores: torch.Tensor, num_kv_heads: int, remove: int) -> torch.Tensor:
    """The query heads a layer keeps (sorted indices): in each KV group, all but its `remove`
    lowest-scoring heads (ties: the lower index goes)."""
    g = scores.numel() // num_kv_heads
    keep = []
    for j in range(num_kv_heads):
        order = torch.argsort(scores[j * g:(j + 1) * g], stable=True)
        keep.append(order[remove:].sort().values + j * g)
    return torch.cat(keep)


def slice_heads(attn: nn.Module, keep: torch.Tensor) -> None:
    """Keep only the query heads `keep` (sorted indices) of an Attention module: their rows of
    qkv_proj's query part and their columns of o_proj. Every KV group must keep the same number,
    so that kept head i reads KV head i // (new group size) as it read keep[i] // (old one)."""
    keep = torch.as_tensor(keep, dtype=torch.long).sort().values
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    g_old, g_new = heads // kv_heads, len(keep) // kv_heads
    if (len(keep) % kv_heads or not len(keep) or keep.unique().numel() != len(keep)
            or keep.min() < 0 or keep.max() >= heads
            or not torch.equal(keep // g_old, torch.arange(len(keep)) // g_new)):
        raise ValueError(f"keep={keep.tolist()} is invalid: each of the {kv_heads} KV groups of "
                         f"{g_old} query heads must keep the same number (at least one)")
    rows = (keep[:, None] * d + torch.arange(d)).flatten()
    w = attn.qkv_proj.weight.detach()
    attn.qkv_proj = _linear(torch.cat([w[:attn.q_size][rows.to(w.device)], w[attn.q_size:]]))
    attn.o_proj = _linear(attn.o_proj.weight.detach()[:, rows.to(w.device)])
    attn.num_heads, attn.q_size = len(keep), len(keep) * d


@torch.no_grad()
def prune_heads(model: LlamaModel, ratio: float, calibration: list[list[int]]) -> dict[int, int]:
    """Remove round(ratio * all query heads) (see the module docstring); returns each layer's
    number of query heads kept."""
    kvh = model.args.num_key_value_heads
    heads = head_counts(model)
    total, capacity = sum(heads), sum(h - kvh for h in heads)
    count = round(ratio * total)
    if count > capacity:
        g = model.args.num_attention_heads // kvh
        raise ValueError(f"pruning_config['ratio']={ratio} would remove {count} of the {total} "
                         f"query heads, and every one of the {kvh} KV groups per layer keeps at "
                         f"least one of its {g}: at most {capacity} ({capacity / total:.3g}) can "
                         "go; lower it")
    scores, stream = head_scores(model, calibration)
    removed = heads_removed_per_group([s / max(r, 1e-12) for s, r in zip(scores, stream)], kvh,
                                      count)
    counts = {}
    for index, (layer, s, r) in enumerate(zip(model.layers, scores, removed)):
        if r:
            slice_heads(layer.self_attn, kept_heads(s, kvh, r))
        counts[index] = layer.self_attn.num_heads
    return counts


@torch.no_grad()
def prune_structured(model: LlamaModel, method: str, ratio: float,
                     calibration: list[list[int]]) -> list[int] | dict[int, int]:
    """Prune `model` in place; returns the removed layer indices (layers), each layer's new MLP
    width (channels) or each layer's number of query heads (heads)."""
    if not calibration:
        raise ValueError(f"pruning={method!r} calibrates on text: pass calibration windows")
    if method == "heads":
        return prune_heads(model, ratio, calibration)
    if method == "layers":
        scores = block_influence(model, calibration)
        count = round(ratio * len(scores))
        if count >= len(scores):
            raise ValueError(f"pruning_config['ratio']={ratio} would remove all {len(scores)} "
                             "layers: lower it")
        drop = sorted(sorted(range(len(scores)), key=scores.__getitem__)[:count])
        remove_layers(model, drop)
        return drop
    runner = LayerwiseRunner(model, calibration)
    widths = {}
    for index, layer in enumerate(model.layers):
        down = layer.mlp.down_proj
        sums, add = squared_sums_accumulator(down.in_features)
        runner.run(index, {down: add}, stop_after=down)
        scores = channel_scores(down, sums)
        kept = down.in_features - round(ratio * down.in_features)
        keep = scores.topk(max(kept, 1)).indices.sort().values
        slice_channels(layer.mlp, keep)
        widths[index] = len(keep)
        runner.run(index, advance=True)
    return widths
