"""Parallel sampling (n, best_of): the prompt is prefilled once and the samples fork its blocks.
Exact block ids and counts against n separate requests, seeded samples equal to separate seeded
requests (so fork and copy-on-write change nothing but memory), best_of's ranking, aborts and
preemption leaving no block held."""
import pytest

from workbench import LLM, SamplingParams

PROMPT = list(range(5, 45))          # 40 tokens: blocks of 16 hold it in 2 full blocks + 8


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=128, max_num_seqs=8, block_size=16, record_block_tables=True)


def sampled(n, **kw):
    return SamplingParams(n=n, max_tokens=10, ignore_eos=True, **kw)


def test_samples_share_the_prompt_blocks_and_copy_only_the_last(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, sampled(4, seed=3))
    members = [f"{rid}#{i}" for i in (1, 2, 3)]
    engine.step()                                    # prefill, fork, 4 first tokens
    tables = engine.blocks.tables
    assert [tables[m] for m in members] == [tables[rid]] * 3 and len(tables[rid]) == 3
    assert engine.blocks.pool.num_used == 3
    assert [engine.blocks.pool.ref_counts[b] for b in tables[rid]] == [4, 4, 4]
    engine.step()                                    # each writes token 41 into block 2
    full = tables[rid][:2]
    assert all(tables[m][:2] == full for m in members)
    lasts = {tables[m][2] for m in [rid] + members}
    assert len(lasts) == 4                           # three copies, one writer kept the original
    assert engine.blocks.pool.num_used == 3 + 3
    assert engine.trace[-1].blocks_copied == 3
    engine.blocks.check_invariants()
    while not engine.is_request_finished(rid):
        engine.step()
    out = engine.pop_output(rid)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 10 for o in out.outputs) and out.finished
    assert engine.blocks.pool.num_used == 0


def test_kv_blocks_against_separate_requests(llm):
    """Peak blocks held: 4 samples of one prompt against 4 requests for the same prompt."""
    engine = llm.engine

    def peak(requests):
        ids = [engine.add_request(PROMPT, p) for p in requests]
        top = 0
        while not all(engine.is_request_finished(r) for r in ids):
            engine.step()
            top = max(top, engine.blocks.pool.num_used)
        for r in ids:
            engine.pop_output(r)
        return top

    shared = peak([sampled(4, seed=0)])
    separate = peak([sampled(1, seed=i) for i in range(4)])
    # Between steps a sequence holds at most 48 computed tokens (the step that feeds token 49
    # also finishes it and frees its blocks): 3 blocks each, of which the 2 full ones are shared.
    assert (shared, separate) == (2 + 4 * 1, 4 * 3)


def test_seeded_samples_equal_separate_seeded_requests(llm):
    together = llm.generate(PROMPT, sampled(4, seed=11))[0]
    alone = [llm.generate(PROMPT, sampled(1, seed=11 + i))[0].outputs[0] for i in range(4)]
    assert [o.token_ids for o in together.outputs] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in alone}) == 4


def test_best_of_keeps_the_n_highest_cumulative_logprobs(llm):
    everyone = llm.generate(PROMPT, sampled(5, seed=2, logprobs=0))[0].outputs
    best = llm.generate(PROMPT, sampled(2, best_of=5, seed=2))[0].outputs
    ranked = sorted(everyone, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    assert [o.index for o in best] == [0, 1]
    assert best[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob)


def test_preemption_and_aborts_leave_no_block_held(tiny_folder):
    small = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                max_model_len=128, max_num_seqs=8, block_size=16, num_kv_blocks=12)
    roomy = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                max_model_len=128, max_num_seqs=8, block_size=16)
    params = [SamplingParams(n=3, seed=s, max_tokens=40, ignore_eos=True) for s in (1, 2)]
    prompts = [PROMPT, PROMPT[::-1]]
    tight = small.generate(prompts, params)
    assert sum(r.num_preempted for r in small.engine.trace) > 0
    loose = roomy.generate(prompts, params)
    assert [len(o.outputs) for o in tight] == [len(o.outputs) for o in loose] == [3, 3]
    for a, b in zip(tight, loose):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert small.engine.blocks.pool.num_used == 0
    engine = small.engine
    rid = engine.add_request(PROMPT, params[0])
    engine.step()
    engine.step()
    engine.abort_request(rid)
    assert engine.blocks.pool.num_used == 0 and not engine.has_unfinished_requests()
    engine.blocks.check_invariants()


def test_fan_out_limits_name_the_field(llm):
    with pytest.raises(ValueError, match=r"^n=9 is invalid: .* max_num_seqs=8"):
        llm.generate(PROMPT, SamplingParams(n=9))
    with pytest.raises(ValueError, match=r"^best_of=9 is invalid"):
        llm.generate(PROMPT, SamplingParams(n=2, best_of=9))
    with pytest.raises(ValueError, match=r"invalid for stream\(\)"):
        next(llm.stream(PROMPT, SamplingParams(n=2)))
    assert llm.engine.blocks.pool.num_used == 0
