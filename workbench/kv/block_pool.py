"""BlockPool: the KV cache's physical blocks, their reference counts, and the prefix-cache index.

Every block is in exactly one of three states:
- used:   ref_count > 0, held by one or more sequences (more than one when a prefix is shared);
- cached: ref_count == 0 but its contents are still valid and indexed by their hash, so a later
          request with the same prefix can take it back instead of recomputing it;
- free:   ref_count == 0 and holding nothing worth keeping.
used + cached + free == num_blocks, always (the property tests check it after every operation).

Allocation takes a free block first and evicts a cached one only when none is free, the least
recently released first (LRU). This is vLLM's design with one change: vLLM keeps free and cached
blocks in a single LRU queue, so it may evict a cached block while never-used ones are available.
An eviction calls `on_evict(block, hash)` first, if set: the tiered cache keeps the contents below
(tiers.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the pool needs at least 1 block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Free blocks, taken lowest id first so that tests can predict exact block ids.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.num_evictions = 0
        self.on_evict: Callable[[int, bytes], None] | None = None

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached_lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones it may evict."""
        return self.num_free + self.num_cached

    # ------------------------------------------------------------------ operations
    def allocate(self) -> int:
        """A block for new contents, ref_count 1. Evicts the least recently used cached block
        only when no free block is left."""
        if self._free:
            block = self._free.pop()
        elif self._cached_lru:
            block, _ = self._cached_lru.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block, self.block_hash[block])
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
            self.num_evictions += 1
        else:
            raise RuntimeError("KV cache pool exhausted: the caller must check num_available")
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of `block`: a prefix-cache hit or a forked sequence."""
        if self.ref_counts[block] == 0:
            if block not in self._cached_lru:
                raise RuntimeError(f"block {block} is free; only used or cached blocks are shared")
            del self._cached_lru[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer. At zero the block becomes cached if it is indexed, else free."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} released more often than it was taken")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self._cached_lru[block] = None   # most recently used goes last
            else:
                self._free.append(block)

    def index(self, block: int, block_hash: bytes) -> None:
        """Record that `block` holds the full block whose chained hash is `block_hash`.
        If another block already holds the same contents, keep that one: the index maps each
        hash to one block, and this block stays unindexed (it is freed normally)."""
        if self.block_hash[block] is None and block_hash not in self.hash_to_block:
            self.block_hash[block] = block_hash
            self.hash_to_block[block_hash] = block

    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_block.get(block_hash)

    def check_invariants(self) -> None:
        """Raise if the bookkeeping is inconsistent (used by tests after every operation)."""
        assert all(r >= 0 for r in self.ref_counts)
        free, cached = set(self._free), set(self._cached_lru)
        assert len(free) == len(self._free) and not (free & cached)
        for b in range(self.num_blocks):
            if self.ref_counts[b] > 0:
                assert b not in free and b not in cached
            else:
                assert (b in free) != (b in cached)
                assert (b in cached) == (self.block_hash[b] is not None)
        assert {v: k for k, v in self.hash_to_block.items()} == {
            b: h for b, h in enumerate(self.block_hash) if h is not None}
        assert self.num_used + self.num_free + self.num_cached == self.num_blocks
