"""When does loading a KV prefix beat recomputing it? The next turn's TTFT, three ways.

For each context length, a conversation's context is prefilled, pushed out of the pool by an
unrelated prompt that fills it, and then continued by a short next turn. The next turn's time to
first token is measured with the context recomputed (prefix caching, no tiers), loaded from the
CPU tier, and loaded from the disk tier (files dropped from the page cache after writing unless
drop_page_cache=False). Recomputing costs prefill time per token; loading costs bytes per token
over the tier's bandwidth.

    python -m workbench.experiments.kv_tiers 256 512 1024
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time

from workbench.llm import LLM
from workbench.sampling_params import SamplingParams

MODES = ("recompute", "cpu", "disk")


def _engine(mode: str, model: str, pool_blocks: int, block_size: int, max_model_len: int,
            block_bytes: int, disk_dir: str, drop_page_cache: bool, engine_kwargs: dict) -> LLM:
    kw = dict(model=model, verbose=False, block_size=block_size, num_kv_blocks=pool_blocks,
              max_model_len=max_model_len, enable_prefix_caching=True, **engine_kwargs)
    if mode == "cpu":
        kw["kv_cpu_tier_bytes"] = 2 * pool_blocks * block_bytes
    elif mode == "disk":
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
        kw.update(kv_disk_tier_bytes=4 * pool_blocks * block_bytes,
                  kv_disk_tier_path=tempfile.mkdtemp(prefix="kv-tier-", dir=disk_dir))
    llm = LLM(**kw)
    if llm.engine.cache.tier_store is not None:
        llm.engine.cache.tier_store.drop_page_cache = drop_page_cache
    return llm


def measure_tier_ttft(context_lengths, model: str = "smollm2-135m", block_size: int = 16,
                      turn_tokens: int = 16, disk_dir: str | None = None,
                      drop_page_cache: bool = True, seed: int = 0, **engine_kwargs) -> dict:
    """TTFT (seconds) of the next turn after each context length, recomputed and loaded from the
    CPU and the disk tier, with the tier hits that prove the loads happened, the prefill
    seconds per token of the recomputation, and the KV bytes per token. `disk_dir`: where the
    disk tier's directory is made (None: the system's temporary directory)."""
    lengths = sorted(context_lengths)
    max_len = -(-(lengths[-1] + turn_tokens + 2) // block_size) * block_size
    pool_blocks = max_len // block_size      # the filler's blocks take all of it
    rng = random.Random(seed)
    vocab = range(100, 20000)
    contexts = {n: [rng.choice(vocab) for _ in range(n)] for n in lengths}
    turns = {n: [rng.choice(vocab) for _ in range(turn_tokens)] for n in lengths}
    fillers = {n: [rng.choice(vocab) for _ in range(max_len - 1)] for n in lengths}
    one = SamplingParams(max_tokens=1, temperature=0)
    rows = {n: {"context_tokens": n} for n in lengths}
    bytes_per_token, dirs = 0, []
    for mode in MODES:                       # recompute first: it tells the block's bytes
        llm = _engine(mode, model, pool_blocks, block_size, max_len, bytes_per_token * block_size,
                      disk_dir, drop_page_cache, engine_kwargs)
        if llm.engine.config.kv_disk_tier_path:
            dirs.append(llm.engine.config.kv_disk_tier_path)
        llm.generate([[rng.choice(vocab) for _ in range(max_len // 2)]], one)   # warm-up
        for n in lengths:
            llm.generate([contexts[n]], one)
            llm.generate([fillers[n]], one)                      # pushes the context out
            before = llm.stats()
            t0 = time.perf_counter()
            llm.generate([contexts[n] + turns[n]], one)
            rows[n][f"{mode}_s"] = time.perf_counter() - t0
            after = llm.stats()
            if mode != "recompute":
                key = f"kv_{mode}_tier_hits"
                rows[n][f"{mode}_hit_tokens"] = after[key] - before[key]
            else:
                rows[n]["prefill_s_per_token"] = rows[n]["recompute_s"] / (n + turn_tokens)
        bytes_per_token = llm.engine.cache.bytes_per_token
        del llm
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return {"rows": [rows[n] for n in lengths], "kv_bytes_per_token": bytes_per_token,
            "drop_page_cache": drop_page_cache}


def main(argv: list[str]) -> None:
    result = measure_tier_ttft([int(a) for a in argv] or [256, 512])
    print(f"KV bytes per token: {result['kv_bytes_per_token']}; disk files dropped from the "
          f"page cache: {result['drop_page_cache']}")
    print("context  recompute_s  cpu_s  disk_s  prefill_ms/token  cpu_hits  disk_hits")
    for r in result["rows"]:
        print(f"{r['context_tokens']:7d}  {r['recompute_s']:11.3f}  {r['cpu_s']:5.3f}  "
              f"{r['disk_s']:6.3f}  {1000 * r['prefill_s_per_token']:16.2f}  "
              f"{r['cpu_hit_tokens']:8d}  {r['disk_hit_tokens']:9d}")


if __name__ == "__main__":
    main(sys.argv[1:])
