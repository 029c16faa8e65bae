"""The real model: greedy output token-identical to transformers' generate() in fp32 on CPU."""
import pytest
import torch

from workbench import SamplingParams

from conftest import engine_next_token_logits, hf_greedy, hf_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a list of three fruits:\n1.",
    "Question: What is 17 times 3?\nAnswer:",
    "La recette traditionnelle de la ratatouille commence par",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nGive me two tips for learning to program.<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "🙂 Emoji and unicode: naïve café, Straße, 東京 —",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf(smollm2_folder):
    return hf_model(smollm2_folder)


def test_greedy_generation_is_token_identical_to_transformers(smollm2_llm, hf):
    tok = smollm2_llm.get_tokenizer()
    outputs = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        expected = hf_greedy(hf, ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, prompt
        # The text is the tokens decoded, end-of-sequence token left out.
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == ("length" if len(expected) == NEW_TOKENS
                                                and expected[-1] != 2 else "stop")


def test_next_token_logits_match_transformers_in_fp32(smollm2_llm, hf):
    tok = smollm2_llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = engine_next_token_logits(smollm2_llm, ids)
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-4)
        assert ours.argmax() == theirs.argmax()


def test_paged_engine_under_pressure_matches_transformers(smollm2_folder, hf):
    """The real model through everything at once: a shared chat system prompt (prefix caching),
    prompts split into 24-token chunks, and a pool too small for all of them (swap preemption)."""
    from workbench import LLM
    llm = LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
              max_model_len=256, max_num_seqs=4, block_size=8, num_kv_blocks=12,
              max_num_batched_tokens=24, enable_prefix_caching=True, preemption_mode="swap")
    system = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
    questions = ["What is a cache?", "Why is the sky blue?", "Name a prime number.",
                 "What does a compiler do?"]
    prompts = [llm.apply_chat_template([system, {"role": "user", "content": q}])
               for q in questions]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    trace = llm.trace
    assert sum(r.prefix_hit_tokens for r in trace) > 0
    assert sum(r.num_preempted for r in trace) > 0
    assert max(r.num_prefill_tokens for r in trace) <= 24
