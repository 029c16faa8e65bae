"""Run the engine's own model over whole token windows outside the scheduler: one prefill per
window into a scratch KV cache, with the plain-PyTorch attention. Calibration (capturing each
linear layer's inputs) and evaluation use it, so they see exactly the forward pass generation uses.
"""
from __future__ import annotations

import torch

from workbench.attention.metadata import AttentionMetadata
from workbench.attention.torch_backend import TorchAttention
from workbench.models.llama import LlamaModel


@torch.inference_mode()
def prefill_hidden(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Final hidden states (T, hidden) of one sequence, every position."""
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    args = model.args
    n = len(token_ids)
    slots = torch.arange(n, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], device=device), seq_lens=torch.tensor([n], device=device),
        slot_mapping=slots, slot_table=slots[None, :], max_query_len=n, max_seq_len=n,
        query_lens=[n], seq_lens_list=[n])
    shape = (n, args.num_key_value_heads, args.head_dim)
    caches = [(torch.empty(shape, dtype=dtype, device=device),
               torch.empty(shape, dtype=dtype, device=device))
              for _ in range(args.num_hidden_layers)]
    ids = torch.tensor(token_ids, device=device)
    return model(ids, slots, caches, meta, TorchAttention())


def prefill_logprobs(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """(T, vocab) fp32 log-softmax of the next-token distribution at every position."""
    with torch.inference_mode():
        return torch.log_softmax(model.compute_logits(prefill_hidden(model, token_ids)), dim=-1)
