"""Fast equality with transformers on tiny random-weight Llamas (GQA and plain multi-head)."""
import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.models import make_random_checkpoint

from conftest import engine_next_token_logits, hf_greedy, hf_model

PROMPTS = [[1, 2, 3], [100, 200, 300, 400, 500, 600, 700], [42], list(range(1000, 1040)),
           [7, 7, 7, 7, 9], [31999, 5, 17, 250, 49151]]


@pytest.fixture(scope="module", params=["tiny", "tiny-mha"])
def pair(request, tmp_path_factory, smollm2_folder):
    folder = make_random_checkpoint(request.param, seed=3)
    llm = LLM(model=str(folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=128, max_num_seqs=4)
    return llm, hf_model(folder)


def test_greedy_tokens_match_transformers(pair):
    llm, hf = pair
    params = SamplingParams(temperature=0, max_tokens=24)
    outputs = llm.generate(PROMPTS, params)  # 6 prompts, 4 at a time: batches mix and change
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)


def test_next_token_logits_match_transformers(pair):
    llm, hf = pair
    for prompt in PROMPTS:
        ours = engine_next_token_logits(llm, prompt)
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_prompt_logprobs_match_transformers_at_every_position(pair):
    llm, hf = pair
    prompt = PROMPTS[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert abs(entry[prompt[j]].logprob - ref[j - 1, prompt[j]].item()) < 1e-5
        top3 = torch.topk(ref[j - 1], 3).indices.tolist()
        assert set(top3) <= set(entry)  # the 3 most likely are listed (plus the actual token)


def test_bf16_engine_stays_close_to_fp32_transformers(pair):
    llm, hf = pair
    folder = llm.engine.checkpoint
    bf16 = LLM(model=str(folder), dtype="bfloat16", device="cpu", verbose=False, max_model_len=128)
    for prompt in PROMPTS[:3]:
        ours = engine_next_token_logits(bf16, prompt)
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0, -1].float()
        # bf16 keeps 8 bits of mantissa: agreement to ~1e-2 relative, far from fp32's 1e-5.
        assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max() + 0.02
