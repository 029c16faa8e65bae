"""Penalties, min-p, logit_bias, min_tokens and bad_words: exact values against hand computations
and transformers' own processors, then through the engine (greedy equal to transformers'
generate with the same penalty)."""
import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from conftest import hf_model
from workbench import SamplingParams
from workbench.sample.logits_processors import (History, apply_min_p, apply_penalties,
                                                banned_tokens, process_logits)
from workbench.sample.sampler import Sampler


def test_repetition_penalty_equals_transformers():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    histories = [History([1, 2, 3], [4, 4, 9]), History([10], []), History([0, 49], [2])]
    for penalty in (0.7, 1.3, 2.0):
        params = [SamplingParams(repetition_penalty=penalty)] * 3
        ours = apply_penalties(logits.clone(), params, histories)
        for i, h in enumerate(histories):
            ids = torch.tensor([h.prompt_token_ids + h.output_token_ids])
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i:i + 1].clone())
            torch.testing.assert_close(ours[i], theirs[0], rtol=0, atol=0)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 8)
    h = History(prompt_token_ids=[5, 5, 5], output_token_ids=[1, 1, 1, 2])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), [p], [h])[0]
    expected = torch.zeros(8)
    expected[1] = -(3 * 0.5 + 0.25)
    expected[2] = -(1 * 0.5 + 0.25)
    torch.testing.assert_close(out, expected)      # token 5 is only in the prompt: untouched


def test_min_p_equals_transformers_and_keeps_the_top_token():
    torch.manual_seed(1)
    logits = torch.randn(4, 100) * 4
    for min_p in (0.01, 0.1, 0.5, 1.0):
        ours = apply_min_p(logits, min_p)
        theirs = MinPLogitsWarper(min_p)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        assert torch.isfinite(ours.gather(-1, logits.argmax(-1, keepdim=True))).all()


def test_min_p_samples_the_kept_tokens_in_proportion():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    n = 20000
    tokens = Sampler(0)(logits.expand(n, -1), [SamplingParams(min_p=0.2)] * n, [None] * n)
    freq = torch.bincount(torch.tensor(tokens.token_ids), minlength=4).float() / n
    kept = torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92       # 0.08 < 0.2 * 0.5 is dropped
    assert freq[3] == 0 and (freq - kept).abs().sum() / 2 < 0.03


def test_bans_min_tokens_then_bad_word_suffixes():
    p = SamplingParams(min_tokens=3, max_tokens=10)
    h = History([7], [1, 2], stop_token_ids=frozenset({0, 9}),
                bad_words_token_ids=((4,), (2, 5), (1, 3, 6)))
    # 2 outputs < min_tokens: stops banned; (4,) always; (2, 5): output ends with 2; (1, 3, 6) not.
    assert sorted(banned_tokens(p, h)) == [0, 4, 5, 9]
    h.output_token_ids = [1, 3, 2]
    assert sorted(banned_tokens(p, h)) == [4, 5]


def test_logit_bias_then_raw_logprobs_and_untouched_rows_not_copied():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(temperature=0, logit_bias={3: 2.0, "5": -1}), SamplingParams()]
    out = process_logits(logits, params, [None, None])
    assert out[0].tolist() == [0, 0, 0, 2.0, 0, -1.0] and out[1].tolist() == [0] * 6
    assert process_logits(logits, [SamplingParams()] * 2, [None, None]) is logits
    result = Sampler(0)(logits[:1], [SamplingParams(temperature=0, logprobs=0,
                                                logit_bias={3: 2.0})], [None])
    assert result.token_ids == [3]
    assert result.logprobs[0][0] == pytest.approx(-torch.log(torch.tensor(6.0)).item())


def test_min_tokens_holds_eos_back_then_lets_it_end(tiny_llm):
    eos = min(tiny_llm.engine.output_processor.eos_token_ids)
    forced = {eos: 100.0}
    out = tiny_llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=20,
                                                      logit_bias=forced))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = tiny_llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                                                      logit_bias=forced))[0].outputs[0]
    assert eos not in out.token_ids[:5] and out.token_ids[5] == eos and len(out.token_ids) == 6
    assert out.finish_reason == "stop"


def test_bad_words_are_never_generated(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    hello = tok.encode(" hello", add_special_tokens=False)
    assert len(hello) == 1
    forced = SamplingParams(temperature=0, max_tokens=6, logit_bias={hello[0]: 100.0})
    assert tiny_llm.generate([5, 6], forced)[0].outputs[0].token_ids == hello * 6
    banned = SamplingParams(temperature=0, max_tokens=6, logit_bias={hello[0]: 100.0},
                            bad_words=["hello"])
    out = tiny_llm.generate([5, 6], banned)[0].outputs[0]
    assert hello[0] not in out.token_ids and len(out.token_ids) == 6


def test_engine_rejects_processors_that_do_not_fit_the_model(tiny_llm):
    with pytest.raises(ValueError, match=r"logit_bias keys \[999999\] are invalid"):
        tiny_llm.generate([1, 2], SamplingParams(logit_bias={999999: 1.0}))


def test_greedy_with_repetition_penalty_equals_transformers(smollm2_llm, smollm2_folder):
    hf = hf_model(smollm2_folder)
    tok = smollm2_llm.get_tokenizer()
    ids = tok.encode("The cat sat on the mat. The cat sat on the", add_special_tokens=True)
    ours = smollm2_llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    repetition_penalty=1.3))[0].outputs[0]
    x = torch.tensor([ids])
    with torch.inference_mode():
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24,
                             do_sample=False, repetition_penalty=1.3, pad_token_id=0)
    assert ours.token_ids == theirs[0, len(ids):].tolist()
    plain = smollm2_llm.generate(ids, SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True))[0].outputs[0]
    assert plain.token_ids != ours.token_ids      # the penalty changed the continuation


def test_penalized_requests_are_not_drafted_for():
    from workbench import LLM
    llm = LLM(model="random:tiny", dtype="float32", device="cpu", verbose=False,
              max_model_len=128, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.0)
    llm.generate([1, 2, 3, 1, 2, 3, 1, 2], params)
    assert sum(r.num_draft_tokens for r in llm.engine.trace) == 0
