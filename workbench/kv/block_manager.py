"""BlockManager: which blocks each sequence holds, prefix reuse, copy-on-write and swapping.

A sequence's *block table* lists its blocks in order: token at position p lives in block
`table[p // block_size]`, at offset `p % block_size`, i.e. in cache slot
`table[p // block_size] * block_size + p % block_size`. Blocks are taken only when tokens need them
(paging), so a sequence wastes at most `block_size - 1` slots, in its last block.

Prefix caching: a *full* block is named by a hash chained over all tokens up to its end,
`h_i = sha256(h_{i-1} || tokens of block i)`, so equal hashes mean equal prefixes, not just equal
blocks. A new request looks its full prompt blocks up in order and shares every hit.

Copy-on-write: forked sequences share blocks; before a sequence writes into a shared, partly filled
last block, it gets a private copy (the runner performs the copy before the forward pass).

Swapping: a preempted sequence's blocks can be copied to a pool in CPU memory and brought back later
into any free blocks; the runner performs the copies.

Tiers (tiers.py, optional): evicted prefix blocks spill to a CPU tier and on to disk; a lookup that
misses the device index continues its chain there, and allocation loads each hit into a new block.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from workbench.kv.block_pool import BlockPool
from workbench.kv.tiers import KVTiers, TierHit


def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    digest = hashlib.sha256(parent or b"root")
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


@dataclass
class BlockOps:
    """Physical copies the runner must perform before this step's forward pass, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, device block)
    copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) copy-on-write
    tier: list[tuple] = field(default_factory=list)   # spills and loads, in order (tiers.py)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy or self.tier)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: int = 0, reserve_tokens: int | None = None):
        """reserve_tokens: if set, a sequence takes blocks for that many tokens when it is first
        allocated (contiguous max-length reservation, for comparison with paging)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.enable_prefix_caching = enable_prefix_caching
        self.reserve_tokens = reserve_tokens
        self.tables: dict[str, list[int]] = {}
        self.cpu_tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[bytes]] = {}   # chained hashes of each sequence's full blocks
        self.ops = BlockOps()
        self.prefix_queries = 0    # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0       # of those, tokens found
        self.tiers: KVTiers | None = None
        self.tier_hits = {"cpu": 0, "disk": 0}   # of those, tokens loaded from each tier

    # ------------------------------------------------------------------ sizes
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def take_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        if self.tiers is not None:
            ops.tier = self.tiers.take_ops()
        return ops

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Spill evicted prefix blocks into `tiers` and look prefixes up there too."""
        self.tiers = tiers
        self.pool.on_evict = tiers.spill

    # ------------------------------------------------------------------ prefix cache
    def cached_prefix(self, token_ids: list[int]) -> list[int | TierHit]:
        """Blocks that already hold a prefix of `token_ids`. At least the last token is left
        uncached: the model must run on it to produce the next token's logits. With tiers, a
        block missing from the device index may be found below (a TierHit, loaded on allocation);
        the chain stops at the first block found nowhere."""
        if not self.enable_prefix_caching:
            return []
        blocks, parent = [], None
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.pool.lookup(parent)
            if block is None and self.tiers is not None:
                tier = self.tiers.lookup(parent)
                block = TierHit(parent, tier) if tier else None
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def index_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Make the sequence's blocks that are now full (and computed) findable by later requests."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.tables[request_id], self.hashes.setdefault(request_id, [])
        for i in range(len(hashes), num_computed // self.block_size):
            parent = hashes[-1] if hashes else None
            h = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(h)
            self.pool.index(table[i], h)
            if self.tiers is not None and self.pool.lookup(h) == table[i]:
                self.tiers.discard(h)

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, request_id: str, num_computed: int, num_new: int,
                     cached_blocks: list[int] = ()) -> bool:
        return self._blocks_needed(request_id, num_computed, num_new, cached_blocks) \
            <= self.pool.num_available

    def _blocks_needed(self, request_id, num_computed, num_new, cached_blocks) -> int:
        table = self.tables.get(request_id, [])
        total = num_computed + num_new
        if not table and self.reserve_tokens:
            total = max(total, self.reserve_tokens)
        need = max(0, self.blocks_for(total) - len(table) - len(cached_blocks))
        # Cached blocks nobody holds (ref_count 0) stop being available once shared; a hit in a
        # tier needs a block to be loaded into.
        need += sum(1 for b in cached_blocks
                    if isinstance(b, TierHit) or self.pool.ref_counts[b] == 0)
        if self._needs_cow(table, num_computed, num_new):
            need += 1
        return need

    def _needs_cow(self, table: list[int], num_computed: int, num_new: int) -> bool:
        """True if this step writes into a last block that another sequence also holds."""
        if not table or num_new == 0:
            return False
        last_start = (len(table) - 1) * self.block_size
        writes_last = num_computed < last_start + self.block_size \
            and num_computed + num_new > last_start
        return writes_last and self.pool.ref_counts[table[-1]] > 1

    def allocate(self, request_id: str, num_computed: int, num_new: int,
                 cached_blocks: list[int] = ()) -> bool:
        """Give the sequence blocks for tokens up to num_computed + num_new (first sharing the
        `cached_blocks` prefix hits). Returns False, changing nothing, if the pool is too small."""
        if not self.can_allocate(request_id, num_computed, num_new, cached_blocks):
            return False
        table = self.tables.setdefault(request_id, [])
        reserve = not table and self.reserve_tokens
        if cached_blocks:
            taken = self._take_hits(cached_blocks)
            table.extend(taken)
            self.hashes[request_id] = [self.pool.block_hash[b] for b in taken]
        if self._needs_cow(table, num_computed, num_new):
            old, new = table[-1], self.pool.allocate()
            self.ops.copy.append((old, new))
            self.pool.release(old)
            table[-1] = new
        target = self.blocks_for(num_computed + num_new)
        if reserve:
            target = max(target, self.blocks_for(self.reserve_tokens))
        while len(table) < target:
            table.append(self.pool.allocate())
        return True

    def _take_hits(self, hits: list[int | TierHit]) -> list[int]:
        """Device blocks for the prefix hits, in order: device hits are shared first (so that no
        allocation below evicts them), tier hits claimed (so that no spill pushes them out),
        then each tier hit gets a new block, indexed under its hash, and a load op."""
        tier_of = {}
        for hit in hits:
            if isinstance(hit, TierHit):
                tier_of[hit.block_hash] = self.tiers.claim(hit.block_hash)
            else:
                self.pool.share(hit)
        blocks = []
        for hit in hits:
            if isinstance(hit, TierHit):
                block = self.pool.allocate()
                self.pool.index(block, hit.block_hash)
                self.tiers.load(hit.block_hash, block)
                self.tier_hits[tier_of[hit.block_hash]] += self.block_size
                hit = block
            blocks.append(hit)
        return blocks

    def tier_stats(self) -> dict:
        """Prefix tokens loaded from each tier and bytes moved between tiers (empty without)."""
        if self.tiers is None:
            return {}
        t = self.tiers
        return {"kv_cpu_tier_hits": self.tier_hits["cpu"],
                "kv_disk_tier_hits": self.tier_hits["disk"],
                "kv_cpu_tier_blocks": len(t.cpu), "kv_disk_tier_blocks": len(t.disk),
                "kv_disk_tier_bytes": t.disk_bytes,
                **{f"kv_bytes_{k}": v for k, v in t.bytes_moved.items()}}

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past those that the sequence's first `num_tokens` tokens need: the
        lookahead blocks of drafted tokens that verification rejected. (Rejected slots inside a
        kept block are simply overwritten later; they are never indexed, because only computed
        positions are.) A contiguous reservation keeps its reserved blocks."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_for(max(num_tokens, self.reserve_tokens or 0))
        while len(table) > keep:
            self.pool.release(table.pop())

    def free(self, request_id: str) -> None:
        """Release every block the sequence holds, last block first: blocks near the end of a
        sequence are the least likely to be shared, so they become the first eviction candidates."""
        for block in reversed(self.tables.pop(request_id, [])):
            self.pool.release(block)
        self.hashes.pop(request_id, None)
        for block in reversed(self.cpu_tables.pop(request_id, [])):
            self.cpu_pool.release(block)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (parallel sampling, beam search)."""
        for block in self.tables[parent_id]:
            self.pool.share(block)
        self.tables[child_id] = list(self.tables[parent_id])
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, request_id: str) -> bool:
        return self.cpu_pool is not None and \
            len(self.tables.get(request_id, [])) <= self.cpu_pool.num_free

    def swap_out(self, request_id: str) -> None:
        table = self.tables.pop(request_id)
        cpu_table = [self.cpu_pool.allocate() for _ in table]
        self.ops.swap_out.extend(zip(table, cpu_table))
        for block in reversed(table):
            self.pool.release(block)
        self.cpu_tables[request_id] = cpu_table
        self.hashes.pop(request_id, None)

    def can_swap_in(self, request_id: str, num_total_tokens: int = 0) -> bool:
        """Room for the swapped blocks and for the tokens the sequence will add right after."""
        need = max(len(self.cpu_tables[request_id]), self.blocks_for(num_total_tokens))
        return need <= self.pool.num_available

    def swap_in(self, request_id: str) -> None:
        cpu_table = self.cpu_tables.pop(request_id)
        table = [self.pool.allocate() for _ in cpu_table]
        self.ops.swap_in.extend(zip(cpu_table, table))
        for block in cpu_table:
            self.cpu_pool.release(block)
        self.tables[request_id] = table

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held = [b for t in self.tables.values() for b in t]
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_counts[b] == held.count(b), f"block {b} ref count"
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants()
            cpu_held = [b for t in self.cpu_tables.values() for b in t]
            assert sorted(cpu_held) == sorted(set(cpu_held))
            assert self.cpu_pool.num_used == len(cpu_held)
        if self.tiers is not None:
            self.tiers.check_invariants(self.pool.hash_to_block)
