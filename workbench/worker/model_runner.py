"""ModelRunner: turns one step's StepInputs into one packed forward pass and the logits to sample from.

For each scheduled sequence it takes the tokens that are not in the cache yet (a whole prompt, a
chunk of one, or the last sampled token), their absolute positions, and the cache slots they will be
written to (from the sequence's block table); it concatenates them across sequences and builds the
AttentionMetadata. Only sequences whose last uncomputed token is in this step get a row of logits
(a sequence in the middle of a chunked prompt has nothing to sample yet), and only that last
position goes through the LM head, except for requests that asked for prompt logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.attention.metadata import AttentionMetadata
from workbench.kv.block_manager import BlockManager, BlockOps
from workbench.kv.paged_cache import PagedKVCache
from workbench.models.compile import CompiledForward, PrepackedLMHead
from workbench.models.cuda_graphs import GraphedDecodeForward
from workbench.models.fused_decode import FusedDecodeForward
from workbench.models.llama import LlamaModel


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


@dataclass
class StepInputs:
    """Everything a forward pass needs, as plain lists: what the driver sends to each worker of a
    parallel engine (and what a single-process engine hands its own runner)."""
    rows: list[tuple[list[int], int]]     # per sequence: (new token ids, position of the first)
    tables: list[list[int]]               # per sequence: its block table
    logit_rows: list[int]                 # rows of the packed hidden states that get logits
    prompt_rows: dict[int, tuple[int, int, int]]  # seq index -> (first prompt position, row, count)
    ops: list[BlockOps] = field(default_factory=list)   # block copies to apply first, in order


class ModelRunner:
    """The worker's half: runs StepInputs through the model and returns the logits rows. A
    single-process engine owns one; each worker process of a parallel engine owns one per shard."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, blocks: BlockManager | None,
                 backend, device: torch.device, compile: bool = False,
                 fused_decode: bool = False, cuda_graphs: dict | None = None,
                 freeze_weights: bool = False, row_invariant: bool = False):
        self.model, self.cache, self.blocks = model, cache, blocks
        # batch_invariant=True with the CPU kernels: their loops take every row count, one sum
        # order per row (kernels/cpu/gemv.cpp, set_row_invariant), for the whole step
        self.row_invariant = row_invariant
        self.backend, self.device = backend, device
        self.forward_fn = model          # or the compiled forward (compiles on its first call)
        self.compute_logits = model.compute_logits
        if compile:
            self.forward_fn = CompiledForward(model, freeze=freeze_weights)
            if freeze_weights and PrepackedLMHead.applies(model):   # the head runs outside
                self.compute_logits = PrepackedLMHead(model.lm_head.weight)
        if fused_decode:                 # decode and verification steps in one C++ call, the rest as above
            self.forward_fn = FusedDecodeForward(model, self.forward_fn)
        if cuda_graphs is not None:      # decode steps replayed from CUDA graphs (models/cuda_graphs.py)
            self.forward_fn = GraphedDecodeForward(self.forward_fn, cache, blocks, backend,
                                                   **cuda_graphs)

    def pack(self, rows, tables):
        return pack(rows, tables, self.cache.block_size, self.device, self.cache.kv_cache_dtype)

    def apply_block_ops(self, ops: BlockOps) -> None:
        if ops:
            self.cache.apply(ops)

    @torch.inference_mode()
    def execute(self, step: StepInputs, packed=None) -> ForwardOutput:
        """Apply the step's block ops, run the model, and compute the logits rows (fp32)."""
        for ops in step.ops:
            self.cache.apply(ops)
        input_ids, positions, meta = packed or self.pack(step.rows, step.tables)
        meta.decode_like = len(step.logit_rows) == len(input_ids)
        previous = torch.ops.workbench_cpu.set_row_invariant(True) if self.row_invariant else None
        try:
            hidden = self.forward_fn(input_ids, positions, self.cache.kv_caches, meta, self.backend)
            return self.logits(hidden, step)
        finally:
            if previous is not None:
                torch.ops.workbench_cpu.set_row_invariant(previous)

    def logits(self, hidden: torch.Tensor, step: StepInputs) -> ForwardOutput:
        wanted, end, sample = set(step.logit_rows), 0, []
        for i, (tokens, _) in enumerate(step.rows):
            end += len(tokens)
            if end - 1 in wanted:
                sample.append(i)
        logits = self.compute_logits(hidden[step.logit_rows])
        prompt_lps = {}
        for i, (first, row0, count) in step.prompt_rows.items():
            rows = self.compute_logits(hidden[row0:row0 + count])
            prompt_lps[i] = (first, torch.log_softmax(rows, dim=-1))
        return ForwardOutput(sample, logits, prompt_lps)
