"""Lab 11 (memory hierarchy): the KV cache's size per token for a published model, the tiers an
evicted block goes down and a prefix lookup comes up through, and the token slices of sequence
parallelism.

The references are the workbench's own: `memory_plan(...).kv_bytes_per_token`
(`workbench/plan/calculator.py`) over the bundled configs (`workbench/plan/configs/`), and for
SmolLM2 the engine's `kv_bytes_per_token` (`workbench/kv/paged_cache.py`), which sizes the pool;
the books of `KVTiers` (`workbench/kv/tiers.py`); and `TokenSplit`'s padding and slice size
(`workbench/parallel/sequence.py`). Each checker runs in well under a second.
"""
from __future__ import annotations

import json
import random

from workbench.course.labs.core import Mismatch, call, exercise, expect_close, expect_equal
from workbench.kv.paged_cache import kv_bytes_per_token as engine_kv_bytes
from workbench.kv.tiers import KVTiers
from workbench.models.llama import LlamaArgs
from workbench.parallel.sequence import TokenSplit
from workbench.plan import memory_plan
from workbench.plan.architecture import CONFIGS

CHAPTER = "11_memory_hierarchy"


def _configs() -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(CONFIGS.glob("*.json"))]


def _kv_mistake(cfg: dict, kv_bytes: int, got) -> str:
    """The hint for a typical wrong count, or '' when none matches."""
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if cfg.get("kv_lora_rank"):
        per_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * kv_bytes
        if got == 2 * per_layer * layers:
            return ("MLA caches one latent per token and layer, used for both keys and values: "
                    "no factor 2 for K and V.")
        if got == 2 * layers * kv_heads * head_dim * kv_bytes or got == 2 * layers * heads * (
                cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) * kv_bytes:
            return ("with MLA (kv_lora_rank > 0) the cache holds the compressed latent "
                    "(kv_lora_rank values) plus the shared rotary key (qk_rope_head_dim values) per "
                    "layer, not per-head keys and values.")
        return ""
    full = 2 * layers * kv_heads * head_dim * kv_bytes
    if kv_heads != heads and got == full // kv_heads * heads:
        return ("grouped-query attention: only num_key_value_heads heads have keys and values; "
                f"the {heads} query heads share them ({heads // kv_heads} per KV head).")
    if got == full // 2:
        return "K and V are two tensors: count both."
    if got == full // layers:
        return "every layer has its own K and V: multiply by num_hidden_layers."
    if got == full // kv_bytes:
        return "that counts elements: multiply by the bytes of one element (kv_bytes)."
    return ""


@exercise("memory.kv_bytes_per_token", CHAPTER, "kv_bytes_per_token",
          "KV cache bytes per token of a model, from its config.json",
          hint="per layer a token stores a key and a value for each KV head: 2 x "
               "num_key_value_heads x head_dim elements (head_dim defaults to hidden_size // "
               "num_attention_heads, and num_key_value_heads to num_attention_heads). With MLA "
               "(kv_lora_rank > 0) it stores kv_lora_rank + qk_rope_head_dim elements instead. "
               "Multiply by the layers and the bytes of one element.")
def check_kv_bytes_per_token(kv_bytes_per_token) -> None:

    kv_names = {1: "fp8", 2: "bf16", 4: "fp32"}
    # Dense attention first, MLA last: a mistake meets the case its hint speaks of.
    for cfg in sorted(_configs(), key=lambda c: bool(c.get("kv_lora_rank"))):
        for kv_bytes in (4, 2, 1):   # fp32 first: a missing factor 2 and missing bytes differ
            expected = memory_plan(cfg["name"], kv_cache_dtype=kv_names[kv_bytes]).kv_bytes_per_token
            what = f"kv_bytes_per_token(<{cfg['name']} config>, kv_bytes={kv_bytes})"
            got = call(kv_bytes_per_token, what, dict(cfg), kv_bytes)
            if got != expected:
                expect_equal(got, expected, what, _kv_mistake(cfg, kv_bytes, got))
    # The engine sizes its own pool with the same formula (SmolLM2 in bf16: 30 layers x 3 KV heads).
    import torch

    cfg = next(c for c in _configs() if c["name"] == "SmolLM2-135M")
    args = LlamaArgs.from_hf_config({**cfg, "model_type": "llama"})
    expected = engine_kv_bytes(args, torch.bfloat16)
    what = "kv_bytes_per_token(<SmolLM2-135M config>, kv_bytes=2), the engine's own pool"
    got = call(kv_bytes_per_token, what, dict(cfg), 2)
    expect_equal(got, expected, what, _kv_mistake(cfg, 2, got))


# ---------------------------------------------------------------------------- 2. KV tiers
def _tiers_after(spills: list[str], cpu_capacity: int, disk_capacity: int):
    """The engine's books (kv/tiers.py) after spilling these hashes: CPU and disk tiers, oldest
    first. One byte per block, so the disk's byte bound counts blocks."""
    tiers = KVTiers(cpu_capacity, disk_capacity, block_bytes=1)
    for i, h in enumerate(spills):
        tiers.spill(i, h)
    return list(tiers.cpu), list(tiers.disk)


def _spill_cases(rng: random.Random):
    cases = [(["a", "b", "c"], 2, 2), (["a", "b", "c", "d", "e"], 2, 2), (["a", "b"], 0, 1),
             (["a", "b", "c"], 1, 0), (["a", "b", "c", "d"], 0, 0)]
    for _ in range(25):
        n = rng.randint(1, 12)
        cases.append(([f"h{i}" for i in rng.sample(range(40), n)], rng.randint(0, 4),
                      rng.randint(0, 4)))
    return cases


@exercise("memory.spill", CHAPTER, "spill",
          "an evicted block goes down the tiers: CPU first, the CPU's oldest to disk",
          hint="append the hash to cpu if it has room; if cpu is full, move cpu's oldest (cpu[0]) "
               "to the end of disk first; before anything enters a full disk, delete disk's oldest "
               "(disk[0]). A tier of capacity 0 takes nothing: with no CPU tier the block goes "
               "straight to disk, and with no disk tier what leaves the CPU is dropped.")
def check_spill(spill) -> None:
    for spills, cpu_cap, disk_cap in _spill_cases(random.Random(5)):
        cpu, disk = [], []
        what = (f"spilling {spills} one after the other (cpu_capacity={cpu_cap}, "
                f"disk_capacity={disk_cap})")
        for h in spills:
            call(spill, what, h, cpu, disk, cpu_cap, disk_cap)
        expected = _tiers_after(spills, cpu_cap, disk_cap)
        if (cpu, disk) == (list(expected[0]), list(expected[1])):
            continue
        hint = ""
        if len(cpu) > cpu_cap or len(disk) > disk_cap:
            hint = "a tier never holds more than its capacity: make room before adding."
        elif cpu_cap and spills[-1] not in cpu:
            hint = ("the block just evicted is the most recent: it goes into the CPU tier, and "
                    "what moves down to disk is the CPU tier's oldest entry.")
        elif cpu and expected[0] and cpu[::-1] == expected[0]:
            hint = "keep each tier oldest first: append the newest at the end, evict from the front."
        elif set(disk) != set(expected[1]) and set(cpu) == set(expected[0]):
            hint = ("what leaves a full CPU tier is its oldest entry, and it goes to disk; the disk "
                    "deletes its own oldest entry when it is full.")
        expect_equal((cpu, disk), expected, what + ": (cpu, disk) afterwards, oldest first", hint)


def _reference_lookup(hashes, device, cpu, disk):
    tiers = KVTiers(len(cpu), len(disk), block_bytes=1)
    tiers.cpu.update((h, i) for i, h in enumerate(cpu))
    tiers.disk.update((h, 1) for h in disk)
    found = []
    for h in hashes:
        where = "device" if h in device else tiers.lookup(h)
        if where is None:
            break
        found.append(where)
    return found


@exercise("memory.lookup", CHAPTER, "lookup",
          "where each block of a prompt's prefix is found, down the tiers",
          hint="walk the prompt's chained block hashes in order; each one is on the device, in "
               "the CPU tier or on disk (look in that order), and the first hash found nowhere "
               "ends the prefix: a later block's hash chains over this one's, so nothing after a "
               "miss can be reused.")
def check_lookup(lookup) -> None:
    rng = random.Random(11)
    cases = [(["a", "b", "c"], {"a"}, ["b"], ["c"]), (["a", "b", "c"], set(), ["a"], ["c"]),
             (["a", "b"], {"b"}, [], ["a"]), (["a", "b", "c"], set(), [], [])]
    for _ in range(25):
        hashes = [f"h{i}" for i in range(rng.randint(1, 8))]
        places = {h: rng.choice(["device", "cpu", "disk", "cpu", "disk", None]) for h in hashes}
        device = {h for h, p in places.items() if p == "device"}
        cases.append((hashes, device, [h for h, p in places.items() if p == "cpu"],
                      [h for h, p in places.items() if p == "disk"]))
    for hashes, device, cpu, disk in cases:
        what = f"lookup({hashes}, device={sorted(device)}, cpu={cpu}, disk={disk})"
        got = call(lookup, what, list(hashes), set(device), list(cpu), list(disk))
        expected = _reference_lookup(hashes, device, cpu, disk)
        if got == expected:
            continue
        hint = ""
        if isinstance(got, list) and len(got) > len(expected):
            hint = ("stop at the first hash found nowhere: the hashes are chained, so a block "
                    "after a miss never matches a cached one.")
        elif isinstance(got, list) and len(got) == len(expected):
            hint = "name the place each block is found: 'device', 'cpu' or 'disk'."
        expect_equal(got, expected, what, hint)


# ---------------------------------------------------------------------------- 3. sequence parallel
class _Size:
    def __init__(self, size: int):
        self.size = size


def _token_split(num_tokens: int, tp: int):
    split = TokenSplit(_Size(tp))
    split.tokens = num_tokens
    return split


@exercise("memory.reduce_scatter", CHAPTER, "reduce_scatter",
          "each rank's slice of the summed partials, tokens padded to a multiple of the ranks",
          hint="sum the ranks' (T, H) partial outputs, pad the sum with zero rows to T_pad = "
               "ceil(T / N) * N, and give rank r rows r * T_pad / N up to (r + 1) * T_pad / N.")
def check_reduce_scatter(reduce_scatter) -> None:
    import torch
    gen = torch.Generator().manual_seed(2)
    for tokens, tp, hidden in [(6, 2, 3), (5, 2, 4), (7, 3, 2), (1, 2, 3), (2, 4, 2), (9, 3, 5)]:
        partials = [torch.randint(-9, 9, (tokens, hidden), generator=gen).float() for _ in range(tp)]
        split = _token_split(tokens, tp)
        total = torch.nn.functional.pad(sum(partials), (0, 0, 0, split.padded - tokens))
        expected = list(total.split(split.local))
        what = f"reduce_scatter(<{tp} partials of shape ({tokens}, {hidden})>, num_tokens={tokens})"
        got = call(reduce_scatter, what, [p.clone() for p in partials], tokens)
        if not isinstance(got, (list, tuple)) or len(got) != tp:
            raise Mismatch(f"{what}: return a list of {tp} slices, one per rank; got {got!r}")
        for r, (g, e) in enumerate(zip(got, expected)):
            hint = ""
            if tuple(torch.as_tensor(g).shape) != tuple(e.shape):
                hint = (f"every rank holds T_pad / N = {split.local} rows: pad {tokens} tokens to "
                        f"{split.padded} first, so that the slices are equal.")
            expect_close(g, e, f"{what}: rank {r}'s slice", 0.0, hint)


@exercise("memory.all_gather", CHAPTER, "all_gather",
          "the ranks' slices back into the step's T rows",
          hint="concatenate the slices in rank order (T_pad rows) and cut the padding off the "
               "end: attention and the LM head see exactly the step's T tokens.")
def check_all_gather(all_gather) -> None:
    import torch
    gen = torch.Generator().manual_seed(3)
    for tokens, tp, hidden in [(6, 2, 3), (5, 2, 4), (7, 3, 2), (1, 2, 3), (2, 4, 2)]:
        split = _token_split(tokens, tp)
        full = torch.randint(-9, 9, (split.padded, hidden), generator=gen).float()
        full[tokens:] = 0
        slices = list(full.split(split.local))
        what = f"all_gather(<{tp} slices of shape ({split.local}, {hidden})>, num_tokens={tokens})"
        got = call(all_gather, what, [s.clone() for s in slices], tokens)
        hint = ""
        if tuple(torch.as_tensor(got).shape) == (split.padded, hidden) and split.padded != tokens:
            hint = f"cut the padding: the result has the step's {tokens} rows, not {split.padded}."
        expect_close(got, full[:tokens], what, 0.0, hint)
