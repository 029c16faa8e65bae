"""The runtime layers models and attention are built from: linear layers and their weight formats
(linear.py, formats.py), KV cache row formats (kv_formats.py), RMSNorm (norm.py), rotary embedding
(rotary.py) and the per-token operations the attention backend carries (ops.py: torch or Triton)."""
