"""Beam search: the same hypotheses and scores as transformers' generate(num_beams=...) on
SmolLM2 in fp32, beams that share the prompt's blocks, and nothing left held afterwards."""
import pytest
import torch

from conftest import hf_model
from workbench import LLM, BeamSearchParams


def hf_beams(hf, ids, width, max_tokens, length_penalty, eos=2):
    x = torch.tensor([ids])
    with torch.inference_mode():
        g = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=width,
                        num_return_sequences=width, max_new_tokens=max_tokens, do_sample=False,
                        length_penalty=length_penalty, early_stopping=False, output_scores=True,
                        return_dict_in_generate=True)
    out = []
    for row in g.sequences:            # finished rows are padded after EOS: cut there
        gen = row[len(ids):].tolist()
        out.append(gen[:gen.index(eos) + 1] if eos in gen else gen)
    return out, g.sequences_scores.tolist()


@pytest.mark.parametrize("text,width,max_tokens,length_penalty", [
    ("The capital of France is", 4, 20, 1.0),      # hypotheses end with EOS
    ("def fibonacci(n):", 3, 16, 2.0),             # all end at max_tokens
])
def test_beams_equal_transformers(smollm2_llm, smollm2_folder, text, width, max_tokens,
                                  length_penalty):
    tok = smollm2_llm.get_tokenizer()
    ids = tok.encode(text)
    ours = smollm2_llm.beam_search(ids, BeamSearchParams(width, max_tokens,
                                                         length_penalty=length_penalty))[0]
    tokens, scores = hf_beams(hf_model(smollm2_folder), ids, width, max_tokens, length_penalty)
    assert [s.token_ids for s in ours.sequences] == tokens
    assert [s.score for s in ours.sequences] == pytest.approx(scores, abs=1e-4)
    assert ours.sequences[0].text == tok.decode(tokens[0], skip_special_tokens=True)
    assert smollm2_llm.engine.blocks.pool.num_used == 0
    assert not smollm2_llm.engine.has_unfinished_requests()


def test_beams_share_the_prompt_blocks(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=128, max_num_seqs=4, block_size=16, record_block_tables=True)
    prompt = list(range(5, 45))           # 2 full blocks + 8 tokens
    out = llm.beam_search([prompt, prompt[::-1]],
                          BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    assert [len(o.sequences) for o in out] == [4, 4]
    assert all(len(s.token_ids) == 6 and s.finish_reason == "length"
               for o in out for s in o.sequences)
    # After the first selection each prompt has 4 beams over one copy of its 2 full blocks.
    for record in llm.engine.trace:
        tables = record.block_tables
        if len(tables) == 8:
            full = {tuple(t[:2]) for t in tables.values()}
            assert len(full) == 2 and record.blocks_used < 8 * 3
            break
    else:
        raise AssertionError("never 8 beams at once")
    assert llm.engine.blocks.pool.num_used == 0


def test_bad_beam_search_params_name_the_field(tiny_llm):
    with pytest.raises(ValueError, match=r"^beam_width=0 is invalid"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match=r"^temperature=0.5 is invalid"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
    with pytest.raises(ValueError, match=r"^beam_width=5 is invalid: .* max_num_seqs=4"):
        tiny_llm.beam_search([1, 2, 3], BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match=r"^max_tokens=300 is invalid .* max_model_len=256"):
        tiny_llm.beam_search([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=300))
