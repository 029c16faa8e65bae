"""Attention: the metadata handed down each forward pass and the backends that consume it."""
from .backends import get_attention_backend
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_attention_backend"]
