"""Sampling: from logits rows to tokens. The sampler (sampler.py: temperature, min-p, top-k, top-p,
seeds, logprobs), the logits processors it applies first (logits_processors.py), grammar masks for
structured outputs (grammar.py, xgrammar) and the verification of drafted tokens (rejection.py).
The engine and speculative decoding both use them."""
