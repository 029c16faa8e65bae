"""Measurement harnesses the chapters and benchmarks share, outside the runtime packages: what
compression costs in quality (quality.py), mixed-precision search (mixed_search.py), KV compression
and cross-layer sharing (kv_compression.py, cla_distill.py), KV tiers against recomputing
(kv_tiers.py), weight offload's cost model (offload_cost.py), tensor against sequence parallelism
(sequence_parallel.py), and a GGUF inspector (gguf_inspect.py)."""
