"""The paged KV cache: `BlockPool` (blocks, reference counts, prefix index), `BlockManager`
(block tables, prefix reuse, copy-on-write, swapping) and `PagedKVCache` (the tensors)."""
from workbench.kv.block_manager import BlockManager, BlockOps, chain_hash
from workbench.kv.block_pool import BlockPool
from workbench.kv.paged_cache import PagedKVCache

__all__ = ["BlockManager", "BlockOps", "BlockPool", "PagedKVCache", "chain_hash"]
