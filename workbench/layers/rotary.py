"""Rotary position embedding (RoPE): the rotation frequencies of each pair of head dimensions, with
Llama 3's long-context rescaling, their cos/sin tables, and the rotate-half rotation transformers
applies. `args` is any object with head_dim, rope_theta and rope_scaling (a model's args)."""
from __future__ import annotations

import math

import torch
from torch import nn


def check_rope_scaling(scaling: dict | None) -> None:
    """A ValueError for a rope_scaling this module cannot apply (None: no rescaling)."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default", "llama3"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported: allowed are default, llama3")


def rope_inv_freq(args) -> torch.Tensor:
    """Rotation frequency of each pair of dimensions, with Llama 3's long-context rescaling if set."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    check_rope_scaling(scaling)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; `forward` rotates q and k at the given absolute positions."""

    def __init__(self, args, max_positions: int):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(args)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.args, self.max_positions = args, max_positions

    def rebuild(self, device: torch.device) -> None:
        """Recompute the tables on `device` (after the model was built on the meta device)."""
        fresh = RotaryEmbedding(self.args, self.max_positions)
        self.cos, self.sin = fresh.cos.to(device), fresh.sin.to(device)

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin at each token's position, (T, 1, D) to broadcast over heads; once per step."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+D/2}) by its position's angle (transformers' rotate-half form)."""
    return x * cos + RotaryEmbedding.rotate_half(x) * sin
