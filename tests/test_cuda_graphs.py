"""CUDA graphs for decode steps (workbench/models/cuda_graphs.py).

The recording needs a GPU; everything around it does not. With capture=False each "replay" runs
the forward eagerly on the same static, padded buffers and the same fixed metadata, through the
Triton kernels (in the interpreter on CPU). So on CPU these tests pin: which captured size a batch
pads to, that padding rows write only into the scratch block, that no sequence is ever given that
block, that rows left behind by a larger step are reset, and that the tokens are the engine's
tokens without graphs. With CUDA the same engine records real graphs and must agree too.
"""
from __future__ import annotations

import os

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.config import EngineConfig
from workbench.models.cuda_graphs import PADDING_OWNER, GraphedDecodeForward, graph_batch_sizes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # capture=False runs on either
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")

# Six requests of different lengths: the decode batch shrinks 6 -> 1 as they finish, so the
# steps pad to 8, then 4, 2 and 1.
MAX_TOKENS = [3, 5, 7, 9, 11, 14]
PROMPTS = ["The quick brown fox", "1 2 3", "Hello", "Once upon a time there was",
           "a b c d e f", "Paged attention reads blocks"]


def make_llm(folder, device=DEVICE, **kw):
    return LLM(model=str(folder), dtype="float32", device=device, verbose=False,
               attention_backend="triton", block_size=4, max_model_len=64, max_num_seqs=8,
               max_num_batched_tokens=64, record_block_tables=True, **kw)


def params():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def graphed(llm) -> GraphedDecodeForward:
    """Put a capture=False GraphedDecodeForward in front of the engine's forward."""
    e = llm.engine
    g = GraphedDecodeForward(e.runner.forward_fn, e.cache, e.blocks, e.backend,
                             max_num_seqs=e.config.max_num_seqs,
                             max_model_len=e.plan.max_model_len, capture=False)
    e.runner.forward_fn = g
    return g


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@needs_triton
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_padded_replays_give_the_unpadded_tokens(tiny_folder, kv):
    ref = make_llm(tiny_folder, kv_cache_dtype=kv).generate(PROMPTS, params())
    llm = make_llm(tiny_folder, kv_cache_dtype=kv)
    g = graphed(llm)
    out = llm.generate(PROMPTS, params())
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    steps = llm.engine.trace
    decode_only = [s for s in steps if s.num_decode_tokens and not s.num_prefill_tokens]
    # Every decode-only step replayed, at the smallest captured size that holds its batch.
    assert sum(g.replays.values()) == len(decode_only)
    expected = {}
    for s in decode_only:
        size = next(c for c in g.sizes if c >= s.num_seqs)
        expected[size] = expected.get(size, 0) + 1
    assert dict(g.replays) == expected
    assert {8, 4, 2, 1} <= set(expected), expected


@needs_triton
def test_padding_writes_only_the_scratch_block(tiny_folder):
    llm = make_llm(tiny_folder)
    g = graphed(llm)
    e = llm.engine
    bs = e.cache.block_size
    scratch = set(range(g.scratch_slot, g.scratch_slot + bs))
    checked = []

    def forward(input_ids, positions, kv_caches, meta, backend, num_layers=None):
        for k, v in kv_caches:      # a value no padding row computes, to see its write land
            k[g.scratch_slot:g.scratch_slot + bs] = 1e4
            v[g.scratch_slot:g.scratch_slot + bs] = 1e4
        before = [(k.clone(), v.clone()) for k, v in kv_caches]
        out = g(input_ids, positions, kv_caches, meta, backend, num_layers)
        if g.takes(meta, kv_caches):
            real = set(meta.slot_mapping.tolist())
            size = next(c for c in g.sizes if c >= meta.num_seqs)
            for (k0, v0), (k1, v1) in zip(before, kv_caches):
                changed = ((k0 != k1) | (v0 != v1)).flatten(1).any(1).nonzero().flatten().tolist()
                assert set(changed) <= real | scratch, "a padding row wrote outside its block"
                assert real <= set(changed)
                if size > meta.num_seqs:
                    assert set(changed) & scratch, "padding rows should write the scratch slot"
            # What the graph read: rows past the batch are padding again.
            n = meta.num_seqs
            assert (g.slot_mapping[n:size] == g.scratch_slot).all()
            assert (g.seq_lens[n:size] == 1).all()
            assert (g.block_tables[n:size, 0] == g.scratch_block).all()
            checked.append((n, size))
        return out

    e.runner.forward_fn = forward
    llm.generate(PROMPTS, params())
    assert any(size > n for n, size in checked) and any(size == n for n, size in checked)
    # The scratch block is held by the padding entry alone, never by a sequence.
    assert e.blocks.tables[PADDING_OWNER] == [g.scratch_block]
    for s in e.trace:
        for rid, table in s.block_tables.items():
            assert rid == PADDING_OWNER or g.scratch_block not in table
    e.blocks.check_invariants()


def test_config_names_what_graphs_need():
    with pytest.raises(ValueError, match=r"cuda_graphs=True is invalid here: .*device is 'cpu'"):
        EngineConfig(model="random:tiny", device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs='yes' is invalid: allowed are True, False"):
        EngineConfig(model="random:tiny", device="cpu", cuda_graphs="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="recording CUDA graphs needs a GPU")
def test_recorded_graphs_give_the_eager_tokens(tiny_folder):
    ref = make_llm(tiny_folder, device="cuda").generate(PROMPTS, params())
    llm = make_llm(tiny_folder, device="cuda", cuda_graphs=True)
    g = llm.engine.runner.forward_fn
    assert isinstance(g, GraphedDecodeForward) and all(gr is not None for gr, _, _ in
                                                        g.graphs.values())
    assert "CUDA graphs for batch sizes 1-8" in llm.describe()
    out = llm.generate(PROMPTS, params())
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert {8, 4, 2, 1} <= set(g.replays)
