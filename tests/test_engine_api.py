"""The public API on a tiny random model: finish reasons, stops, streaming, seeds, logprobs, and
bad input that raises a clear ValueError and leaves the engine usable with nothing leaked."""
import pytest

from workbench import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def assert_engine_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.blocks.pool.num_used == 0 and not engine.blocks.tables
    engine.blocks.check_invariants()
    assert not engine._sequences


@pytest.mark.parametrize("prompt,fragment", [
    ("", "prompt=''"),
    ([], "prompts=[]"),
    ([[]], "is invalid"),
    ([[1, 2, -3]], "[0, 49152)"),
    ([[1, 2, 10**6]], "[0, 49152)"),
    ([3.5], "prompt=3.5"),
])
def test_bad_prompts_raise_and_engine_keeps_working(tiny_llm, prompt, fragment):
    with pytest.raises(ValueError) as err:
        tiny_llm.generate(prompt, GREEDY)
    assert fragment in str(err.value)
    assert_engine_idle(tiny_llm)
    assert len(tiny_llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 8


def test_prompt_longer_than_context_is_rejected_before_anything_is_queued(tiny_llm):
    too_long = [5] * 256  # max_model_len is 256: no room for a generated token
    with pytest.raises(ValueError, match=r"256 tokens, but max_model_len=256"):
        tiny_llm.generate([[1, 2, 3], too_long], GREEDY)  # the valid one is not left behind
    assert_engine_idle(tiny_llm)


def test_mismatched_sampling_params_list_is_rejected(tiny_llm):
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        tiny_llm.generate([[1], [2], [3]], [GREEDY, GREEDY])


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(model="no-such-model"), "model='no-such-model' is not a known model"),
    (dict(model="random:huge"), "presets are"),
    (dict(dtype="float64"), "dtype='float64' is invalid"),
    (dict(dtype="float16", device="cpu"), "float16"),
    (dict(device="tpu"), "device='tpu' is invalid"),
    (dict(max_num_seqs=0), "max_num_seqs=0 is invalid"),
    (dict(max_model_len=10**6), "max_model_len=1000000 is invalid"),
    (dict(block_sizee=16), "unknown engine argument(s) ['block_sizee']"),
    (dict(attention_backend="magic"), "attention_backend='magic' is invalid"),
])
def test_bad_engine_arguments_name_the_field(tiny_folder, kwargs, fragment):
    kwargs.setdefault("model", str(tiny_folder))
    with pytest.raises(ValueError) as err:
        LLM(verbose=False, **kwargs)
    assert fragment in str(err.value)


def test_cuda_request_without_cuda_is_a_clear_error(tiny_folder):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="device='cuda' is invalid here"):
        LLM(model=str(tiny_folder), device="cuda", verbose=False)


def test_finish_reasons_length_and_stop_token(tiny_llm):
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    first = out.outputs[0].token_ids[2]
    stopped = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5,
                                                             stop_token_ids=[first]))[0]
    ids = stopped.outputs[0].token_ids
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == first
    assert ids == out.outputs[0].token_ids[:ids.index(first) + 1]


def test_generation_stops_at_the_context_limit(tiny_llm):
    prompt = [9] * 250  # 6 slots left before max_model_len=256
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=50,
                                                     ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(prompt) + len(out.outputs[0].token_ids) == 256


def test_stop_string_is_cut_and_never_streamed(tiny_llm):
    base = tiny_llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=12))[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    out = tiny_llm.generate(["Hello there"], params)[0]
    assert out.outputs[0].text == text[:text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    chunks = list(tiny_llm.stream("Hello there", params))
    streamed = "".join(c.text for c in chunks)
    assert streamed == out.outputs[0].text and stop not in streamed
    assert chunks[-1].finished and chunks[-1].output.outputs[0].text == streamed
    assert_engine_idle(tiny_llm)


def test_stream_yields_every_token_and_the_same_text_as_generate(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    chunks = list(tiny_llm.stream("The sea", params))
    expected = tiny_llm.generate("The sea", params)[0].outputs[0]
    assert "".join(c.text for c in chunks) == expected.text
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert chunks[-1].finish_reason == "length"


def test_abandoned_stream_frees_its_request(tiny_llm):
    stream = tiny_llm.stream("The sea", SamplingParams(temperature=0, max_tokens=30,
                                                       ignore_eos=True))
    next(stream)
    stream.close()
    assert_engine_idle(tiny_llm)


def test_seed_makes_sampling_reproducible_whatever_the_batch(tiny_llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    alone = tiny_llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = tiny_llm.generate([[4, 5], [1, 2, 3], [6]], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone
    different = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=12,
                                                              seed=99))[0]
    assert different.outputs[0].token_ids != alone


def test_logprobs_are_consistent(tiny_llm):
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6,
                                                        logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3         # the chosen one is among the top 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_chat_applies_the_template(tiny_llm):
    messages = [{"role": "user", "content": "Hi!"}]
    out = tiny_llm.chat(messages, GREEDY)[0]
    tok = tiny_llm.get_tokenizer()
    prompt_text = tok.decode(out.prompt_token_ids)
    assert prompt_text.endswith("<|im_start|>assistant\n") and "Hi!" in prompt_text
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tiny_llm.chat([{"role": "user"}], GREEDY)
    assert_engine_idle(tiny_llm)


def test_stats_report_capacity_and_prefix_hits(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=64, block_size=4, num_kv_blocks=10, enable_prefix_caching=True)
    prompt = list(range(10, 30))                     # 20 tokens: 4 full blocks reusable
    llm.generate([prompt], GREEDY)
    llm.generate([prompt], GREEDY)
    s = llm.stats()
    assert (s["blocks_total"], s["token_capacity"], s["blocks_used"]) == (10, 40, 0)
    assert s["prefix_cache_queries"] == 40 and s["prefix_cache_hits"] == 16
    assert s["prefix_cache_hit_rate"] == 16 / 40
    assert s["blocks_cached"] + s["blocks_free"] == 10


def test_arrival_time_counts_queueing_outside_the_engine(tiny_llm):
    import time
    engine = tiny_llm.engine
    arrived = time.perf_counter() - 5.0     # the request waited 5 s before reaching the engine
    rid = engine.add_request([1, 2, 3], GREEDY, arrival_time=arrived)
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_output(rid)
    assert out.metrics.ttft >= 5.0 and out.metrics.e2e_latency >= out.metrics.ttft
    assert tiny_llm.trace[-1].sampled == [rid]
