"""Structured pruning: whole decoder layers or MLP channels removed, so the model is genuinely
smaller and every kernel does less work (unstructured zeros save nothing on dense kernels).

    model + calibration windows
      -> each layer's importance (layers) or each MLP channel's (channels), on calibration text
      -> the least important removed: layers dropped from the stack; channels sliced out of
         gate_up_proj's rows and down_proj's columns (each layer keeps its own width)

- layers (ShortGPT, Men et al., 2024, arXiv 2403.03853): Block Influence
  BI_i = 1 - mean over tokens of cos(h_i, h_i+1), the hidden state entering and leaving layer i,
  all measured on the unpruned model in one pass; the round(ratio * L) layers with the lowest BI,
  those that change the hidden state least, are removed.
- channels: channel j of a layer's MLP scored by ||W_down[:, j]||_2 * sqrt(mean over tokens of
  h_j^2), h = silu(gate) * up being down_proj's input: the root mean square of what channel j adds
  to the layer's output on calibration text (Wanda's score summed over the output column). The
  round(ratio * I) lowest go; layers are pruned in order, each scored on the inputs the layers
  before it, already pruned, produce (as GPTQ and SparseGPT calibrate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import LlamaModel
from ..quant.gptq import LayerwiseRunner
from .pruning import squared_sums_accumulator

STRUCTURED = ("channels", "layers")


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


@torch.no_grad()
def prune_structured(model: LlamaModel, method: str, ratio: float,
                     calibration: list[list[int]]) -> list[int] | dict[int, int]:
    """Prune `model` in place; returns the removed layer indices (layers) or each layer's new MLP
    width (channels)."""
    if not calibration:
        raise ValueError(f"pruning={method!r} calibrates on text: pass calibration windows")
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
