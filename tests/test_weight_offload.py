"""Weight offload: which layers go, their bytes in the slow tier, the ring of resident buffers
under random call sequences, and the engine's tokens with offloaded layers equal to the resident
engine's (tiny models, and the real SmolLM2 with most layers on disk)."""
from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from torch import nn

from workbench import LLM, SamplingParams
from workbench.config import EngineConfig, plan_kernels
from workbench.offload import (CpuTier, DiskTier, LayerLayout, WeightOffload,
                               choose_offloaded_layers)
from workbench.offload.weights import ALIGN

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# ------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("kwargs, message", [
    ({"cpu_offload_gb": -1}, "cpu_offload_gb=-1 is invalid: it must be a number of GiB >= 0"),
    ({"cpu_offload_gb": "2"}, "cpu_offload_gb='2' is invalid"),
    ({"cpu_offload_gb": True}, "cpu_offload_gb=True is invalid"),
    ({"cpu_offload_gb": float("nan")}, "cpu_offload_gb=nan is invalid"),
    ({"weight_offload": "gpu"}, "weight_offload='gpu' is invalid: allowed values are auto, cpu, "
                                "disk"),
    ({"offload_dir": 3}, "offload_dir=3 is invalid: it must be a directory path"),
    ({"offload_keep_page_cache": "yes"}, "offload_keep_page_cache='yes' is invalid"),
    ({"cpu_offload_gb": 1, "compile": True}, "cpu_offload_gb=1 is invalid here: the compiled "
                                             "forward"),
    ({"cpu_offload_gb": 1, "fused_decode": True}, "cpu_offload_gb=1 is invalid here: the fused "
                                                  "step reads every layer"),
    ({"cpu_offload_gb": 1, "quantization": "int8"}, "quantization='int8' keeps packed codes"),
    ({"cpu_offload_gb": 1, "speculative_config": {"method": "ngram",
                                                  "num_speculative_tokens": 2}},
     "cpu_offload_gb=1 is invalid here: a quantized_self drafter copies the model"),
    ({"cpu_offload_gb": 1, "pruning": "magnitude",
      "pruning_config": {"sparsity": 0.5, "pattern": "2:4", "semi_structured": True}},
     "set pruning_config['semi_structured']=False"),
    ({"cpu_offload_gb": 1, "cuda_graphs": True}, "cuda_graphs=True is invalid here"),
    ({"cpu_offload_gb": 1, "tensor_parallel_size": 2}, "the parallel workers load their own"),
])
def test_bad_settings_name_the_field_the_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        EngineConfig(device="cpu", **kwargs)


def test_auto_tier_and_the_fused_step_turned_off_with_a_reason():
    c = EngineConfig(device="cpu", cpu_offload_gb=0.5)
    k = plan_kernels(c)
    assert (k.offload_tier, c.offload_config.enabled) == ("disk", True)
    assert not k.fused_decode and "weight offload" in k.reasons["fused_decode"]
    cpu = EngineConfig(device="cpu", cpu_offload_gb=0.5, weight_offload="cpu")
    assert plan_kernels(cpu).offload_tier == "cpu"
    assert not EngineConfig(device="cpu").offload_config.enabled


# ---------------------------------------------------------------------------- choosing layers
def test_layers_are_chosen_from_the_last_backwards_until_the_budget_is_reached():
    sizes = [10, 20, 30, 40]
    assert choose_offloaded_layers(sizes, 0) == []
    assert choose_offloaded_layers(sizes, 1) == [3]
    assert choose_offloaded_layers(sizes, 40) == [3]
    assert choose_offloaded_layers(sizes, 41) == [2, 3]
    assert choose_offloaded_layers(sizes, 70) == [2, 3]
    assert choose_offloaded_layers(sizes, 71) == [1, 2, 3]
    assert choose_offloaded_layers(sizes, 10**9) == [0, 1, 2, 3]


def test_a_layout_packs_mixed_dtypes_at_aligned_offsets():
    layer = nn.Module()
    layer.a = nn.Parameter(torch.randn(3, 5))                          # 60 bytes
    layer.b = nn.Parameter(torch.randn(7).to(torch.bfloat16))          # 14 bytes
    layer.c = nn.Parameter(torch.randn(2, 2, 3))                       # 48 bytes
    lay = LayerLayout.of(4, layer)
    assert [(off, n) for _, off, n in lay.params] == [(0, 60), (64, 14), (128, 48)]
    assert (lay.weight_bytes, lay.span) == (122, 192)
    flat = lay.pack()
    assert len(lay.views(flat)) == len(lay.params) == 3
    for (p, _, _), v in zip(lay.params, lay.views(flat)):
        assert v.dtype == p.dtype and torch.equal(v, p.detach())


# -------------------------------------------------------------- the ring under random sequences
class Block(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(width, width + seed % 3 * 8)             # layers of unequal size
        self.proj.weight.data = torch.randn(self.proj.weight.shape, generator=g)
        self.back = nn.Linear(width + seed % 3 * 8, width, bias=False)
        self.gain = nn.Parameter(torch.randn(width, generator=g).to(torch.bfloat16))

    def forward(self, x):
        return self.back(torch.tanh(self.proj(x))) * self.gain.float()


class Toy(nn.Module):
    def __init__(self, n: int = 6, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(Block(width, i) for i in range(n))


def make_tier(kind: str, tmp_path):
    return DiskTier(str(tmp_path)) if kind == "disk" else CpuTier(pin=False)


def check_ring(off: WeightOffload, reads: list[int]) -> None:
    """Between layer calls: no buffer in use, offloaded parameters empty, each buffer's bytes
    those of the layer it holds, and the bytes counted those of the reads the tier served."""
    p = off.prefetcher
    for slot in range(len(p.buffers)):
        p._settle(slot)
    assert not any(p.in_use)
    held = [i for i in p.layer if i is not None]
    assert len(held) == len(set(held))
    for slot, index in enumerate(p.layer):
        if index is not None:
            lay = off.layouts[index]
            assert torch.equal(p.buffers[slot][:lay.span], off.tier_bytes[index])
    for index in off.layers:
        assert all(param.numel() == 0 for param, _, _ in off.layouts[index].params)
    assert p.loads == len(reads)
    assert p.bytes_moved == sum(off.layouts[i].span for i in reads)


# the disk tier once (each trial writes and fsyncs its files), the ring's sizes on the CPU tier
@pytest.mark.parametrize("kind, slots", [("cpu", 1), ("cpu", 2), ("cpu", 3), ("disk", 2)])
def test_random_layer_calls_give_the_resident_outputs(kind, slots, tmp_path):
    rng = random.Random(slots)
    for trial in range(4):
        model = Toy()
        reference = copy.deepcopy(model)
        sizes = [sum(p.numel() * p.element_size() for p in l.parameters()) for l in model.layers]
        budget = rng.randrange(1, sum(sizes) + 1)
        tier = make_tier(kind, tmp_path / f"{trial}")
        reads: list[int] = []
        read_into = tier.read_into
        tier.read_into = lambda i, dest: (reads.append(i), read_into(i, dest))
        off = WeightOffload(model, tier, budget, torch.device("cpu"), slots=slots)
        assert off.layers == choose_offloaded_layers(sizes, budget)
        off.tier_bytes = {}
        for i in off.layers:                     # what the tier holds, read back once, unlogged
            off.tier_bytes[i] = torch.empty(off.layouts[i].span, dtype=torch.uint8)
            read_into(i, off.tier_bytes[i])
        with torch.inference_mode():
            for _ in range(30):
                x = torch.randn(3, 16)
                if rng.random() < 0.5:           # a forward that may exit early
                    n = rng.randrange(len(model.layers) + 1)
                    order = list(range(n))
                else:                            # any layer, in any order
                    order = [rng.randrange(len(model.layers)) for _ in range(3)]
                for i in order:
                    assert torch.equal(model.layers[i](x), reference.layers[i](x))
                check_ring(off, reads)
        off.close()


def test_in_order_passes_are_all_prefetched(tmp_path):
    """Full forward passes: after the first layer of the first pass, every load was started by
    the layer before (cyclically: the last one starts the next pass's first), one per layer."""
    model, width = Toy(n=8), 16
    sizes = [sum(p.numel() * p.element_size() for p in l.parameters()) for l in model.layers]
    off = WeightOffload(model, DiskTier(str(tmp_path)), sum(sizes[3:]), torch.device("cpu"))
    assert off.layers == [3, 4, 5, 6, 7]
    x = torch.randn(2, width)
    with torch.inference_mode():
        for p in range(4):
            loads = off.prefetcher.loads
            h = x
            for layer in model.layers:
                h = layer(h)
            assert off.prefetcher.sync_loads == 1              # only the very first layer
            assert off.prefetcher.loads - loads == 5 + (p == 0)
    assert off.prefetcher.bytes_moved == off.offloaded_bytes * 4 + off.layouts[3].span
    off.close()


# --------------------------------------------------------------------------------- disk tier
def test_disk_files_have_the_layers_bytes_and_the_page_cache_is_dropped(tmp_path, monkeypatch):
    model = Toy()
    off = WeightOffload(model, DiskTier(str(tmp_path / "w")), 10**9, torch.device("cpu"))
    files = sorted((tmp_path / "w").iterdir())
    assert [f.name for f in files] == [f"layer_{i:03d}.bin" for i in range(6)]
    assert [f.stat().st_size for f in files] == [off.layouts[i].span for i in range(6)]
    assert all(lay.span - lay.weight_bytes < ALIGN * len(lay.params)
               for lay in off.layouts.values())
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, a, b, advice: (calls.append(advice),
                                                                       real(fd, a, b, advice)))
    buf = torch.empty(off.layouts[0].span, dtype=torch.uint8)
    off.tier.read_into(0, buf)
    assert calls == [os.POSIX_FADV_DONTNEED]
    off.tier.keep_page_cache = True
    off.tier.read_into(0, buf)
    assert calls == [os.POSIX_FADV_DONTNEED]               # kept: no second drop
    off.close()
    assert list((tmp_path / "w").iterdir()) == []           # its files, not the directory


def test_a_temporary_directory_is_removed_on_close():
    tier = DiskTier()
    tier.store(0, torch.arange(100, dtype=torch.uint8))
    folder = tier.directory
    assert (folder / "layer_000.bin").stat().st_size == 100
    tier.close()
    assert not folder.exists()


# ------------------------------------------------------------------------------------ engine
def engine_pair(folder, **offload):
    common = dict(dtype="float32", device="cpu", verbose=False, max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=24)
    return LLM(model=str(folder), **common), LLM(model=str(folder), **common, **offload)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_tiny_engine_with_every_layer_offloaded_gives_the_same_tokens(tiny_folder, tier):
    resident, offloaded = engine_pair(tiny_folder, cpu_offload_gb=1, weight_offload=tier)
    off = offloaded.engine.offload
    assert off.layers == [0, 1] and off.tier.name == tier
    # a 40-token prompt is chunked (24 tokens a step) and shares steps with decodes
    prompts = [list(range(3, 43)), [5, 6, 7], [9, 8, 7, 6, 5, 4]]
    want = [o.outputs[0].token_ids for o in resident.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in offloaded.generate(prompts, GREEDY)]
    assert got == want
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in offloaded.trace)
    stats = offloaded.stats()
    assert stats["offloaded_layers"] == [0, 1] and stats["offload_tier"] == tier
    # each step loads both layers; the last one also starts the next step's first: one extra
    # load in all, and only the very first load was not prefetched
    steps = len(offloaded.trace)
    assert stats["offload_bytes_moved"] == steps * off.offloaded_bytes + off.layouts[0].span
    assert (stats["offload_loads"], stats["offload_sync_loads"]) == (2 * steps + 1, 1)
    assert "weight offload: layers 0-1" in offloaded.describe()
    folder = getattr(off.tier, "directory", None)
    offloaded.close()
    assert folder is None or not folder.exists()
    resident.close()


def test_smollm2_with_most_layers_on_disk_matches_the_resident_engine(smollm2_llm, tmp_path):
    """The key check: SmolLM2-135M with 19 of its 30 layers read from disk every step (page
    cache dropped) gives the resident engine's greedy tokens, prefill and decode."""
    llm = LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
              max_model_len=512, max_num_seqs=8, cpu_offload_gb=0.25,
              offload_dir=str(tmp_path))
    off = llm.engine.offload
    assert off.layers == list(range(11, 30))       # 14.2 MB fp32 layers: 19 reach 0.25 GiB
    for i in off.layers:                           # the bytes are on disk, not in the layer
        assert (tmp_path / f"layer_{i:03d}.bin").stat().st_size == off.layouts[i].span
        assert all(p.numel() == 0 for p in llm.engine.model.layers[i].parameters())
    resident_layer = llm.engine.model.layers[0]
    assert sum(p.numel() for p in resident_layer.parameters()) == \
        sum(p.numel() for p in smollm2_llm.engine.model.layers[0].parameters())
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    # one decode step moves every offloaded layer's bytes once, all of them prefetched
    engine = llm.engine
    engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=4))
    engine.step()                                  # the prefill
    before = off.stats()
    engine.step()
    assert engine.trace[-1].num_prefill_tokens == 0
    after = off.stats()
    assert after["offload_bytes_moved"] - before["offload_bytes_moved"] == off.offloaded_bytes
    assert after["offload_sync_loads"] == before["offload_sync_loads"]
    llm.close()
    assert list(tmp_path.iterdir()) == []
