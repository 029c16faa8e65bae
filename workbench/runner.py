"""ModelRunner: turns a ScheduledBatch into one packed forward pass and one row of logits per sequence.

For each scheduled sequence it takes the tokens that are not in the cache yet, their absolute
positions, and the cache slots they will be written to; it concatenates them across sequences and
builds the AttentionMetadata that tells attention where each sequence starts and where its past keys
live. Only the last position of each sequence goes through the LM head (the head is the largest
matmul of a small model), except for requests that asked for prompt logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention.metadata import AttentionMetadata
from .kv.contiguous_cache import ContiguousKVCache
from .models.llama import LlamaModel
from .scheduler import ScheduledBatch


@dataclass
class ForwardOutput:
    logits: torch.Tensor                          # (num_seqs, vocab) fp32, at each last position
    prompt_logprobs: dict[int, torch.Tensor]      # seq index -> (n_prompt - 1, vocab) log-probs


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: ContiguousKVCache, backend,
                 device: torch.device):
        self.model, self.cache, self.backend, self.device = model, cache, backend, device

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            slots.append(self.cache.slots(seq.cache_row, start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
        dev = self.device
        query_start_loc = torch.tensor([0] + q_lens, device=dev).cumsum(0)
        rows = torch.tensor([s.cache_row for s in batch.seqs], device=dev)
        max_seq_len = max(seq_lens)
        # A row's slots are contiguous, so position p of the sequence in row r is slot r * L + p.
        # Positions past a sequence's length point at its own (unused) slots and are masked.
        slot_table = rows[:, None] * self.cache.max_model_len + torch.arange(max_seq_len, device=dev)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=torch.tensor(seq_lens, device=dev),
            slot_mapping=torch.cat(slots), slot_table=slot_table, max_query_len=max(q_lens),
            max_seq_len=max_seq_len, query_lens=q_lens, seq_lens_list=seq_lens)
        return (torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                batch: ScheduledBatch) -> ForwardOutput:
        hidden = self.model(input_ids, positions, self.cache.kv_caches, meta, self.backend)
        last = meta.query_start_loc[1:] - 1
        logits = self.model.compute_logits(hidden[last])
        prompt_lps = {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.params.prompt_logprobs is not None and seq.num_computed_tokens == 0:
                start = int(meta.query_start_loc[i])
                # Position j predicts token j + 1: n - 1 rows cover prompt tokens 1..n-1.
                rows = self.model.compute_logits(hidden[start:start + n - 1])
                prompt_lps[i] = torch.log_softmax(rows, dim=-1)
        return ForwardOutput(logits, prompt_lps)
