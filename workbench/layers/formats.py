"""Integer weight formats and their reference quantize/dequantize: the specification every fast
path (torch's packed CPU matmuls, the Triton kernel) is tested against.

- INT8 per output channel, symmetric: w[n, k] ~= q[n, k] * scale[n], q in [-127, 127].
  One scale per row: a row's largest weight sets its step.
- INT4 group-wise, asymmetric (llama.cpp's Q4_1 idea, GPTQ/AWQ's usual form): the input dimension
  is cut into groups of `group_size` consecutive weights; each (row, group) has a scale and a
  minimum, and w ~= q * scale + minimum with q in [0, 15]. When group_size does not divide the
  input size (SmolLM2's 576 = 4.5 x 128), the last group of each row is shorter: weights are padded
  with zeros to a whole number of groups, and activations with zeros on the fly (a zero input
  column contributes nothing, whatever its weight).
Codes are stored two per byte: element 2j in the low nibble, 2j + 1 in the high nibble.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.config.checks import check_group_size

INT4_MAX = 15


@dataclass
class Int8Weight:
    qweight: torch.Tensor   # (N, K) int8
    scale: torch.Tensor     # (N,) fp32

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]


@dataclass
class Int4Weight:
    packed: torch.Tensor    # (N, K_padded // 2) uint8, two codes per byte
    scale: torch.Tensor     # (N, groups) fp32
    minimum: torch.Tensor   # (N, groups) fp32
    group_size: int
    in_features: int        # K before padding

    @property
    def padded_in_features(self) -> int:
        return self.packed.shape[1] * 2

    def codes(self) -> torch.Tensor:
        return unpack_int4(self.packed)

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32, the padding dropped."""
        n, groups = self.scale.shape
        q = self.codes().float().view(n, groups, self.group_size)
        w = q * self.scale[..., None] + self.minimum[..., None]
        return w.view(n, -1)[:, :self.in_features]


def quantize_int8(w: torch.Tensor, rows_per_chunk: int = 4096) -> Int8Weight:
    """Symmetric per-output-channel INT8 by round-to-nearest.

    Computed `rows_per_chunk` rows at a time (every row is quantized on its own, so the result is
    the same): on SmolLM2's LM head (49,152 x 576) the whole-matrix form held ~4 fp32 copies of it
    at once, ~450 MB, more than the bf16 model itself, while a model was being quantized at load."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r0 in range(0, w.shape[0], rows_per_chunk):
        chunk = w[r0:r0 + rows_per_chunk].float()
        s = (chunk.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q[r0:r0 + rows_per_chunk] = torch.round(chunk / s[:, None]).clamp(-127, 127)
        scale[r0:r0 + rows_per_chunk] = s
    return Int8Weight(q, scale)


def pad_to_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Zero-pad the input dimension (dim 1) to a whole number of groups."""
    pad = -w.shape[1] % group_size
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def int4_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minimum) per (row, group) that map [min, max] of each group onto codes 0..15."""
    n = w.shape[0]
    g = pad_to_groups(w.float(), group_size).view(n, -1, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / INT4_MAX).clamp(min=1e-12)
    return scale, lo


def int4_codes(w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """Round-to-nearest codes 0..15 of w (N, K) on the given grid; (N, K_padded) uint8."""
    n = w.shape[0]
    g = pad_to_groups(w.float(), group_size).view(n, -1, group_size)
    q = torch.round((g - minimum[..., None]) / scale[..., None]).clamp(0, INT4_MAX)
    return q.view(n, -1).to(torch.uint8)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> Int4Weight:
    """Asymmetric group-wise INT4 by round-to-nearest (RTN)."""
    check_group_size(group_size)
    scale, minimum = int4_params(w, group_size)
    codes = int4_codes(w, scale, minimum, group_size)
    return Int4Weight(pack_int4(codes), scale, minimum, group_size, w.shape[1])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K // 2) uint8: even elements in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8 -> (N, K) uint8 codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).view(packed.shape[0], -1)
