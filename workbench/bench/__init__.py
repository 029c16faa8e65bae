"""Benchmarks: named workloads, run side by side with their peers in one process.

`python -m workbench.bench single-stream` (or `./run bench`). See docs/performance.md.
"""
from workbench.bench.bandwidth import copy_bandwidth, decode_bytes_per_token

__all__ = ["copy_bandwidth", "decode_bytes_per_token"]
