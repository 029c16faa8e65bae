"""CUDA graphs for decode steps: a step's hundreds of kernel launches replayed as one.

Why: on a GPU a decode step of a small model is a few hundred tiny kernels (30 layers x norm, three
GEMMs, rotary, the cache write, two attention phases, SiLU, ...). Each launch costs the CPU a few
microseconds; at batch 1 the GPU finishes each kernel before the next is launched, so the step
takes as long as the Python that launches it. A CUDA graph records the launches once and replays
them with one call (vLLM captures its decode steps the same way).

A graph replays *exactly* what it recorded: the same kernels, grids and tensor addresses. So:

    capture (once, at engine start), for each size S in graph_batch_sizes(max_num_seqs):
        static buffers of S rows: token ids, positions, slot_mapping, block_tables, seq_lens
        metadata fixed for the graph: max_seq_len = max_model_len (so the paged-decode kernel's
        grid, its number of splits, is fixed; splits past a sequence's length exit at once)
        warm-up run, then torch.cuda.graph(...) records the model's forward into a shared pool

    replay (every decode-only step of n <= max size sequences):
        S = the smallest captured size >= n
        copy the step's ids, positions, slots, block tables and lengths into rows [0, n)
        rows [n, S) are padding: they write their K/V into a scratch block that this module holds
        (taken from the BlockManager, so no sequence ever owns it) and attend to one key there
        graph.replay(); the first n rows of the recorded output are the step's hidden states

Prefills, chunked or speculative steps and batches larger than the largest size run the eager
forward, unchanged. The LM head runs outside the graph on the rows that are sampled.

Without CUDA (`capture=False`), "replay" runs the same forward eagerly on the same static,
padded buffers and fixed metadata. That is how the padding, the scratch block and the fixed
metadata are tested on a CPU (Triton's interpreter runs the kernels); only the recording itself
needs a GPU.
"""
from __future__ import annotations

import collections
import time

import torch

from workbench.attention.metadata import AttentionMetadata

PADDING_OWNER = "__cuda_graph_padding__"   # the BlockManager entry that holds the scratch block


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8, up to max_num_seqs (vLLM's
    choice: a step pads to at most 7 rows more than it has, and 8 sizes cover 64 sequences)."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8))
    return sorted(sizes | {max_num_seqs})


class GraphedDecodeForward:
    """A drop-in for the runner's forward (same arguments, same result): decode-only steps replay
    a captured graph, everything else goes to `inner` (the eager model)."""

    def __init__(self, inner, cache, blocks, backend, max_num_seqs: int, max_model_len: int,
                 capture: bool = True):
        self.inner, self.cache, self.backend = inner, cache, backend
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len, self.capture = max_model_len, capture
        bs, dev, rows = cache.block_size, cache.device, self.sizes[-1]
        # Straight from the pool (not blocks.allocate, which would reserve max_model_len's worth of
        # blocks under kv_cache_layout="contiguous"); held in the manager's tables, so its
        # invariants count it and the scheduler never hands it out.
        if blocks.pool.num_available < 1:
            raise ValueError("cuda_graphs=True needs one free KV block for padding rows; "
                             "the pool has none")
        self.scratch_block = blocks.pool.allocate()
        blocks.tables[PADDING_OWNER] = [self.scratch_block]
        self.scratch_slot = self.scratch_block * bs
        max_blocks = -(-max_model_len // bs)
        long = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, **long)
        self.block_tables = torch.full((rows, max_blocks), self.scratch_block, **long)
        self.seq_lens = torch.ones(rows, **long)
        self.query_start_loc = torch.arange(rows + 1, **long)
        self._dirty = 0             # rows [0, _dirty) may hold a real sequence from an earlier step
        self.replays = collections.Counter()   # captured size -> steps replayed at that size
        self.graphs: dict[int, tuple] = {}     # size -> (graph or None, metadata, output)
        t = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        for size in reversed(self.sizes):      # largest first: smaller graphs reuse its pool
            self.graphs[size] = self._capture(size)
        self.capture_s = time.perf_counter() - t

    def _metadata(self, size: int) -> AttentionMetadata:
        """Fixed for the graph: the static buffers' first `size` rows, and the longest context the
        engine allows (the kernels size their grids from max_seq_len; real lengths are read from
        seq_lens on the device)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size], slot_table=self.block_tables[:size, :0],
            max_query_len=1, max_seq_len=self.max_model_len, query_lens=[1] * size,
            seq_lens_list=[self.max_model_len] * size, block_tables=self.block_tables[:size],
            block_size=self.cache.block_size, kv_cache_dtype=self.cache.kv_cache_dtype)

    def _run(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.inner(self.input_ids[:size], self.positions[:size], self.cache.kv_caches,
                          meta, self.backend)

    @torch.inference_mode()
    def _capture(self, size: int) -> tuple:
        meta = self._metadata(size)
        if not self.capture:
            return None, meta, None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):         # warm-up: Triton compiles, cuBLAS picks kernels
            self._run(size, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(size, meta)
        torch.cuda.synchronize()
        return graph, meta, out

    def takes(self, meta: AttentionMetadata, kv_caches) -> bool:
        """Decode-only steps over this engine's cache, no larger than the largest graph."""
        return (meta.max_query_len == 1 and meta.block_tables is not None
                and meta.num_seqs <= self.sizes[-1] and kv_caches is self.cache.kv_caches
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def __call__(self, input_ids, positions, kv_caches, meta, backend, num_layers=None):
        if num_layers is not None or not self.takes(meta, kv_caches):
            return self.inner(input_ids, positions, kv_caches, meta, backend, num_layers)
        n = meta.num_seqs
        size = next(s for s in self.sizes if s >= n)
        graph, gmeta, out = self.graphs[size]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if self._dirty > n:         # rows an earlier, larger step filled become padding again
            self._reset_padding(n, self._dirty)
        self._dirty = n
        self.replays[size] += 1
        if graph is None:
            out = self._run(size, gmeta)
        else:
            graph.replay()
        return out[:n]

    def _reset_padding(self, start: int, end: int) -> None:
        """Padding rows write to the scratch slot and read one key from the scratch block."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_slot
        self.block_tables[start:end, 0] = self.scratch_block
        self.seq_lens[start:end] = 1
