"""The plain-PyTorch attention backend: the specification every faster backend is tested against.

One call per layer does two things:
1. write the new tokens' keys and values into the KV cache at `slot_mapping`;
2. for every sequence, attend its new queries to all of its cached keys, causally.

The causal mask is aligned *bottom-right*: the i-th of a sequence's `q_len` new queries sits at
position `seq_len - q_len + i` and may see every key up to and including that position. That one rule
covers prefill (q_len == seq_len), decode (q_len == 1) and chunked prefill on top of cached blocks
(1 < q_len < seq_len).

PyTorch's SDPA wants dense (batch, heads, len, dim) tensors, so keys and values are gathered out of
the paged cache into a padded batch. Padding every sequence to the longest one wastes copies when
lengths differ a lot (a 500-token and a 20-token sequence in one decode batch), so `plan` sorts the
sequences by length once per step and cuts them into a few groups whose padded area is smallest;
each layer then runs one gather and one SDPA call per group. Decoding sequences (one new query)
are never grouped with prefilling ones: padded to a prefill chunk's length, each would cost as much
as that chunk. The Triton paged kernels read blocks in place and need none of this.

`TorchAttention(decode_kernel=True)` (attention_backend="cpu") sends every decoding sequence to
the C++ paged decode kernel of kernels/cpu instead, which also reads blocks in place: one call per
layer for the whole decode batch, no gather, no padding; in a decode-only step the same call also
writes the new keys and values. Prefill still runs the SDPA path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.layers.ops import TorchOps
from workbench.layers.kv_formats import dequantize_rows, quantize_rows
from workbench.attention.metadata import AttentionMetadata

MAX_GROUPS = 4
GROUP_OVERHEAD_TOKENS = 32  # a group costs a few extra ops; worth it only if it saves more padding


@dataclass
class Group:
    """Sequences attended together, with every index tensor precomputed once per step."""

    num_seqs: int
    max_q: int
    max_kv: int
    slot_table: torch.Tensor        # (n, max_kv) slots to gather keys/values from, or
    block_table: torch.Tensor | None  # (n, blocks) whole blocks to gather (faster), if paged
    block_size: int
    q_index: torch.Tensor | None    # (n * max_q,) rows of q to gather into the padded batch
    out_index: torch.Tensor | None  # positions of real queries in the padded output (n * max_q)
    rows: torch.Tensor | None       # the token rows these sequences own in the packed batch
    mask: torch.Tensor | None       # (n, 1, max_q, max_kv) bool, None if not needed
    is_causal: bool
    first_slot: int | None = None   # one sequence whose blocks are consecutive: read in place
    kernel: bool = False            # decode queries for kernels/cpu's paged_decode (seq_lens set)
    seq_lens: torch.Tensor | None = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto") -> None:
    """Store this step's keys/values (num_tokens, kv_heads, head_dim) in their cache slots,
    quantized first if the cache holds FP8/INT8 rows."""
    if kv_cache_dtype != "auto":
        k, v = quantize_rows(k, kv_cache_dtype), quantize_rows(v, kv_cache_dtype)
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def split_by_length(lengths: list[int], max_groups: int = MAX_GROUPS,
                    overhead: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """Partition sequence indices, sorted by length, into at most `max_groups` runs minimizing
    sum(group max length x group size + overhead): dynamic programming over the sorted order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    if n <= 2:
        return [order]
    best = {(0, 0): (0, None)}  # (sequences placed, groups used) -> (cost, previous split)
    for used in range(1, max_groups + 1):
        for end in range(1, n + 1):
            options = [(best[(start, used - 1)][0] + lengths[order[start]] * (end - start)
                        + overhead, start)
                       for start in range(end) if (start, used - 1) in best]
            if options:
                best[(end, used)] = min(options)
    groups_used = min((best[(n, g)][0], g) for g in range(1, max_groups + 1) if (n, g) in best)[1]
    cuts, end = [], n
    for used in range(groups_used, 0, -1):
        start = best[(end, used)][1]
        cuts.append(order[start:end])
        end = start
    return cuts[::-1]


def gather(cache: torch.Tensor, g: Group) -> torch.Tensor:
    """(n, max_kv, KVH, D) copy of the group's keys or values. index_select copies whole rows and
    is several times faster than advanced indexing (`cache[slots]`); whole blocks faster still."""
    _, kv_heads, head_dim = cache.shape
    if g.first_slot is not None:         # a view, no copy: a single stream's usual case
        return cache[g.first_slot:g.first_slot + g.max_kv].unsqueeze(0)
    if g.block_table is not None:
        blocks = cache.view(-1, g.block_size, kv_heads, head_dim)
        out = blocks.index_select(0, g.block_table.flatten())
        return out.view(g.num_seqs, -1, kv_heads, head_dim)[:, :g.max_kv]
    out = cache.index_select(0, g.slot_table.flatten())
    return out.view(g.num_seqs, g.max_kv, kv_heads, head_dim)


class TorchAttention:
    """Reference attention over a slot-addressed KV cache: gather, pad, one SDPA call per group."""

    ops = TorchOps()

    def __init__(self, decode_kernel: bool = False, per_sequence: bool = False):
        self.decode_kernel = decode_kernel
        # per_sequence (batch_invariant=True): one group per sequence, so no sequence is padded
        # to another's length and its sums are those it would have alone.
        self.per_sequence = per_sequence
        self.name = "cpu" if decode_kernel else "torch"

    def kernel_fits(self, q: torch.Tensor) -> bool:
        """Whether the decode kernel takes these queries (it wants D % 16 == 0, bf16 or fp32)."""
        return (self.decode_kernel and q.device.type == "cpu" and q.shape[-1] % 16 == 0
                and q.dtype in (torch.bfloat16, torch.float32))

    def plan(self, meta: AttentionMetadata, use_kernel: bool | None = None) -> list[Group]:
        """Everything that is the same for every layer, computed once per step."""
        use_kernel = self.decode_kernel if use_kernel is None else use_kernel
        dev = meta.slot_table.device
        starts = meta.query_start_loc.tolist()
        decoding = [i for i in range(meta.num_seqs) if meta.query_lens[i] == 1]
        prefilling = [i for i in range(meta.num_seqs) if meta.query_lens[i] != 1]
        groups, batches = [], []
        if (use_kernel and decoding and meta.block_tables is not None
                and meta.kv_cache_dtype == "auto"):
            whole = len(decoding) == meta.num_seqs
            groups.append(Group(
                num_seqs=len(decoding), max_q=1, max_kv=max(meta.seq_lens_list[i] for i in decoding),
                slot_table=meta.slot_table[:0], block_table=meta.block_tables[decoding].contiguous(),
                block_size=meta.block_size, q_index=None, out_index=None,
                rows=None if whole else torch.tensor([starts[i] for i in decoding], device=dev),
                mask=None, is_causal=False, kernel=True,
                seq_lens=meta.seq_lens[decoding].contiguous()))
        elif decoding:
            batches.append(decoding)
        if prefilling:
            batches.append(prefilling)
        for subset in batches:
            parts = ([[j] for j in range(len(subset))] if self.per_sequence else
                     split_by_length([meta.seq_lens_list[i] for i in subset]))
            for part in parts:
                groups.append(self._group(meta, [subset[j] for j in part], starts, dev))
        return groups

    def _group(self, meta: AttentionMetadata, idx: list[int], starts: list[int], dev) -> Group:
        q_lens = [meta.query_lens[i] for i in idx]
        kv_lens = [meta.seq_lens_list[i] for i in idx]
        max_q, max_kv = max(q_lens), max(kv_lens)
        uniform_q = all(n == max_q for n in q_lens)
        same_kv = all(n == max_kv for n in kv_lens)
        whole = len(idx) == meta.num_seqs and idx == sorted(idx)
        rows = [r for i in idx for r in range(starts[i], starts[i] + meta.query_lens[i])]
        q_index = out_index = None
        if not uniform_q:
            q_index = torch.tensor([starts[i] + min(j, meta.query_lens[i] - 1)
                                    for i in idx for j in range(max_q)], device=dev)
            out_index = torch.tensor([g * max_q + j for g, i in enumerate(idx)
                                      for j in range(meta.query_lens[i])], device=dev)
        is_causal = uniform_q and same_kv and max_q == max_kv   # plain prefills from 0
        mask = None
        if not is_causal and not (uniform_q and same_kv and max_q == 1):
            q_pos = torch.tensor([[kv - q + j for j in range(max_q)]
                                  for q, kv in zip(q_lens, kv_lens)], device=dev)
            mask = (torch.arange(max_kv, device=dev)[None, None, :] <= q_pos[:, :, None])
            mask = mask[:, None]
        first_slot = None
        if len(idx) == 1 and meta.block_tables is not None:
            used = meta.block_tables[idx[0], :-(-max_kv // meta.block_size)].tolist()
            if used == list(range(used[0], used[0] + len(used))):
                first_slot = used[0] * meta.block_size
        return Group(
            num_seqs=len(idx), max_q=max_q, max_kv=max_kv,
            slot_table=meta.slot_table[idx, :max_kv],
            block_table=None if meta.block_tables is None else
            meta.block_tables[idx, :-(-max_kv // meta.block_size)],
            block_size=meta.block_size, q_index=q_index, out_index=out_index,
            rows=None if whole else torch.tensor(rows, device=dev),
            mask=mask, is_causal=is_causal, first_slot=first_slot)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D); caches: (num_slots, KVH, D). Returns (T, H * D)."""
        if meta.plan is None:
            meta.plan = self.plan(meta, self.kernel_fits(q))
        num_tokens, num_heads, head_dim = q.shape
        first = meta.plan[0]
        if first.kernel and first.rows is None:     # every token decodes: write + attend, one call
            out = torch.ops.workbench_cpu.paged_decode_write(
                q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache,
                meta.slot_mapping, first.block_table, first.seq_lens, first.block_size, scale)
            return out.view(num_tokens, num_heads * head_dim)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.kv_cache_dtype)
        out = None
        for g in meta.plan:
            result = self._attend(q, k_cache, v_cache, g, scale,
                                  meta.kv_cache_dtype)   # (rows of g, H * D)
            if g.rows is None:
                return result
            if out is None:
                out = q.new_empty(num_tokens, num_heads * head_dim)
            out.index_copy_(0, g.rows, result)
        return out

    @staticmethod
    def _attend(q, k_cache, v_cache, g: Group, scale: float,
                kv_cache_dtype: str = "auto") -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        if g.kernel:
            queries = q if g.rows is None else q.index_select(0, g.rows)
            out = torch.ops.workbench_cpu.paged_decode(
                queries.contiguous(), k_cache, v_cache, g.block_table, g.seq_lens,
                g.block_size, scale)
            return out.view(g.num_seqs, num_heads * head_dim)
        keys, values = gather(k_cache, g), gather(v_cache, g)
        if kv_cache_dtype != "auto":   # dequantize on read, in the query's dtype
            keys = dequantize_rows(keys, kv_cache_dtype, q.dtype)
            values = dequantize_rows(values, kv_cache_dtype, q.dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)   # (n, KVH, max_kv, D)
        if g.q_index is not None:
            queries = q[g.q_index]
        elif g.rows is not None:
            queries = q[g.rows]
        else:
            queries = q
        queries = queries.view(g.num_seqs, g.max_q, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask,
                                             is_causal=g.is_causal, scale=scale,
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(g.num_seqs * g.max_q, num_heads * head_dim)
        return out if g.out_index is None else out[g.out_index]
