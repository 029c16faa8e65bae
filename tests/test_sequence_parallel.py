"""Sequence parallelism in real worker processes on gloo: greedy tokens equal plain tensor
parallelism and one process (tiny model and SmolLM2, odd token counts, chunked prefill mixed with
decodes), the token reduce-scatter and all-gather equal an all-reduce, and the byte counters
equal the hand-computed sizes."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workbench import LLM, SamplingParams
from workbench.config import EngineConfig
from workbench.parallel.comm import Comm
from workbench.parallel.sequence import TokenSplit

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
# Odd lengths; with max_num_batched_tokens=37 the long prompt is chunked next to decodes.
PROMPTS = [[1, 5, 9, 200, 3000], [7, 8, 9], list(range(100, 161)), [42] * 21]


def make(folder, **kw):
    kw = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 37, **kw}
    return LLM(model=str(folder), dtype="float32", device="cpu", verbose=False, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def chosen_logprobs(outs):
    return [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in outs]


def test_sequence_parallel_needs_tensor_parallelism():
    with pytest.raises(ValueError, match=r"sequence_parallel=True .*tensor_parallel_size=1"):
        EngineConfig(device="cpu", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel='yes' is invalid: allowed are True"):
        EngineConfig(device="cpu", tensor_parallel_size=2, sequence_parallel="yes")


# ---------------------------------------------------------------------- the collectives
def _check_collectives(comm: Comm, rank: int) -> None:
    size, split = comm.size, TokenSplit(comm)
    for tokens in (1, 2, 5, 7, 63):
        torch.manual_seed(1000 * tokens + rank)        # a different partial sum on every rank
        # Integer values: every summation order gives the same floats, whatever the size.
        partial = torch.randint(-50, 50, (tokens, 24)).float() / 4
        want = partial.clone()
        dist.all_reduce(want, group=comm.group)
        split.tokens = tokens
        mine = split.scatter(partial)
        local = -(-tokens // size)
        assert mine.shape == (local, 24)
        padded = torch.cat([want, want.new_zeros(local * size - tokens, 24)])
        assert torch.equal(mine, padded[rank * local:(rank + 1) * local])
        assert torch.equal(split.gather(mine), want)
        sent, row = comm.take_sent(), 24 * 4
        ring = (size - 1) * tokens * row // size
        assert sent["reduce_scatter"] == ((size - 1) * local * row, ring)
        assert sent["all_gather_tokens"] == ((size - 1) * local * row, ring)
    if size == 2:                                      # random floats: a + b == b + a exactly
        torch.manual_seed(rank)
        partial = torch.randn(9, 16)
        want = partial.clone()
        dist.all_reduce(want, group=comm.group)
        split.tokens = 9
        assert torch.equal(split.gather(split.scatter(partial)), want)


def _collectives_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        _check_collectives(Comm(dist.group.WORLD, [0, 1, 2]), rank)
        pair = dist.new_group([0, 1])                  # every rank creates every group
        if rank < 2:
            _check_collectives(Comm(pair, [0, 1]), rank)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_token_reduce_scatter_and_all_gather_equal_all_reduce():
    # Three ranks, then two of them; a failed assertion in any rank raises here (mp.spawn
    # re-raises it with its traceback).
    mp.spawn(_collectives_worker, args=(_free_port(),), nprocs=3)


# ---------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny_runs(tiny_folder):
    """One process, plain tp=2 and tp=2 with sequence parallelism, on the same workload."""
    runs = {}
    with make(tiny_folder) as llm:
        runs["single"] = llm.generate(PROMPTS, GREEDY)
    with make(tiny_folder, tensor_parallel_size=2) as llm:
        runs["tp2"] = llm.generate(PROMPTS, GREEDY)
        runs["tp2 trace"] = list(llm.trace)
    with make(tiny_folder, tensor_parallel_size=2, sequence_parallel=True) as llm:
        runs["sp"] = llm.generate(PROMPTS, GREEDY)
        runs["sp trace"] = list(llm.trace)
        start = len(llm.trace)
        llm.generate([[11, 12, 13, 14, 15]], SamplingParams(temperature=0, max_tokens=2))
        runs["sp known"] = llm.trace[start:]
        runs["args"] = llm.engine.model_args
    return runs


def test_sequence_parallel_greedy_equals_plain_tensor_parallel(tiny_runs):
    assert tokens(tiny_runs["sp"]) == tokens(tiny_runs["tp2"]) == tokens(tiny_runs["single"])
    # two ranks: every sum is a + b in both layouts, so the logprobs are the same floats
    assert chosen_logprobs(tiny_runs["sp"]) == chosen_logprobs(tiny_runs["tp2"])
    steps = [(r.num_prefill_tokens, r.num_decode_tokens) for r in tiny_runs["sp trace"]]
    assert any(p and d and (p + d) % 2 for p, d in steps), steps   # a mixed step, odd T


def test_sequence_parallel_counters_equal_hand_computed_bytes(tiny_runs):
    args = tiny_runs["args"]
    row = args.hidden_size * 4                        # one token's hidden state in fp32
    calls = 2 * args.num_hidden_layers + 1            # after attention and MLP per layer, embedding
    prefill, decode = tiny_runs["sp known"]
    # prefill: T=5 tokens padded to 6, three rows per rank; decode: T=1 padded to 2, one row
    for record, tokens_, local in ((prefill, 5, 3), (decode, 1, 1)):
        assert record.num_tokens == tokens_
        assert record.comm["reduce_scatter"][:2] == (calls, calls * 2 * local * row)
        # the same count of all-gathers: before qkv and gate/up per layer, and before the LM head
        assert record.comm["all_gather_tokens"][:2] == (calls, calls * local * row)
        assert "all_reduce" not in record.comm
        # each rank sends the other its half of the padded rows; a ring sends half the T rows
        want = (calls * local * row, calls * tokens_ * row // 2)
        assert record.comm_sent["reduce_scatter"] == want
        assert record.comm_sent["all_gather_tokens"] == want
        assert record.residual_bytes == [2 * local * row]      # hidden states + residual slice
    # plain tp=2 on the same shapes: a ring all-reduce sends (2 (N-1)/N) T rows per call
    for record in tiny_runs["tp2 trace"]:
        t = record.num_tokens
        assert record.comm_sent["all_reduce"] == (calls * t * row, calls * t * row)
        assert record.residual_bytes == [2 * t * row]


def test_sequence_parallel_with_pipeline_stages(tiny_folder, tiny_runs):
    with make(tiny_folder, tensor_parallel_size=2, pipeline_parallel_size=2,
              sequence_parallel=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        want = [t[:3] for t in tokens(tiny_runs["single"])]
        assert tokens(llm.generate(PROMPTS, params)) == want
        r = llm.trace[0]
        local = -(-r.num_tokens // 2)
        # each stage boundary sends this rank's slices of the hidden states and residual
        assert r.comm["send"][:2] == (2, 2 * local * llm.engine.model_args.hidden_size * 4)


def test_sequence_parallel_on_smollm2_matches_one_process(smollm2_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
               "List three colors of the rainbow, separated by commas:"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    want = smollm2_llm.generate(prompts, params)
    # SmolLM2's 9 query and 3 KV heads split over 3 ranks; 23 tokens per step mixes a chunked
    # prompt with decodes and leaves odd, non-multiple-of-3 token counts.
    with LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
             max_model_len=256, max_num_seqs=4, max_num_batched_tokens=23,
             tensor_parallel_size=3, sequence_parallel=True) as llm:
        got = llm.generate(prompts, params)
        steps = [(r.num_prefill_tokens, r.num_decode_tokens) for r in llm.trace]
    assert tokens(got) == tokens(want)
    for g, w in zip(chosen_logprobs(got), chosen_logprobs(want)):
        assert g == pytest.approx(w, abs=1e-4)
    assert any(p and d and (p + d) % 3 for p, d in steps), steps
