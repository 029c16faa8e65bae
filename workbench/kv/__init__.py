"""KV cache storage. `ContiguousKVCache` reserves a full context per sequence (the naive layout that
the paged cache improves on)."""
from .contiguous_cache import ContiguousKVCache

__all__ = ["ContiguousKVCache"]
