"""The tiered KV cache (kv/tiers.py, tier_store.py, disk_tier.py): exact spill, demotion and load
ops and CPU slots for hand-written sequences; books and files consistent after every operation of
random request sequences, with the tokens of the resident engine; SmolLM2's greedy tokens with
spills and loads equal to the plain engine's; a disk tier reused by a new engine, and refused under
another manifest."""
import json
import logging
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from random_ops import drive
from workbench import LLM, SamplingParams
from workbench.kv import disk_tier
from workbench.kv.block_manager import BlockManager, chain_hash
from workbench.kv.tier_store import TierStore
from workbench.kv.tiers import KVTiers, TierHit


def test_cpu_tier_spills_lru_to_disk_and_disk_evicts_its_oldest_file():
    t = KVTiers(num_cpu_blocks=1, disk_bytes=20, block_bytes=10)
    for block, h in ((5, b"h1"), (6, b"h2"), (7, b"h3"), (8, b"h4")):
        t.spill(block, h)
    assert t.take_ops() == [("spill", 5, 0),
                            ("demote", 0, b"h1"), ("spill", 6, 0),
                            ("demote", 0, b"h2"), ("spill", 7, 0),
                            ("delete", b"h1"), ("demote", 0, b"h3"), ("spill", 8, 0)]
    assert list(t.cpu.items()) == [(b"h4", 0)] and list(t.disk) == [b"h2", b"h3"]
    assert t.lookup(b"h1") is None and t.lookup(b"h2") == "disk" and t.lookup(b"h4") == "cpu"
    assert t.claim(b"h2") == "disk"
    t.spill(9, b"h5")           # the claimed file is not evicted: h3 (unclaimed) goes instead
    t.load(b"h2", 11)
    t.discard(b"h5")            # computed again on the device: a CPU copy is dropped, no op ...
    t.discard(b"h4")            # ... a disk copy is deleted
    assert t.take_ops() == [("delete", b"h3"), ("demote", 0, b"h4"), ("spill", 9, 0),
                            ("load_disk", b"h2", 11), ("delete", b"h4")]
    assert not t.cpu and not t.disk and t.disk_bytes == 0
    t.check_invariants([b"h2", b"h4", b"h5"])
    assert t.bytes_moved["disk_to_device"] == 10


def fake_cache(num_blocks, block_size, layers=2):
    """K/V tensors whose every block holds values that name it (block id * 100 + layer)."""
    caches = []
    for layer in range(layers):
        k = torch.arange(num_blocks).repeat_interleave(block_size).float()[:, None, None] * 100
        caches.append(((k + layer).expand(-1, 1, 3).clone(), (-k - layer).expand(-1, 1, 3).clone()))
    return caches


def block_values(caches, block, block_size):
    return [(k[block * block_size].flatten()[0].item(), v[block * block_size].flatten()[0].item())
            for k, v in caches]


def test_exact_blocks_spilled_and_loaded_for_a_returning_prefix(tmp_path):
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    bm.attach_tiers(KVTiers(num_cpu_blocks=2, disk_bytes=0, block_bytes=10))
    caches = fake_cache(4, 4)
    store = TierStore(caches, 4, torch.device("cpu"), num_cpu_blocks=2, disk_dir=None)
    a = list(range(100, 109))                        # 2 full blocks + 1 token
    bm.allocate("a", 0, 9)
    bm.index_full_blocks("a", a, 9)
    assert bm.tables["a"] == [0, 1, 2]
    bm.free("a")                                     # cached, LRU order: block 1, then block 0
    original = {b: block_values(caches, b, 4) for b in (0, 1)}
    bm.allocate("b", 0, 13)                          # 4 blocks: free 2, 3, then evicts 1 and 0
    assert bm.tables["b"] == [2, 3, 1, 0]
    ops = bm.take_ops()
    assert ops.tier == [("spill", 1, 0), ("spill", 0, 1)]
    h0, h1 = chain_hash(None, a[:4]), chain_hash(chain_hash(None, a[:4]), a[4:8])
    assert dict(bm.tiers.cpu) == {h1: 0, h0: 1}
    store.apply(ops.tier, caches)
    for b in range(4):                               # b's prefill overwrites its blocks
        for k, v in caches:
            k[b * 4:(b + 1) * 4] = -7.0
    b_tokens = list(range(300, 313))
    bm.index_full_blocks("b", b_tokens, 13)
    bm.free("b")                                     # cached LRU: 1 (b's third block), 3, 2
    hits = bm.cached_prefix(a[:8] + [5, 6])
    assert hits == [TierHit(h0, "cpu"), TierHit(h1, "cpu")]
    assert bm.allocate("c", 8, 2, hits)
    # h0 loads into free block 0 (slot 1 freed); h1's block evicts block 1, which spills into the
    # slot just freed before h1 loads over it; the new token's block evicts block 3 into slot 0.
    assert bm.tables["c"] == [0, 1, 3]
    ops = bm.take_ops()
    assert ops.tier == [("load", 1, 0), ("spill", 1, 1), ("load", 0, 1), ("spill", 3, 0)]
    assert bm.tier_hits == {"cpu": 8, "disk": 0}
    store.apply(ops.tier, caches)
    assert block_values(caches, 0, 4) == original[0] and block_values(caches, 1, 4) == original[1]
    assert store.cpu[1, 0, 0, 0].flatten()[0].item() == -7.0      # b's block, spilled in time
    assert bm.pool.lookup(h0) == 0 and bm.pool.lookup(h1) == 1
    bm.check_invariants()


def test_disk_tier_reads_back_what_it_wrote_and_removes_files_it_loads(tmp_path):
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    bm.attach_tiers(KVTiers(num_cpu_blocks=0, disk_bytes=10**6, block_bytes=2 * 2 * 4 * 3 * 4))
    caches = fake_cache(2, 4)
    store = TierStore(caches, 4, torch.device("cpu"), num_cpu_blocks=0, disk_dir=tmp_path)
    a = list(range(9))
    bm.allocate("a", 0, 5)
    bm.index_full_blocks("a", a, 5)
    bm.free("a")
    original = block_values(caches, 0, 4)
    bm.allocate("b", 0, 8)                           # evicts block 0 straight to disk
    h0 = chain_hash(None, a[:4])
    ops = bm.take_ops()
    assert ops.tier == [("spill_disk", 0, h0)]
    store.apply(ops.tier, caches)
    assert (tmp_path / (h0.hex() + ".kv")).stat().st_size == bm.tiers.disk[h0]
    bm.free("b")
    caches[0][0].zero_()
    assert bm.allocate("c", 4, 1, bm.cached_prefix(a[:5])) and bm.tables["c"] == [1, 0]
    ops = bm.take_ops()
    assert ops.tier == [("load_disk", h0, 1)] and bm.tier_hits == {"cpu": 0, "disk": 4}
    store.apply(ops.tier, caches)
    assert block_values(caches, 1, 4) == original and not (tmp_path / (h0.hex() + ".kv")).exists()
    bm.check_invariants()


# ---------------------------------------------------------------------- engines
TINY = dict(dtype="float32", device="cpu", verbose=False, block_size=4, max_model_len=64,
            attention_backend="torch", cpu_gemv=False)   # no C++ build to load
BASES = [[random.Random(i).randrange(10, 500) for _ in range(12)] for i in range(3)]


def tiny_prompt(base: int, suffix: int) -> list[int]:
    return BASES[base] + [random.Random(100 * base + suffix).randrange(10, 500)
                          for _ in range(suffix)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_reference(tiny_folder):
    llm = LLM(model=str(tiny_folder), batch_invariant=True, **TINY)
    memo = {}

    def tokens(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = llm.generate([prompt], greedy(max_tokens))[0].outputs[0].token_ids
        return memo[key]
    return tokens


def check_books_and_files(engine) -> None:
    """The pool and tier invariants, and the disk as the books say: every indexed file exists,
    and a file not indexed is one whose deletion is recorded for the next step."""
    engine.blocks.check_invariants()
    tiers, path = engine.blocks.tiers, engine.cache.tier_store.disk_dir
    files = {bytes.fromhex(p.stem) for p in path.glob("*.kv")}
    assert set(tiers.disk) <= files
    assert files - set(tiers.disk) <= {op[1] for op in tiers.ops if op[0] == "delete"}


def test_invariants_and_tokens_under_random_operations(tiny_folder, tiny_reference,
                                                       tmp_path_factory):
    """Random adds, aborts and steps over a pool of 8 blocks, with tiers of 1 (CPU) and 5 (disk)
    blocks: after every operation the books and the files agree and each hash lives in one place;
    every request's tokens equal the resident engine's; over all examples both tiers served hits."""
    hits = {"cpu": 0, "disk": 0}
    add_args = st.tuples(st.integers(0, 2), st.integers(0, 12), st.integers(1, 6))
    ops_lists = st.lists(st.one_of(st.tuples(st.just("add"), add_args),
                                   st.tuples(st.just("abort"), st.integers(0, 30)),
                                   st.tuples(st.just("step"), st.integers(1, 3))),
                         min_size=10, max_size=30)

    @settings(max_examples=20, deadline=None, database=None, derandomize=True)
    @given(ops=ops_lists)
    def run(ops):
        llm = LLM(model=str(tiny_folder), batch_invariant=True, num_kv_blocks=8, max_num_seqs=2,
                  enable_prefix_caching=True, kv_cpu_tier_bytes=1 * 4 * 512,
                  kv_disk_tier_bytes=5 * 4 * 512,
                  kv_disk_tier_path=str(tmp_path_factory.mktemp("disk")), **TINY)
        assert llm.engine.cache.bytes_per_token == 512   # 2 layers x K,V x 2 heads x 16 x fp32
        engine = llm.engine

        def add(engine, args):
            prompt = tiny_prompt(args[0], args[1])
            return engine.add_request(prompt, greedy(args[2])), (prompt, args[2])

        done = drive(engine, ops, add, check_books_and_files)
        for rid, (prompt, max_tokens) in done.items():
            assert engine.pop_output(rid).outputs[0].token_ids == \
                tiny_reference(prompt, max_tokens)
        assert engine.blocks.pool.num_used == 0
        for tier in hits:
            hits[tier] += engine.blocks.tier_hits[tier]

    run()
    assert hits["cpu"] > 0 and hits["disk"] > 0, hits


def test_restart_reuses_the_disk_tier_and_a_mismatch_loads_nothing(tiny_folder, tmp_path, caplog):
    kw = dict(model=str(tiny_folder), num_kv_blocks=8, enable_prefix_caching=True,
              kv_disk_tier_bytes=10**6, kv_disk_tier_path=str(tmp_path), **TINY)
    prompt = tiny_prompt(0, 7)                       # 19 tokens: 4 full blocks
    first = LLM(**kw)
    expected = first.generate([prompt], greedy(4))[0].outputs[0].token_ids
    first.generate([tiny_prompt(1, 8), tiny_prompt(2, 8)], greedy(4))   # push it out to disk
    assert first.stats()["kv_disk_tier_blocks"] >= 4 and first.stats()["kv_disk_tier_hits"] == 0
    second = LLM(**kw)
    assert len(second.engine.blocks.tiers.disk) == first.stats()["kv_disk_tier_blocks"]
    assert second.generate([prompt], greedy(4))[0].outputs[0].token_ids == expected
    assert second.stats()["kv_disk_tier_hits"] == 16 and second.stats()["prefix_cache_hits"] == 16
    for change, field, old, new in (({"block_size": 8}, "block_size", "4", "8"),
                                    ({"dtype": "bfloat16"}, "dtype", "'float32'", "'bfloat16'")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="workbench.kv"):
            other = LLM(**{**kw, **change})
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and f"{field} is {old} in the stored manifest and {new} here" \
            in lines[0]
        assert not other.engine.blocks.tiers.disk and not list(tmp_path.glob("*.kv"))
        other.generate([prompt], greedy(4))
        assert other.stats()["kv_disk_tier_hits"] == 0
        kw.update(change)                             # the directory is now this engine's
    manifest = json.loads((tmp_path / disk_tier.MANIFEST).read_text())
    assert (manifest["block_size"], manifest["dtype"], manifest["head_dim"]) == (8, "bfloat16", 16)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cpu_tier_bytes=4096), "kv_cpu_tier_bytes=4096, kv_disk_tier_bytes=0 is invalid "
     "here: tiers keep evicted prefix-cache blocks, and enable_prefix_caching=False"),
    (dict(kv_cpu_tier_bytes=-1, enable_prefix_caching=True),
     "kv_cpu_tier_bytes=-1 is invalid: it must be an integer >= 0"),
    (dict(kv_disk_tier_bytes=4096, enable_prefix_caching=True),
     "kv_disk_tier_path=None is invalid with kv_disk_tier_bytes=4096"),
    (dict(kv_disk_tier_path="/tmp/x", enable_prefix_caching=True),
     "kv_disk_tier_path='/tmp/x' is set but kv_disk_tier_bytes is 0"),
    (dict(kv_cpu_tier_bytes=100, enable_prefix_caching=True),
     "kv_cpu_tier_bytes=100 is invalid: one block of 4 tokens needs 2048 bytes"),
    (dict(kv_cpu_tier_bytes=4096, enable_prefix_caching=True, kv_cache_dtype="auto:0,int8:1"),
     "kv_cache_dtype='auto:0,int8:1' gives layers different row formats"),
])
def test_bad_tier_arguments_are_refused_naming_the_field(tiny_folder, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LLM(model=str(tiny_folder), **TINY, **kwargs)


TURNS = ["The library opens at nine on weekdays and at ten on Saturdays. It keeps old maps of the "
         "harbour, letters from the shipyard and a small room of books about the river. Children "
         "come on Wednesdays to hear stories read aloud. Question:",
         "A train leaves the northern station every twenty minutes and stops at five towns before "
         "it reaches the coast, where the line ends at a hotel above the beach. In winter it runs "
         "only every hour, and on holidays the last train leaves before dark. Question:"]
FOLLOW_UP = " When does it open, and what does it keep? Answer:"


def test_smollm2_tokens_with_spills_and_loads_equal_the_plain_engine(tmp_path):
    """Two conversations of two turns each, over a pool of 80 tokens: each conversation pushes
    the other's blocks down the tiers (block 0 stays, the next spills to the CPU tier, the one
    after it on to disk), and the next turn loads them back."""
    kw = dict(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
              max_model_len=256, attention_backend="torch", cpu_gemv=False)
    plain = LLM(**kw)
    tiered = LLM(**kw, num_kv_blocks=5, enable_prefix_caching=True,
                 kv_cpu_tier_bytes=1 * 16 * plain.engine.cache.bytes_per_token,
                 kv_disk_tier_bytes=10**8, kv_disk_tier_path=str(tmp_path))
    tok = plain.engine.tokenizer
    convs = [tok.encode(t) for t in TURNS]
    assert [len(c) // 16 for c in convs] == [3, 3]
    for follow_up in (None, FOLLOW_UP):
        for i, conv in enumerate(convs):
            if follow_up is not None:
                conv = convs[i] = conv + tok.encode(follow_up)
            expected = plain.generate([conv], greedy(4))[0].outputs[0].token_ids
            assert tiered.generate([conv], greedy(4))[0].outputs[0].token_ids == expected
            tiered.engine.blocks.check_invariants()
            convs[i] = conv + list(expected)
    stats = tiered.stats()
    assert stats["kv_cpu_tier_hits"] > 0 and stats["kv_disk_tier_hits"] > 0
    assert stats["kv_bytes_cpu_to_disk"] > 0 and stats["kv_bytes_disk_to_device"] > 0


def test_kv_tiers_experiment_loads_every_context_block_from_each_tier(tiny_folder, tmp_path):
    from workbench.experiments.kv_tiers import measure_tier_ttft, tier_model
    result = measure_tier_ttft([20, 40], model=str(tiny_folder), block_size=4, turn_tokens=4,
                               disk_dir=str(tmp_path), dtype="float32", device="cpu",
                               attention_backend="torch", cpu_gemv=False)
    assert result["kv_bytes_per_token"] == 512 and not list(tmp_path.iterdir())
    assert len(result["rows"]) == 2
    for row, n in zip(result["rows"], (20, 40)):
        assert row["context_tokens"] == n and row["cpu_hit_tokens"] == row["disk_hit_tokens"] == n
        assert min(row["recompute_s"], row["cpu_s"], row["disk_s"]) > 0
        assert row["prefill_s_per_token"] == row["recompute_s"] / (n + 4)
        # the pool is full of the filler's blocks: each loaded block evicts (spills) one
        for tier in ("cpu", "disk"):
            assert row[f"{tier}_loaded_blocks"] == n // 4
            assert n // 4 <= row[f"{tier}_spilled_blocks"] <= n // 4 + 2, row
    lengths = sorted({m for m, _ in result["prefill_samples"]})
    assert lengths == [4, 20, 40, 47] and len(result["prefill_samples"]) == 3 * 2 * 3
    model = tier_model(result)               # every term fitted from what was measured
    assert model.block_bytes == 4 * 512 and result["moves"]["block_bytes"] == 4 * 512
    for tier in ("cpu", "disk"):
        for kind in ("load", "spill"):
            m = result["moves"][tier][kind]
            assert m["fixed_s"] + 4 * 512 / m["bandwidth"] == pytest.approx(m["one_block_s"])
        assert model.load_s(tier, 40) > model.prefill.seconds(4, cached=40) > 0
