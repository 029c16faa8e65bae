"""Greedy outputs stay token-identical to transformers under everything the paged engine does:
odd prefill chunk sizes, a pool so small that preemption happens (recompute and swap), prefix
caching with shared prefixes, and requests arriving while others decode."""
import random

import pytest

from workbench import LLM, SamplingParams

from conftest import hf_greedy, hf_model

NEW = 20


def make_prompts(seed=0, n=6):
    rng = random.Random(seed)
    system = [rng.randrange(3, 49000) for _ in range(37)]   # a shared "system prompt"
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 49000) for _ in range(rng.randrange(1, 30))]
        prompts.append((system if i % 2 == 0 else system[:20]) + tail)
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_folder):
    hf = hf_model(tiny_folder)
    prompts = make_prompts()
    return prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def run_engine(folder, prompts, arrivals=None, **kwargs):
    """Add prompts (some only after a few steps) and step until all finish."""
    llm = LLM(model=str(folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=128, **kwargs)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW)
    arrivals = arrivals or [0] * len(prompts)
    ids, step = {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        for i, (p, at) in enumerate(zip(prompts, arrivals)):
            if at == step and i not in ids:
                ids[i] = engine.add_request(p, params, request_id=str(i))
        engine.step()
        engine.blocks.check_invariants()
        step += 1
    outputs = [engine.pop_output(ids[i]).outputs[0].token_ids for i in range(len(prompts))]
    return outputs, engine


def chunked_schedule(prompt_lens, output_lens, budget):
    """The steps the scheduler's rules give requests that all arrive at once and never run out of
    blocks: running requests first, in arrival order, each taking all its uncomputed tokens or what
    is left of the step's budget; then waiting requests join while budget is left. A request whose
    prompt is all computed gets a token, and after its last one it leaves."""
    waiting, running = list(range(len(prompt_lens))), []
    uncomputed, sampled = list(prompt_lens), [0] * len(prompt_lens)
    steps = []
    while waiting or running:
        left, step = budget, []
        for i in running:
            if left == 0:
                break
            step.append((str(i), min(uncomputed[i], left)))
            left -= step[-1][1]
        while waiting and left > 0:
            i = waiting.pop(0)
            running.append(i)
            step.append((str(i), min(uncomputed[i], left)))
            left -= step[-1][1]
        for rid, n in step:
            i = int(rid)
            uncomputed[i] -= n
            if uncomputed[i] == 0:            # the prompt (or last token) ran: a token is sampled
                sampled[i] += 1
                uncomputed[i] = 1
                if sampled[i] == output_lens[i]:
                    running.remove(i)
        steps.append(step)
    return steps


def test_the_reference_schedule_chunks_as_worked_out_by_hand():
    # Prompts of 44, 21 and 61 tokens, 3 output tokens each, 64 tokens a step: step 1 takes A
    # whole and 20 of B; step 2 A's decode, B's last prompt token and C whole; A has its 3 tokens
    # after step 3, B and C after step 4.
    assert chunked_schedule([44, 21, 61], [3, 3, 3], 64) == [
        [("0", 44), ("1", 20)],
        [("0", 1), ("1", 1), ("2", 61)],
        [("0", 1), ("1", 1), ("2", 1)],
        [("1", 1), ("2", 1)],
    ]


# Prompts of 44, 21, 61, 36, 57 and 49 tokens (268), 20 output tokens each. Chunk 1: one token a
# step, 268 + 6 x 19 fed-back tokens = 382 steps. Chunk 64: steps 1-4 take 64, 62, 61 and 60
# prompt tokens (the running requests' decodes take the rest), the last 21 complete the last prompt
# in step 5, and its 19 more tokens take 19 more steps: 24.
@pytest.mark.parametrize("chunk, steps", [(1, 382), (7, 70), (64, 24)])
def test_chunked_prefill_splits_prompts_oddly_and_changes_nothing(tiny_folder, reference, chunk,
                                                                   steps):
    prompts, expected = reference
    assert [len(p) for p in prompts] == [44, 21, 61, 36, 57, 49]
    outputs, engine = run_engine(tiny_folder, prompts, max_num_batched_tokens=chunk,
                                 enable_chunked_prefill=True, block_size=4)
    assert outputs == expected and [len(e) for e in expected] == [NEW] * len(prompts)
    # Step by step, the engine ran exactly the chunks the scheduler's rules give: prompts cut at
    # the step budget wherever it ends, decodes of running requests before any new prefill.
    schedule = chunked_schedule([len(p) for p in prompts], [len(e) for e in expected], chunk)
    assert [r.scheduled for r in engine.trace] == schedule
    assert len(engine.trace) == steps
    assert not any(r.num_preempted for r in engine.trace)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_a_tiny_pool_changes_nothing(tiny_folder, reference, mode):
    prompts, expected = reference
    # 14 blocks of 8 tokens = 112 slots for 6 sequences that grow to ~60-90 tokens each.
    outputs, engine = run_engine(tiny_folder, prompts, block_size=8, num_kv_blocks=14,
                                 preemption_mode=mode, max_num_seqs=6)
    assert outputs == expected
    assert sum(r.num_preempted for r in engine.trace) > 0
    swapped = sum(r.blocks_swapped_out for r in engine.trace)
    assert (swapped > 0) == (mode == "swap")
    if mode == "swap":
        assert sum(r.blocks_swapped_in for r in engine.trace) == swapped


@pytest.mark.parametrize("caching", [False, True])
def test_prefix_caching_reuses_shared_prefixes_and_changes_nothing(tiny_folder, reference,
                                                                   caching):
    prompts, expected = reference
    arrivals = [0, 3, 5, 8, 9, 30]   # later requests find earlier requests' blocks cached
    outputs, engine = run_engine(tiny_folder, prompts, arrivals=arrivals, block_size=4,
                                 enable_prefix_caching=caching)
    assert outputs == expected
    hits = sum(r.prefix_hit_tokens for r in engine.trace)
    assert (hits > 0) == caching
    if caching:
        # The last request arrives after all others finished: the 20 tokens it shares with them
        # (5 full blocks of 4) come from cached blocks that nobody holds any more.
        last = next(r for r in engine.trace if any(rid == "5" for rid, _ in r.scheduled))
        assert last.num_running == 1 and last.prefix_hit_tokens == 20
        assert engine.blocks.hit_rate > 0.3


def test_requests_arriving_while_others_decode(tiny_folder, reference):
    prompts, expected = reference
    outputs, engine = run_engine(tiny_folder, prompts, arrivals=[0, 1, 2, 6, 7, 15],
                                 block_size=16, max_num_batched_tokens=32)
    assert outputs == expected
    # Some step mixed a prefill with decodes of running requests.
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in engine.trace)


def test_everything_at_once(tiny_folder, reference):
    prompts, expected = reference
    outputs, engine = run_engine(tiny_folder, prompts, arrivals=[0, 0, 2, 4, 4, 9],
                                 block_size=4, num_kv_blocks=30, max_num_batched_tokens=7,
                                 enable_prefix_caching=True, preemption_mode="swap")
    assert outputs == expected
    assert sum(r.num_preempted for r in engine.trace) > 0


def test_a_request_that_outgrows_the_whole_pool_ends_with_length(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=128, block_size=4, num_kv_blocks=5)   # 20 token slots in all
    out = llm.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=50,
                                                  ignore_eos=True))[0]
    # 20 slots hold the prompt and 10 generated tokens; the 11th is sampled from the last forward
    # pass but would need slot 21 to be fed back, so the sequence ends there.
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 11
    with pytest.raises(ValueError, match="needs 31 token slots, and the pool holds 20"):
        llm.generate([[5] * 30], SamplingParams(max_tokens=5))
    assert llm.engine.blocks.pool.num_used == 0


def test_priority_decides_admission_and_victims(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=128, block_size=4, num_kv_blocks=12, max_num_seqs=4)
    engine = llm.engine
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    low = engine.add_request([1] * 8, p, priority=5)
    engine.step()
    high = engine.add_request([2] * 8, p, priority=0)
    while engine.has_unfinished_requests():
        engine.step()
    preempted = [rid for r in engine.trace for rid in r.preempted]
    assert preempted and set(preempted) == {low}   # the low-priority request is the victim
    order = [r.finished[0] for r in engine.trace if r.finished]
    assert order == [high, low]                    # and finishes last, though it came first
