"""The paged allocator, tested like vLLM's CPU tests: exact block ids, reference counts, eviction
order, copy-on-write and swap bookkeeping; then invariants under random operation sequences."""
from hypothesis import given, settings, strategies as st

from workbench.kv.block_manager import BlockManager, chain_hash
from workbench.kv.block_pool import BlockPool


def test_pool_hands_out_lowest_ids_and_evicts_cached_blocks_lru_only_when_needed():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2)
    pool.index(a, b"ha")
    pool.index(b, b"hb")
    pool.release(b)          # cached first: least recently used
    pool.release(a)          # cached second
    pool.release(c)          # unindexed: plain free
    assert (pool.num_used, pool.num_cached, pool.num_free) == (0, 2, 2)
    assert pool.allocate() == 2 and pool.allocate() == 3   # free blocks go before any eviction
    assert pool.allocate() == 1 and pool.num_evictions == 1  # then LRU: b was released first
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == 0
    pool.share(0)            # a prefix hit revives the cached block
    assert pool.ref_counts[0] == 1 and pool.num_cached == 0
    pool.check_invariants()


def test_blocks_are_taken_on_demand_and_returned_last_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 0, 6)            # 6 prompt tokens: 2 blocks
    assert bm.tables["a"] == [0, 1]
    assert bm.allocate("a", 6, 1)            # token 7 still fits in block 1
    assert bm.allocate("a", 7, 1)            # token 8 fills it
    assert bm.allocate("a", 8, 1) and bm.tables["a"] == [0, 1, 2]
    assert bm.allocate("b", 0, 20)           # 5 blocks
    assert bm.tables["b"] == [3, 4, 5, 6, 7] and bm.pool.num_free == 0
    assert not bm.allocate("c", 0, 1)        # nothing left: refused, nothing changed
    assert "c" not in bm.tables or bm.tables["c"] == []
    bm.free("a")
    assert bm.pool._free == [2, 1, 0]        # last block first back; next allocation takes 0
    assert bm.allocate("c", 0, 1) and bm.tables["c"] == [0]
    bm.check_invariants()


def test_prefix_hits_share_full_blocks_and_leave_the_last_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 110))                      # 10 tokens: 2 full blocks + 2
    assert bm.cached_prefix(prompt) == []
    bm.allocate("a", 0, 10)
    bm.index_full_blocks("a", prompt, 10)
    assert bm.pool.block_hash[0] == chain_hash(None, prompt[:4])
    assert bm.pool.block_hash[1] == chain_hash(chain_hash(None, prompt[:4]), prompt[4:8])
    same_start = prompt[:8] + [7, 7, 7]
    hits = bm.cached_prefix(same_start)
    assert hits == [0, 1]
    bm.allocate("b", 8, 3, hits)
    assert bm.tables["b"] == [0, 1, 3] and bm.pool.ref_counts[:2] == [2, 2]
    # Same second block, different first block: the chained hash does not match.
    assert bm.cached_prefix([0] * 4 + prompt[4:8] + [1]) == []
    # A prompt of exactly 8 tokens may reuse only 1 block: its last token must be computed.
    assert bm.cached_prefix(prompt[:8]) == [0]
    bm.free("a")
    bm.free("b")
    assert bm.pool.num_cached == 2 and bm.pool.num_used == 0
    assert bm.cached_prefix(same_start) == [0, 1]       # still reusable after both finished
    bm.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_last_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("p", 0, 6)                               # blocks 0 (full) and 1 (2 of 4 used)
    bm.fork("p", "c")
    assert bm.tables["c"] == [0, 1] and bm.pool.ref_counts[:2] == [2, 2]
    assert bm.allocate("c", 6, 1)                        # the child writes slot 2 of block 1
    assert bm.tables["c"] == [0, 2] and bm.take_ops().copy == [(1, 2)]
    assert bm.pool.ref_counts[:3] == [2, 1, 1]
    assert bm.allocate("p", 6, 1) and bm.tables["p"] == [0, 1]  # parent now alone in block 1
    assert not bm.take_ops()
    bm.check_invariants()


def test_swap_out_and_in_move_blocks_through_the_cpu_pool():
    bm = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=4)
    bm.allocate("a", 0, 8)
    bm.allocate("b", 0, 8)
    assert bm.can_swap_out("a")
    bm.swap_out("a")
    ops = bm.take_ops()
    assert ops.swap_out == [(0, 0), (1, 1)] and bm.cpu_tables["a"] == [0, 1]
    assert bm.pool.num_free == 2
    bm.allocate("c", 0, 4)                               # takes block 0 meanwhile
    assert not bm.can_swap_in("a")                       # 1 block available, 2 needed
    bm.free("c")
    assert bm.can_swap_in("a")
    bm.swap_in("a")
    assert bm.take_ops().swap_in == [(0, 0), (1, 1)] and "a" not in bm.cpu_tables
    bm.check_invariants()


def test_contiguous_reservation_takes_the_whole_context_up_front():
    bm = BlockManager(num_blocks=16, block_size=4, reserve_tokens=32)
    assert bm.allocate("a", 0, 5) and len(bm.tables["a"]) == 8
    assert bm.allocate("b", 0, 5) and len(bm.tables["b"]) == 8
    assert not bm.allocate("c", 0, 1)                    # 2 x 32 tokens reserved for 10 used


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "append", "fork", "free", "swap_out",
                                          "swap_in", "index"]),
                         st.integers(0, 5), st.integers(1, 9)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, caching=st.booleans())
def test_no_leak_no_double_free_under_random_operations(ops, caching):
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=caching,
                      num_cpu_blocks=8)
    tokens: dict[str, list[int]] = {}   # each sequence's tokens, all computed
    swapped: set[str] = set()
    for kind, who, n in ops:
        rid = f"r{who}"
        if kind == "alloc" and rid not in tokens:
            prompt = [who % 2] * 4 + list(range(n))      # some sequences share a first block
            hits = bm.cached_prefix(prompt)
            if bm.allocate(rid, len(hits) * 4, len(prompt) - len(hits) * 4, hits):
                tokens[rid] = prompt
        elif kind == "append" and rid in tokens and rid not in swapped:
            if bm.allocate(rid, len(tokens[rid]), n):
                tokens[rid] = tokens[rid] + [9] * n
        elif kind == "index" and rid in tokens and rid not in swapped:
            bm.index_full_blocks(rid, tokens[rid], len(tokens[rid]))
        elif kind == "fork" and rid in tokens and rid not in swapped:
            child = f"r{(who + 1) % 6}"
            if child not in tokens:
                bm.fork(rid, child)
                tokens[child] = list(tokens[rid])
        elif kind == "free" and rid in tokens:
            bm.free(rid)
            del tokens[rid]
            swapped.discard(rid)
        elif kind == "swap_out" and rid in tokens and rid not in swapped and bm.can_swap_out(rid):
            bm.swap_out(rid)
            swapped.add(rid)
        elif kind == "swap_in" and rid in swapped and bm.can_swap_in(rid):
            bm.swap_in(rid)
            swapped.discard(rid)
        bm.take_ops()
        bm.check_invariants()
        for r, t in tokens.items():  # every live sequence has exactly the blocks its tokens need
            table = bm.cpu_tables[r] if r in swapped else bm.tables[r]
            assert len(table) == bm.blocks_for(len(t))
    for rid in list(tokens):
        bm.free(rid)
    bm.check_invariants()
    assert bm.pool.num_used == 0 and bm.cpu_pool.num_used == 0
