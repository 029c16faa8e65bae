"""Model compression beyond quantization: pruning by masks (pruning.py) and structured pruning
that removes layers or MLP channels (structured.py)."""
