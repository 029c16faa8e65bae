"""When does loading a KV prefix beat recomputing it? The next turn's TTFT, three ways.

For each context length, a conversation's context is prefilled, pushed out of the pool by an
unrelated prompt that fills it, and then continued by a short next turn. The next turn's time to
first token is measured with the context recomputed (prefix caching, no tiers), loaded from the
CPU tier, and loaded from the disk tier (files dropped from the page cache after writing unless
drop_page_cache=False). Recomputing costs prefill time per token; loading costs block moves,
each a fixed cost per call plus bytes over the tier's bandwidth. Fresh prefills at several lengths
and the tiers' block moves are timed too, so that kv_tier_model.py predicts every TTFT from them.

    python -m workbench.experiments.kv_tiers 256 512 1024
"""
from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

from workbench.experiments.kv_tier_model import Move, TierModel, fit_move, fit_prefill
from workbench.kv.tier_store import TierStore
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


def _timed(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], params)
    return time.perf_counter() - t0


def measure_tier_moves(kv_caches: list, block_size: int, disk_dir: str | None = None,
                       drop_page_cache: bool = True, blocks: int = 8, repeats: int = 3) -> dict:
    """Seconds that TierStore takes to spill and load blocks shaped like `kv_caches`' (an engine's
    cache), for the CPU and the disk tier: one block per call, spill then load, as a turn
    interleaves them (median), and `blocks` blocks per call (median); with the fixed cost per call
    and the bandwidth fitted from the two (kv_tier_model.fit_move). The blocks live in a scratch copy,
    never in the engine's own cache."""
    scratch = [tuple(torch.zeros((2 * blocks * block_size,) + t.shape[1:], dtype=t.dtype,
                                 device=t.device) for t in pair) for pair in kv_caches]
    if disk_dir is not None:
        os.makedirs(disk_dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="kv-moves-", dir=disk_dir)
    store = TierStore(scratch, block_size, scratch[0][0].device, blocks, directory, drop_page_cache)
    block_bytes = store.cpu[0].numel() * store.cpu.element_size()
    hashes = [os.urandom(32) for _ in range(blocks)]
    ops = {"cpu": {"spill": lambda i: ("spill", i, i), "load": lambda i: ("load", i, blocks + i)},
           "disk": {"spill": lambda i: ("spill_disk", i, hashes[i]),
                    "load": lambda i: ("load_disk", hashes[i], blocks + i)}}

    def timed(batch: list) -> float:
        t0 = time.perf_counter()
        store.apply(batch, scratch)
        if store.device.type == "cuda":         # the copies are asynchronous there
            torch.cuda.synchronize(store.device)
        return time.perf_counter() - t0

    single = {(tier, kind): [] for tier in ops for kind in ops[tier]}
    group = {key: [] for key in single}
    try:
        for r in range(repeats + 1):
            warm_up = r == 0                         # first calls allocate: not timed
            for tier, op in ops.items():
                for i in range(blocks):
                    for kind in ("spill", "load"):
                        seconds = timed([op[kind](i)])
                        if not warm_up:
                            single[tier, kind].append(seconds)
                for kind in ("spill", "load"):
                    seconds = timed([op[kind](i) for i in range(blocks)])
                    if not warm_up:
                        group[tier, kind].append(seconds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {"block_bytes": block_bytes, "blocks": blocks}
    for (tier, kind), times in single.items():
        one_s, group_s = statistics.median(times), statistics.median(group[tier, kind])
        move = fit_move(one_s, group_s, blocks, block_bytes)
        result.setdefault(tier, {})[kind] = {"one_block_s": one_s, "group_s": group_s,
                                             "fixed_s": move.fixed_s, "bandwidth": move.bandwidth}
    return result


def measure_tier_ttft(context_lengths, model: str = "smollm2-135m", block_size: int = 16,
                      turn_tokens: int = 16, disk_dir: str | None = None,
                      drop_page_cache: bool = True, repeats: int = 3, seed: int = 0,
                      **engine_kwargs) -> dict:
    """TTFT (seconds, median of `repeats` conversations) of the next turn after each context
    length, recomputed and loaded from the CPU and the disk tier, with the tier hits that prove
    the loads happened and the blocks each turn loaded and spilled; the KV bytes per token; and
    what tier_model needs to predict them: fresh prefills timed at several lengths
    (`prefill_samples`, (tokens, seconds)) and the tiers' block moves (`moves`, from
    measure_tier_moves). `disk_dir`: where the disk tier's directories are made (None: the
    system's temporary directory)."""
    lengths = sorted(context_lengths)
    max_len = -(-(lengths[-1] + turn_tokens + 2) // block_size) * block_size
    pool_blocks = max_len // block_size      # the filler's blocks take all of it
    rng = random.Random(seed)
    vocab = range(100, 20000)

    def tokens(n: int) -> list[int]:           # fresh each time: nothing of it is cached anywhere
        return [rng.choice(vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0)
    runs = {n: {mode: [] for mode in MODES} for n in lengths}
    rows = {n: {"context_tokens": n} for n in lengths}
    prefill, moves, bytes_per_token, dirs = [], None, 0, []
    for mode in MODES:                       # recompute first: it tells the block's bytes
        llm = _engine(mode, model, pool_blocks, block_size, max_len, bytes_per_token * block_size,
                      disk_dir, drop_page_cache, engine_kwargs)
        if llm.engine.config.kv_disk_tier_path:
            dirs.append(llm.engine.config.kv_disk_tier_path)
        llm.generate([tokens(max_len // 2)], one)                          # warm-up
        for _ in range(repeats):
            for n in lengths:
                context, filler = tokens(n), tokens(max_len - 1)
                context_s = _timed(llm, context, one)
                filler_s = _timed(llm, filler, one)                          # pushes the context out
                if mode == "recompute":      # fresh prefills: no tier moves anything in this engine
                    prefill += [(n, context_s), (max_len - 1, filler_s),
                                (turn_tokens, _timed(llm, tokens(turn_tokens), one))]
                before = llm.stats()
                runs[n][mode].append(_timed(llm, context + tokens(turn_tokens), one))
                after = llm.stats()
                if mode != "recompute":
                    moved = {k: after[k] - before[k] for k in after if k.startswith("kv_")}
                    hits, block_bytes = moved[f"kv_{mode}_tier_hits"], bytes_per_token * block_size
                    row = rows[n]
                    row[f"{mode}_hit_tokens"] = min(row.get(f"{mode}_hit_tokens", hits), hits)
                    row[f"{mode}_loaded_blocks"] = moved[f"kv_bytes_{mode}_to_device"] // block_bytes
                    row[f"{mode}_spilled_blocks"] = moved[f"kv_bytes_device_to_{mode}"] // block_bytes
        bytes_per_token = llm.engine.cache.bytes_per_token
        if mode == "recompute":
            moves = measure_tier_moves(llm.engine.cache.kv_caches, block_size, disk_dir,
                                       drop_page_cache)
        del llm
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    for n in lengths:
        for mode in MODES:
            rows[n][f"{mode}_s"] = statistics.median(runs[n][mode])
        rows[n]["prefill_s_per_token"] = rows[n]["recompute_s"] / (n + turn_tokens)
    return {"rows": [rows[n] for n in lengths], "kv_bytes_per_token": bytes_per_token,
            "drop_page_cache": drop_page_cache, "block_size": block_size,
            "turn_tokens": turn_tokens, "repeats": repeats, "prefill_samples": prefill,
            "moves": moves}


def tier_model(result: dict):
    """The cost model (kv_tier_model.TierModel) with the prefill and the moves that `result`
    (measure_tier_ttft's) measured."""
    moves = {tier: {kind: Move(m["fixed_s"], m["bandwidth"]) for kind, m in result["moves"][tier].items()}
             for tier in ("cpu", "disk")}
    return TierModel(fit_prefill(result["prefill_samples"]), moves, result["block_size"],
                     result["kv_bytes_per_token"] * result["block_size"], result["turn_tokens"])


def main(argv: list[str]) -> None:
    result = measure_tier_ttft([int(a) for a in argv] or [256, 512])
    print(f"KV bytes per token: {result['kv_bytes_per_token']}; disk files dropped from the "
          f"page cache: {result['drop_page_cache']}")
    model = tier_model(result)
    p = model.prefill
    print(f"prefill: {1e3 * p.a:.1f} ms + {1e3 * p.b:.3f} ms/token + {1e6 * p.c:.4f} us/token^2")
    for tier in ("cpu", "disk"):
        m = result["moves"][tier]
        print(f"{tier:>4} tier: load {m['load']['bandwidth'] / 1e9:.2f} GB/s + {1e6 * m['load']['fixed_s']:.0f} us "
              f"per call, spill {m['spill']['bandwidth'] / 1e9:.2f} GB/s + {1e6 * m['spill']['fixed_s']:.0f} us; "
              f"{1e3 * model.block_s(tier):.2f} ms per block; loading wins above "
              f"{model.crossover(tier):.0f} tokens")
    print("context  recompute ms (model)  cpu ms (model)  disk ms (model)  cpu_hits  disk_hits")
    for r in result["rows"]:
        n = r["context_tokens"]
        cpu, disk = (model.load_s(t, n, r[f"{t}_loaded_blocks"], r[f"{t}_spilled_blocks"])
                     for t in ("cpu", "disk"))
        print(f"{n:7d}  {1e3 * r['recompute_s']:8.1f} ({1e3 * model.recompute_s(n):7.1f})  "
              f"{1e3 * r['cpu_s']:6.1f} ({1e3 * cpu:6.1f})  {1e3 * r['disk_s']:6.1f} ({1e3 * disk:6.1f})  "
              f"{r['cpu_hit_tokens']:8d}  {r['disk_hit_tokens']:9d}")


if __name__ == "__main__":
    main(sys.argv[1:])
