"""Speculative decoding inside the continuous-batching engine.

- Greedy output with speculation is token-identical to greedy output without it, for every
  drafter, with prefix caching on, several requests batched, mixed per-request k (including 0).
- The paged cache gives back the blocks of rejected drafts: the allocator's invariants hold after
  every step of random adds, aborts and steps under preemption (recompute and swap), and the pool is
  empty at the end.
- The metrics add up: per-request acceptance counts equal the step records'.
"""
import pytest
from hypothesis import given, settings, strategies as st

from workbench import LLM, SamplingParams

from random_ops import drive, operations

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
    "List the planets of the solar system:",
    "Hello",
]
DRAFTERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "draft_num_layers": 10},
    "quantized_self": {"method": "quantized_self", "num_speculative_tokens": 3,
                       "draft_quantization": "int4",
                       "draft_quantization_config": {"group_size": 32}},
    # A draft with the target's tokenizer but random weights: acceptance near 0, output unchanged.
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, "model": "random:tiny"},
}


def greedy(n=16):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    return [o.outputs[0].token_ids for o in smollm2_llm.generate(PROMPTS, greedy())]


def build(spec, **kw):
    # fp32: batch-invariant enough on CPU that verifying k + 1 tokens in one pass and decoding
    # them one at a time pick the same argmax (in bf16 a near-tie can flip; that is numerics, not
    # the algorithm).
    return LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
               max_model_len=512, max_num_seqs=8, enable_prefix_caching=True,
               speculative_config=spec, **kw)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculation_is_token_identical(name, reference):
    llm = build(DRAFTERS[name])
    # Per-request k: the third request opts out, the fourth asks for a different k.
    params = [greedy(), greedy(),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             num_speculative_tokens=0),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             num_speculative_tokens=1)]
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = [o.metrics for o in outs]
    print(f"\n{name}: acceptance {[r.acceptance_rate for r in m]}, "
          f"mean accepted length {[r.mean_accepted_length for r in m]}")
    assert m[2].num_draft_tokens == 0                       # opted out
    assert m[0].num_draft_tokens > 0 and m[3].num_draft_tokens > 0
    assert len(m[3].accepted_per_position) == 1             # k = 1 for that request
    if name in ("ngram", "quantized_self"):
        assert sum(r.num_accepted_tokens for r in m) > 0    # these drafters do guess right
    # The step records tell the same story as the per-request metrics.
    drafted = sum(r.num_draft_tokens for r in llm.trace)
    assert drafted == sum(r.num_draft_tokens for r in m)
    assert sum(r.num_accepted_tokens for r in llm.trace) == sum(r.num_accepted_tokens for r in m)
    assert llm.engine.blocks.pool.num_used == 0
    stats = llm.stats()
    assert stats["spec_draft_tokens"] == drafted and stats["spec_method"] == name
    k = DRAFTERS[name]["num_speculative_tokens"]
    assert 1 <= len(stats["spec_accepted_per_position"]) <= k
    if name != "ngram":
        return
    # Prefix caching with speculation: the same prompts again hit the cache and agree again.
    again = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert llm.stats()["prefix_cache_hit_rate"] > 0


def test_sampled_requests_with_a_seed_are_reproducible_under_speculation(tiny_folder):
    spec = {"method": "quantized_self", "num_speculative_tokens": 3, "draft_quantization": "int8"}
    runs = []
    for _ in range(2):
        llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                  speculative_config=spec)
        params = SamplingParams(temperature=0.8, top_k=50, max_tokens=20, seed=7,
                                ignore_eos=True, logprobs=2)
        out = llm.generate(["a b c d", "e f g"], params)
        runs.append([o.outputs[0].token_ids for o in out])
        lps = out[0].outputs[0].logprobs
        assert len(lps) == 20 and all(tok in d for tok, d in zip(out[0].outputs[0].token_ids, lps))
        assert out[0].metrics.num_draft_tokens > 0
    assert runs[0] == runs[1]


@pytest.fixture(scope="module", params=["recompute", "swap"])
def tight(tiny_folder, request):
    """3 sequences share 12 blocks of 4 tokens and a budget of 8 tokens per step: lookahead,
    preemption and rollback all happen."""
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=64, max_num_seqs=3, block_size=4, num_kv_blocks=12,
               max_num_batched_tokens=8, enable_prefix_caching=True,
               preemption_mode=request.param,
               speculative_config={"method": "quantized_self", "num_speculative_tokens": 3,
                                   "draft_quantization": "int8"})


def add_speculating(engine, args):
    prompt_len, max_tokens, k, sampled = args
    params = SamplingParams(temperature=1.0 if sampled else 0, max_tokens=max_tokens,
                            ignore_eos=True, num_speculative_tokens=k, seed=k)
    return engine.add_request(list(range(1, prompt_len + 1)), params), max_tokens


def check_blocks(engine):
    engine.blocks.check_invariants()
    running = engine.scheduler.running
    assert set(engine.blocks.tables) == {s.request_id for s in running}
    for seq in running:   # no sequence holds a block past its tokens (+ next step's lookahead)
        assert len(engine.blocks.tables[seq.request_id]) <= engine.blocks.blocks_for(
            seq.num_tokens)


@settings(max_examples=20, deadline=None)
@given(ops=operations(st.tuples(st.integers(1, 16), st.integers(1, 14), st.integers(0, 3),
                                st.booleans())))
def test_no_block_leaks_under_random_operations(tight, ops):
    engine = tight.engine
    kept = drive(engine, ops, add_speculating, check_blocks)
    for rid, max_tokens in kept.items():
        assert 1 <= len(engine.pop_output(rid).outputs[0].token_ids) <= max_tokens
    for rid in list(engine._sequences):
        engine.pop_output(rid)
    assert engine.blocks.pool.num_used == 0
    assert engine.blocks.cpu_pool is None or engine.blocks.cpu_pool.num_used == 0
    assert not engine.drafter.computed


def test_bad_speculative_configs_are_named():
    cases = [({"method": "medusa", "num_speculative_tokens": 2}, r"\['method'\]='medusa'"),
             ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens.*=0"),
             ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"unknown key\(s\) \['k'\]"),
             ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
              "prompt_lookup_min"),
             ({"method": "draft_model", "num_speculative_tokens": 2}, r"\['model'\] is missing"),
             ({"method": "layer_skip", "num_speculative_tokens": 2, "draft_num_layers": 2},
              "the target has 2 layers")]
    for spec, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(model="random:tiny", verbose=False, speculative_config=spec)
    with pytest.raises(ValueError, match="num_speculative_tokens=-1 is invalid"):
        SamplingParams(num_speculative_tokens=-1)
