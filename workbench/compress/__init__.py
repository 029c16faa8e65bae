"""Model compression beyond quantization: pruning (pruning.py)."""
