"""The one place where the engine chooses its attention implementation, and the contract
every implementation keeps.

A backend is an object with a `name` and one method, called once per layer per step:

    forward(q, k, v, k_cache, v_cache, meta, scale) -> (num_tokens, num_heads * head_dim)

- q (num_tokens, num_heads, head_dim), k and v (num_tokens, num_kv_heads, head_dim): this step's
  new tokens, packed, rotary embedding already applied;
- k_cache, v_cache (num_blocks * block_size, num_kv_heads, head_dim): this layer's paged cache;
- meta: AttentionMetadata (attention/metadata.py): where each sequence's new tokens start
  (query_start_loc), how long each context is (seq_lens), where to write (slot_mapping) and where
  to read (block_tables, or slot_table for backends that prefer one index per position).
The backend must first write k and v at slot_mapping, then attend each new query to its sequence's
keys up to its own position (causal, aligned bottom-right). It may cache per-step work in
`meta.plan` (the metadata object is shared by all layers of one step).

A backend also carries `ops`, the implementation of the per-token operations around attention
(fused residual add + RMSNorm, rotary embedding; layers/ops.py), so that one choice switches the
whole layer between plain PyTorch and the Triton kernels.

- "torch": plain PyTorch (torch_backend.py), the specification; the default on CPU.
- "cpu": the plain-PyTorch backend whose decode queries run kernels/cpu's paged decode kernel
  (C++, AVX-512), reading K/V blocks in place; prefill keeps SDPA. Opt-in: its fp32 sums run in
  another order than SDPA's, so a bf16 run can take another token at a near-tie than "torch" does.
- "triton": the kernels/ package (triton_backend.py); the default on CUDA. On CPU it runs only
  under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported): correct, very
  slow, and exactly how the tests check the kernels without a GPU.
"""
from __future__ import annotations

import os

import torch

from workbench.attention.torch_backend import TorchAttention
from workbench.kernels.cpu import available

BACKENDS = ("torch", "cpu", "triton")


def get_attention_backend(name: str, device: torch.device, batch_invariant: bool = False):
    """batch_invariant: each sequence attended on its own (the Triton decode kernel splits the
    context by batch size, so "auto" takes the torch backend on CUDA then)."""
    if name == "auto":
        name = ("triton" if device.type == "cuda" and _triton_available() and not batch_invariant
                else "torch")
    if name == "torch":
        return TorchAttention(per_sequence=batch_invariant)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' is invalid on device {device.type!r}: its "
                             "decode kernel is C++ for x86 CPUs; use 'auto'")
        ok, reason = available()
        if not ok:
            raise ValueError(f"attention_backend='cpu' is invalid here: {reason}; use 'torch'")
        return TorchAttention(decode_kernel=True, per_sequence=batch_invariant)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' on device {device.type!r} needs Triton's "
                             "interpreter: set TRITON_INTERPRET=1 in the environment before "
                             "starting Python (it is slow; use 'torch' on CPU otherwise)")
        from workbench.attention.triton_backend import TritonAttention
        return TritonAttention()
    raise ValueError(f"attention_backend={name!r} is invalid: allowed values are "
                     f"'auto', {', '.join(repr(b) for b in BACKENDS)}")


def _triton_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None
