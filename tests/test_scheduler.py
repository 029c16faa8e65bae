"""Continuous batching, step by step: who runs when, which blocks each sequence holds, and
invariants under random sequences of adds, aborts and steps (on the real tiny engine)."""
import pytest
from hypothesis import given, settings, strategies as st

from workbench import LLM, SamplingParams

from random_ops import drive, operations


@pytest.fixture(scope="module")
def llm2(tiny_folder):
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=64, max_num_seqs=2, block_size=4, num_kv_blocks=16)


@pytest.fixture(scope="module", params=["recompute", "swap"])
def tight(tiny_folder, request):
    """3 sequences of up to 32 tokens share 10 blocks of 4 (40 slots): preemption is frequent."""
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=64, max_num_seqs=3, block_size=4, num_kv_blocks=10,
               max_num_batched_tokens=8, enable_prefix_caching=True,
               preemption_mode=request.param)


def params(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_requests_join_the_step_after_a_slot_frees(llm2):
    engine = llm2.engine
    start = len(engine.trace)
    a = engine.add_request([1, 2, 3], params(2))
    b = engine.add_request([1, 2, 3, 4], params(5))
    c = engine.add_request([5, 6], params(3))
    d = engine.add_request([7, 8, 9, 10, 11], params(1))
    tables = []
    while engine.has_unfinished_requests():
        engine.step()
        tables.append({r: list(t) for r, t in engine.blocks.tables.items()})
    steps = [(r.num_seqs, r.num_prefill_tokens, r.num_decode_tokens, r.num_waiting,
              r.num_finished) for r in engine.trace[start:]]
    assert steps == [
        (2, 7, 0, 2, 0),   # A and B prefill together; C and D wait (max_num_seqs=2)
        (2, 0, 2, 2, 1),   # both decode; A reaches max_tokens=2 and frees its block
        (2, 2, 1, 1, 0),   # C joins at once, its prefill mixed with B's decode
        (2, 0, 2, 1, 0),
        (2, 0, 2, 1, 2),   # B and C finish in the same step
        (1, 5, 0, 0, 1),   # D prefills and is done after its single token
    ]
    # Blocks of 4 tokens, taken on demand: B's 5th token takes a second block (2) in step 1.
    assert tables == [{a: [0], b: [1]}, {b: [1, 2]}, {b: [1, 2], c: [0]}, {b: [1, 2], c: [0]},
                      {}, {}]
    lengths = {r: len(engine.pop_output(r).outputs[0].token_ids) for r in (a, b, c, d)}
    assert lengths == {a: 2, b: 5, c: 3, d: 1}


def test_abort_frees_the_blocks_and_the_queue_moves_on(llm2):
    engine = llm2.engine
    a = engine.add_request([1, 2], params(20))
    b = engine.add_request([3, 4], params(20))
    c = engine.add_request([5, 6], params(2))
    engine.step()
    assert set(engine.blocks.tables) == {a, b}
    engine.abort_request(a)
    assert set(engine.blocks.tables) == {b} and engine.get_sequence(a) is None
    engine.step()
    assert {s.request_id for s in engine.scheduler.running} == {b, c}
    engine.abort_request(b)
    engine.abort_request(c)
    assert engine.blocks.pool.num_used == 0 and not engine.has_unfinished_requests()


def add_plain(engine, args):
    prompt_len, max_tokens, priority = args
    rid = engine.add_request(list(range(1, prompt_len + 1)), params(max_tokens), priority=priority)
    return rid, (prompt_len, max_tokens)


def check_running(engine):
    engine.blocks.check_invariants()
    running = engine.scheduler.running
    assert len(running) <= engine.config.max_num_seqs
    assert set(engine.blocks.tables) == {s.request_id for s in running}


@settings(max_examples=25, deadline=None)
@given(ops=operations(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 2))))
def test_invariants_under_random_operations(tight, ops):
    engine = tight.engine
    done = drive(engine, ops, add_plain, check_running)
    for rid, (prompt_len, max_tokens) in done.items():  # no request lost, each got what it asked
        out = engine.pop_output(rid)
        # 40 slots in all: a sequence alone can hold 40 tokens and sample a 41st.
        assert len(out.outputs[0].token_ids) == min(max_tokens, 64 - prompt_len,
                                                    41 - prompt_len)
    assert engine.blocks.pool.num_used == 0
    assert engine.blocks.cpu_pool is None or engine.blocks.cpu_pool.num_used == 0
    assert not engine._sequences


def test_block_tables_can_be_recorded_per_step(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=64, block_size=4, num_kv_blocks=8, record_block_tables=True)
    llm.generate([[1, 2, 3, 4, 5], [6, 7]], params(4))
    tables = [r.block_tables for r in llm.trace]
    assert tables[0] == {"0": [0, 1], "1": [2]}
    assert tables[-1] == {}  # both finished in the last step and gave their blocks back
