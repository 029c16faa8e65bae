"""ModelRunner: turns a ScheduledBatch into one packed forward pass and the logits to sample from.

For each scheduled sequence it takes the tokens that are not in the cache yet (a whole prompt, a
chunk of one, or the last sampled token), their absolute positions, and the cache slots they will be
written to (from the sequence's block table); it concatenates them across sequences and builds the
AttentionMetadata. Only sequences whose last uncomputed token is in this step get a row of logits
(a sequence in the middle of a chunked prompt has nothing to sample yet), and only that last
position goes through the LM head, except for requests that asked for prompt logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention.metadata import AttentionMetadata
from .kv.block_manager import BlockManager, BlockOps
from .kv.paged_cache import PagedKVCache
from .models.llama import LlamaModel
from .scheduler import ScheduledBatch


@dataclass
class ForwardOutput:
    sample_indices: list[int]                 # which of batch.seqs get a token this step
    logits: torch.Tensor                      # (rows, vocab) fp32: one row per sampled sequence,
    #                                           1 + k for a sequence verifying k drafted tokens
    prompt_logprobs: dict[int, tuple[int, torch.Tensor]]  # seq index -> (first position, rows)


def pack(rows: list[tuple[list[int], int]], tables: list[list[int]], block_size: int,
         device: torch.device, kv_cache_dtype: str = "auto"
         ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One packed forward's inputs: rows[i] = (new token ids, position of the first) of sequence i,
    whose K/V live in the blocks tables[i]. Returns token ids, positions and the metadata."""
    ids, positions, q_lens, seq_lens = [], [], [], []
    for tokens, start in rows:
        ids.extend(tokens)
        positions.extend(range(start, start + len(tokens)))
        q_lens.append(len(tokens))
        seq_lens.append(start + len(tokens))
    dev, bs = device, block_size
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)
    max_seq_len = max(seq_lens)
    # slot of position p = block_table[p // block_size] * block_size + p % block_size
    pos = torch.arange(max_seq_len, device=dev)
    slot_table = block_tables[:, pos // bs] * bs + pos % bs
    positions_t = torch.tensor(positions, device=dev)
    seq_index = torch.repeat_interleave(torch.arange(len(q_lens), device=dev),
                                        torch.tensor(q_lens, device=dev))
    slot_mapping = slot_table[seq_index, positions_t]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + q_lens, device=dev).cumsum(0),
        seq_lens=torch.tensor(seq_lens, device=dev), slot_mapping=slot_mapping,
        slot_table=slot_table, max_query_len=max(q_lens), max_seq_len=max_seq_len,
        query_lens=q_lens, seq_lens_list=seq_lens, block_tables=block_tables, block_size=bs,
        kv_cache_dtype=kv_cache_dtype)
    return torch.tensor(ids, device=dev), positions_t, meta


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, blocks: BlockManager, backend,
                 device: torch.device):
        self.model, self.cache, self.blocks = model, cache, blocks
        self.backend, self.device = backend, device

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        rows = [(seq.scheduled_tokens(seq.num_computed_tokens, n), seq.num_computed_tokens)
                for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        tables = [self.blocks.tables[s.request_id] for s in batch.seqs]
        return pack(rows, tables, self.blocks.block_size, self.device, self.cache.kv_cache_dtype)

    def apply_block_ops(self, ops: BlockOps) -> None:
        if ops:
            self.cache.apply(ops)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                batch: ScheduledBatch) -> ForwardOutput:
        hidden = self.model(input_ids, positions, self.cache.kv_caches, meta, self.backend)
        ends = meta.query_start_loc[1:].tolist()
        # A sequence gets logits when this step reaches its last token; with drafted tokens, one row
        # per draft too (row j scores draft j + 1; the last row is the bonus position).
        sample, rows = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.num_computed_tokens + n == seq.num_tokens + len(seq.spec_token_ids):
                sample.append(i)
                rows.extend(range(ends[i] - 1 - len(seq.spec_token_ids), ends[i]))
        logits = self.model.compute_logits(hidden[rows])
        prompt_lps = {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.params.prompt_logprobs is None or seq.prompt_logprobs_done:
                continue
            # Position j predicts prompt token j + 1; continue where the last chunk stopped.
            first = len(seq.prompt_logprobs or [None]) - 1
            last = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if last > first:
                row0 = ends[i] - n + (first - seq.num_computed_tokens)
                rows = self.model.compute_logits(hidden[row0:row0 + last - first])
                prompt_lps[i] = (first, torch.log_softmax(rows, dim=-1))
        return ForwardOutput(sample, logits, prompt_lps)
