"""Structured outputs through the engine: every sample of SmolLM2 validates against its schema,
regex, choice and grammar outputs match on the tiny model across seeds, and the grammar's masks
survive speculative decoding (rollback), preemption and chunked prefill."""
import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from workbench import LLM, SamplingParams  # noqa: E402
from workbench.structured import StructuredOutputsParams  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Alan", "Grace", "Edsger"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["C", "Lisp", "ML"]},
                      "maxItems": 3},
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "retired"],
    "additionalProperties": False,
}


def test_every_smollm2_sample_validates_against_the_schema(smollm2_llm):
    so = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    prompts = [smollm2_llm.apply_chat_template([{"role": "user", "content": c}]) for c in
               ("Describe a famous programmer as JSON.", "Give me a person record in JSON.")]
    outs = smollm2_llm.generate(prompts, SamplingParams(n=8, seed=5, temperature=1.0,
                                                        max_tokens=80, structured_outputs=so))
    texts = [o.text for out in outs for o in out.outputs]
    assert len(texts) == 16 and all(o.finish_reason == "stop" for out in outs
                                    for o in out.outputs)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1                       # sampled, not one forced string
    assert smollm2_llm.engine.blocks.pool.num_used == 0


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=256, max_num_seqs=8)


@pytest.mark.parametrize("so,check", [
    (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (StructuredOutputsParams(choice=["red", "green", "blue"]),
     lambda t: t in ("red", "green", "blue")),
    (StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'),
     lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
])
def test_random_model_outputs_match_regex_choice_and_grammar(tiny, so, check):
    params = SamplingParams(n=6, seed=1, temperature=1.0, max_tokens=48, structured_outputs=so)
    outs = tiny.generate([[5, 6, 7], [9, 8]], params)
    assert [len(out.outputs) for out in outs] == [6, 6]
    for o in (o for out in outs for o in out.outputs):
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_greedy_with_speculation_equals_greedy_without(tiny_folder, tiny):
    """n-gram drafts run through the grammar's masks and are rolled back when rejected; the
    output must be the one plain greedy decoding gives."""
    spec = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=256, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 3})
    so = StructuredOutputsParams(regex=r"(ab|cd|[0-9])+x")
    prompt = [int(t) for t in spec.get_tokenizer().encode("ab12cdab12cdab12cdab12")]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    with_drafts = spec.generate(prompt, params)[0].outputs[0]
    plain = tiny.generate(prompt, params)[0].outputs[0]
    assert sum(r.num_draft_tokens for r in spec.engine.trace) > 0
    assert with_drafts.token_ids == plain.token_ids
    assert re.fullmatch(r"(ab|cd|[0-9])+x", plain.text) or plain.finish_reason == "length"


def test_preemption_and_chunked_prefill_keep_outputs_valid(tiny_folder, tiny):
    small = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                max_model_len=256, max_num_seqs=8, block_size=16, num_kv_blocks=9,
                max_num_batched_tokens=32)
    so = StructuredOutputsParams(regex=r"[a-z]{60,90}\.")
    params = SamplingParams(n=3, seed=4, temperature=1.0, max_tokens=100, structured_outputs=so)
    prompts = [list(range(10, 50)), list(range(60, 100))]
    tight = small.generate(prompts, params)
    assert sum(r.num_preempted for r in small.engine.trace) > 0
    loose = tiny.generate(prompts, params)
    assert [len(o.outputs) for o in tight] == [len(o.outputs) for o in loose] == [3, 3]
    for a, b in zip(tight, loose):
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        assert all(re.fullmatch(r"[a-z]{60,90}\.", o.text) for o in a.outputs)


def test_bad_structured_outputs_are_named(tiny):
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex='a\(b' is invalid"):
        tiny.generate([1, 2], SamplingParams(structured_outputs={"regex": "a(b"}))
    with pytest.raises(ValueError, match=r"^structured_outputs=.* is invalid: .*unexpected"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match=r"exactly one of json, regex"):
        SamplingParams(structured_outputs={})
    assert not tiny.engine.has_unfinished_requests()
