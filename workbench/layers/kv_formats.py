"""Quantized KV cache rows: FP8 (e4m3), INT8 or INT4 codes with one fp32 scale per (token, kv head).

A cache row (one token, one kv head) is stored as head_dim bytes of codes followed by the 4 bytes of
its scale, in one uint8 tensor of shape (slots, kv_heads, head_dim + 4). Keeping the scale inside
the row means every block operation the engine already does (copy-on-write, swap to CPU, prefix
reuse) moves codes and scales together with no extra bookkeeping.

Per-row scales follow the data: scale = max|x| / the format's largest value (448 for e4m3, 127 for
INT8). At head_dim 64 a row costs 68 bytes instead of 128 in bf16: 1.88x the tokens per budget.
Attention dequantizes on read (codes * scale), in the query's dtype.

INT4 packs two codes per byte (element 2j in the low nibble, 2j + 1 in the high one, each stored
as code + 8), codes in [-7, 7] with scale = max|x| / 7: a row is head_dim / 2 + 4 bytes (36 at
head_dim 64, 3.56x the tokens of bf16). Symmetric, because a zero point would cost 4 more bytes per
row, and keys and values per (token, head) sit roughly around zero; per row, because a row is
written once when its token is appended and never revisited (per-channel scales, KIVI's choice
for keys, need a group of tokens first). Rounding to the nearest code bounds the error of every
element by half a step: |x - x'| <= max|x| / 14 (INT8: max|x| / 254).
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4
FORMATS = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0),
           "int4": (torch.int8, 7.0)}
INT4_OFFSET = 8   # a code c in [-7, 7] is stored as the nibble c + 8


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FORMATS


def row_bytes(head_dim: int, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """Bytes of one (token, kv head) row of K (or V)."""
    if kv_cache_dtype == "int4":
        return head_dim // 2 + SCALE_BYTES
    if is_quantized(kv_cache_dtype):
        return head_dim + SCALE_BYTES
    return head_dim * torch.empty((), dtype=dtype).element_size()


def quantize_rows(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """(..., head_dim) float -> (..., row_bytes) uint8: codes, then the fp32 scale's bytes."""
    code_dtype, largest = FORMATS[kv_cache_dtype]
    if kv_cache_dtype == "int4" and x.shape[-1] % 2:
        raise ValueError(f"kv_cache_dtype='int4' is invalid for head_dim={x.shape[-1]}: two codes "
                         "share a byte, so head_dim must be even")
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / largest).clamp(min=1e-12)
    scaled = x32 / scale
    if kv_cache_dtype == "int4":
        nibbles = (torch.round(scaled).clamp(-7, 7) + INT4_OFFSET).to(torch.uint8)
        codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        return torch.cat([codes, scale.view(torch.uint8)], dim=-1)
    if code_dtype == torch.int8:
        codes = torch.round(scaled).clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(code_dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """(..., row_bytes) uint8 -> (..., head_dim) in `dtype`."""
    code_dtype, _ = FORMATS[kv_cache_dtype]
    width = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., width:].contiguous().view(torch.float32)
    if kv_cache_dtype == "int4":
        packed = rows[..., :width]
        low = (packed & 0xF).to(torch.int8) - INT4_OFFSET
        high = (packed >> 4).to(torch.int8) - INT4_OFFSET
        codes = torch.stack([low, high], dim=-1).flatten(-2)
        return (codes.float() * scale).to(dtype)
    codes = rows[..., :width].view(code_dtype)
    return (codes.float() * scale).to(dtype)
