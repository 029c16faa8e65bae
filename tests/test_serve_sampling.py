"""The server's sampling features through the real `openai` client: n choices (streamed with
their index) equal to the offline engine's samples, best_of, penalties and logit_bias, and
response_format / structured_outputs whose outputs validate against their schema."""
import json

import httpx
import pytest

from test_serve import MODEL, client, offline, server  # noqa: F401 (fixtures)
from workbench import SamplingParams

PROMPT = "The quick brown fox"


def offline_texts(llm, prompt, **kw):
    return [o.text for o in llm.generate(prompt, SamplingParams(**kw))[0].outputs]


def test_n_choices_equal_the_offline_samples(client, offline):
    want = offline_texts(offline, PROMPT, n=3, seed=9, max_tokens=12, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=9, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == want and len(set(want)) == 3
    assert r.usage.completion_tokens == 36


def test_n_streamed_chat_choices_carry_their_index(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = offline.apply_chat_template(messages)
    want = offline_texts(offline, ids, n=2, seed=3, max_tokens=10, ignore_eos=True)
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=2, seed=3,
                                                max_tokens=10, stream=True,
                                                extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == want and reasons == {0: "length", 1: "length"}


def test_best_of_returns_the_offline_best(client, offline):
    want = offline_texts(offline, PROMPT, n=1, best_of=4, seed=2, max_tokens=8,
                         ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=1, best_of=4, seed=2,
                                  max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == want


def test_penalties_and_logit_bias_are_applied(client, offline):
    kw = dict(temperature=0, max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5)
    want = offline_texts(offline, PROMPT, ignore_eos=True, **kw)
    r = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True},
                                  **kw)
    assert r.choices[0].text == want[0]
    token = offline.get_tokenizer().encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3,
                                  logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " banana" * 3


SCHEMA = {"type": "object", "properties": {
    "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["colour", "count"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON please"}], seed=seed,
            max_tokens=60, response_format={"type": "json_schema", "json_schema": {
                "name": "pick", "schema": SCHEMA}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="{", max_tokens=40, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()


def test_structured_and_response_format_together_are_refused(server):
    r = httpx.post(f"{server}/v1/completions", timeout=30, json={
        "prompt": "hi", "response_format": {"type": "json_object"},
        "structured_outputs": {"regex": "a+"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
