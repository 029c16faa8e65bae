"""The torch attention backend against attention written out by hand, one sequence at a time.

Batches mix prefills, decodes and partial prefills on top of cached tokens (the bottom-right causal
alignment), with GQA ratios 1, 3 and 8 and slot tables that are not in order."""
import torch
from hypothesis import given, settings, strategies as st

from workbench.attention import AttentionMetadata
from workbench.attention.torch_backend import TorchAttention


def naive_attention(q, k, v, scale):
    """q: (n_q, H, D) for the LAST n_q positions of a context of k: (L, KVH, D)."""
    n_q, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    for h in range(heads):
        kh, vh = k[:, h // group], v[:, h // group]
        for i in range(n_q):
            pos = length - n_q + i
            scores = (q[i, h] @ kh[:pos + 1].T) * scale
            out[i, h] = torch.softmax(scores, -1) @ vh[:pos + 1]
    return out


def build_batch(q_lens, ctx_lens, kv_heads, group, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    num_slots = sum(ctx_lens) + 7
    perm = torch.randperm(num_slots, generator=g)  # each sequence's slots scattered in the pool
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    slots, offset, new_q, new_k, new_v, mapping = [], 0, [], [], [], []
    for n, length in zip(q_lens, ctx_lens):
        seq_slots = perm[offset:offset + length]
        offset += length
        slots.append(seq_slots)
        new_q.append(torch.randn(n, heads, head_dim, generator=g))
        new_k.append(torch.randn(n, kv_heads, head_dim, generator=g))
        new_v.append(torch.randn(n, kv_heads, head_dim, generator=g))
        mapping.append(seq_slots[length - n:])
    max_len = max(ctx_lens)
    table = torch.zeros(len(q_lens), max_len, dtype=torch.long)
    for i, s in enumerate(slots):
        table[i, :len(s)] = s
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + list(q_lens)).cumsum(0),
        seq_lens=torch.tensor(ctx_lens), slot_mapping=torch.cat(mapping), slot_table=table,
        max_query_len=max(q_lens), max_seq_len=max_len, query_lens=list(q_lens),
        seq_lens_list=list(ctx_lens))
    return (torch.cat(new_q), torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta, slots)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_seqs=st.integers(1, 7), group=st.sampled_from([1, 3, 8]),
       kv_heads=st.integers(1, 2), seed=st.integers(0, 1000))
def test_matches_hand_written_attention(data, num_seqs, group, kv_heads, seed):
    ctx_lens = [data.draw(st.integers(1, 40)) for _ in range(num_seqs)]
    q_lens = [data.draw(st.integers(1, c)) for c in ctx_lens]
    q, k, v, k_cache, v_cache, meta, slots = build_batch(q_lens, ctx_lens, kv_heads, group, 16,
                                                         seed)
    scale = 16 ** -0.5
    out = TorchAttention().forward(q, k, v, k_cache, v_cache, meta, scale)
    assert out.shape == (sum(q_lens), kv_heads * group * 16)
    start = 0
    for i, n in enumerate(q_lens):
        # The new keys were written into the cache at slot_mapping before attending.
        torch.testing.assert_close(k_cache[slots[i][ctx_lens[i] - n:]], k[start:start + n])
        expected = naive_attention(q[start:start + n], k_cache[slots[i]], v_cache[slots[i]], scale)
        torch.testing.assert_close(out[start:start + n].view_as(expected), expected,
                                   atol=1e-5, rtol=1e-5)
        start += n


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 600), min_size=1, max_size=40))
def test_length_groups_partition_the_batch_and_never_pad_more_than_one_group(lengths):
    from workbench.attention.torch_backend import GROUP_OVERHEAD_TOKENS, MAX_GROUPS, \
        split_by_length
    groups = split_by_length(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert 1 <= len(groups) <= MAX_GROUPS

    def cost(gs):
        return sum(max(lengths[i] for i in g) * len(g) + GROUP_OVERHEAD_TOKENS for g in gs)
    assert cost(groups) <= cost([list(range(len(lengths)))])


def test_a_single_sequence_on_consecutive_blocks_is_read_in_place():
    """One sequence whose blocks are consecutive in the pool (a single stream's usual case): the
    backend reads keys and values as a view of the cache, and the result is the gathering path's."""
    block, heads, kv_heads, dim, ctx = 4, 6, 2, 16, 10
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(64, kv_heads, dim, generator=g)
    v_cache = torch.randn(64, kv_heads, dim, generator=g)
    q, k, v = (torch.randn(1, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))

    def meta(blocks):
        table = torch.tensor([blocks])
        slots = (table[:, :, None] * block + torch.arange(block)).view(1, -1)[:, :ctx]
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([ctx]),
            slot_mapping=slots[0, ctx - 1:], slot_table=slots, max_query_len=1, max_seq_len=ctx,
            query_lens=[1], seq_lens_list=[ctx], block_tables=table, block_size=block)
    backend = TorchAttention()
    in_place, scattered = meta([5, 6, 7]), meta([9, 2, 7])
    assert backend.plan(in_place)[0].first_slot == 20
    assert backend.plan(scattered)[0].first_slot is None
    out = backend.forward(q, k, v, k_cache, v_cache, in_place, dim ** -0.5)
    for s in range(ctx):   # move the same context to the scattered slots, then attend again
        src, dst = in_place.slot_table[0, s], scattered.slot_table[0, s]
        k_cache[dst], v_cache[dst] = k_cache[src], v_cache[src]
    again = backend.forward(q, k, v, k_cache, v_cache, scattered, dim ** -0.5)
    torch.testing.assert_close(out, again)
    expected = naive_attention(q, k_cache[scattered.slot_table[0]], v_cache[scattered.slot_table[0]],
                               dim ** -0.5)
    torch.testing.assert_close(out.view_as(expected), expected, atol=1e-5, rtol=1e-5)
