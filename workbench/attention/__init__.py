"""Attention: the metadata handed down each forward pass and the backends that consume it."""
from workbench.attention.backends import get_attention_backend
from workbench.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_attention_backend"]
