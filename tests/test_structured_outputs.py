"""Structured outputs (workbench/structured_outputs.py) with SmolLM2's real tokenizer and xgrammar.

Most tests sample from random logits masked by the grammar's bitmask until the grammar terminates,
then check the decoded text against an independent checker (jsonschema, re.fullmatch, the choice
list). No model forward runs.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from workbench.models.loader import load_tokenizer  # noqa: E402
from workbench.sample.grammar import (  # noqa: E402
    GrammarCompiler,
    StructuredOutputsParams,
    apply_bitmask,
    fill_bitmasks,
)

VOCAB = 49152  # SmolLM2's logits width
EOS = 2  # <|im_end|>

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "light blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "color"],
}

# An EBNF grammar and the same language as a Python regex, to check samples independently.
EBNF = r"""
root ::= term (("+" | "-") term)?
term ::= num | "(" num "*" num ")"
num ::= [1-9] [0-9]?
"""
_NUM = r"[1-9][0-9]?"
_TERM = rf"(?:{_NUM}|\({_NUM}\*{_NUM}\))"
EBNF_AS_REGEX = rf"{_TERM}(?:[+-]{_TERM})?"


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder):
    return load_tokenizer(smollm2_folder)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def allowed(bitmask: torch.Tensor, row: int, width: int = VOCAB) -> torch.Tensor:
    """bitmask[row] unpacked to one bool per token (the reference for apply_bitmask)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask[row].unsqueeze(-1) >> shifts) & 1).bool().flatten()[:width]


def sample(compiler, params, rows=16, max_tokens=200, seed=0):
    """Decode `rows` sequences greedily from random logits under the grammar (the argmax of i.i.d.
    logits is a uniform draw among the allowed tokens); return the states and the tokens."""
    states = [compiler.new_state(params) for _ in range(rows)]
    bitmask = compiler.allocate_bitmask(rows)
    gen = torch.Generator().manual_seed(seed)
    tokens = [[] for _ in range(rows)]
    for _ in range(max_tokens):
        active = [i for i, s in enumerate(states) if not s.is_terminated()]
        if not active:
            break
        for row, i in enumerate(active):  # the unfinished sequences, packed into the first rows
            states[i].fill_bitmask(bitmask, row)
        logits = torch.rand(len(active), VOCAB, generator=gen)
        apply_bitmask(logits, bitmask, range(len(active)))
        for i, token in zip(active, logits.argmax(-1).tolist()):
            assert states[i].accept(token), f"row {i}: sampled token {token} was not accepted"
            tokens[i].append(token)
    return states, tokens


def texts_of(tokenizer, states, tokens):
    """The decoded output of each terminated sequence (its final stop token dropped)."""
    out = []
    for state, ids in zip(states, tokens):
        assert state.is_terminated(), f"did not terminate in budget: {tokenizer.decode(ids)!r}"
        assert ids[-1] == EOS
        out.append(tokenizer.decode(ids[:-1], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False))
    return out


def accept_text(compiler, tokenizer, params, text):
    """A state after accepting text's tokens; None when some token is rejected."""
    state = compiler.new_state(params)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not state.accept(token):
            return None
    return state


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_samples_parse_and_validate(compiler, tokenizer, seed):
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    states, tokens = sample(compiler, params, seed=seed)
    for text in texts_of(tokenizer, states, tokens):
        # strict=False: the maxLength string may hold a raw control character (see below).
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)


@pytest.mark.xfail(strict=True, reason="xgrammar 0.2.9, its issue #800: a length-bounded string "
                   "admits raw control characters and no escapes; when this passes, make the "
                   "sampling test above parse with strict JSON")
def test_length_bounded_strings_are_strict_json(compiler, tokenizer):
    params = StructuredOutputsParams(json={"type": "string", "maxLength": 8})
    assert accept_text(compiler, tokenizer, params, '"a\\nb"') is not None  # an escape is JSON
    assert accept_text(compiler, tokenizer, params, '"a\tb"') is None  # a raw TAB is not


def test_json_schema_with_any_whitespace_accepts_pretty_printed_json(compiler, tokenizer):
    params = StructuredOutputsParams(json=json.dumps(SCHEMA))
    doc = {"name": "Ann", "age": 7, "ok": False, "color": "light blue", "tags": ["a", "b"]}
    for text in (json.dumps(doc, indent=2), json.dumps(doc), json.dumps(doc, indent="\t")):
        state = accept_text(compiler, tokenizer, params, text)
        assert state is not None and state.is_completed(), text
        assert state.accept(EOS) and state.is_terminated()
    bad = dict(doc, age=121)
    assert accept_text(compiler, tokenizer, params, json.dumps(bad)) is None


def test_json_object_accepts_objects_only(compiler, tokenizer):
    params = StructuredOutputsParams(json_object=True)
    state = accept_text(compiler, tokenizer, params, '{"a": [1, {"b": null}], "c": "x"}')
    assert state is not None and state.accept(EOS) and state.is_terminated()
    assert accept_text(compiler, tokenizer, params, "[1, 2]") is None
    assert accept_text(compiler, tokenizer, params, '"text"') is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_samples_fullmatch(compiler, tokenizer, seed):
    pattern = r"[A-Z][a-z]{1,6} \d{2,3}(\.\d)?"
    params = StructuredOutputsParams(regex=pattern)
    states, tokens = sample(compiler, params, max_tokens=40, seed=seed)
    for text in texts_of(tokenizer, states, tokens):
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_samples_are_choices(compiler, tokenizer, seed):
    choices = ["yes", "yes please", "no", 'naïve "quoted"', "two\nlines", "back\\slash"]
    params = StructuredOutputsParams(choice=choices)
    states, tokens = sample(compiler, params, max_tokens=40, seed=seed)
    texts = texts_of(tokenizer, states, tokens)
    assert all(text in choices for text in texts), texts
    for choice in choices:
        state = accept_text(compiler, tokenizer, params, choice)
        assert state is not None and state.accept(EOS), choice
    assert accept_text(compiler, tokenizer, params, "maybe") is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ebnf_grammar_samples_match(compiler, tokenizer, seed):
    params = StructuredOutputsParams(grammar=EBNF)
    states, tokens = sample(compiler, params, max_tokens=40, seed=seed)
    for text in texts_of(tokenizer, states, tokens):
        assert re.fullmatch(EBNF_AS_REGEX, text), text


def test_rollback_restores_the_bitmask(compiler):
    gen = torch.Generator().manual_seed(1)
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    bitmask = compiler.allocate_bitmask(2)
    for trial in range(16):
        state = compiler.new_state(params)
        for _ in range(trial):  # start from different points in the document
            state.fill_bitmask(bitmask, 0)
            ids = allowed(bitmask, 0).nonzero()[:, 0]
            state.accept(int(ids[torch.randint(len(ids), (1,), generator=gen)]))
        state.fill_bitmask(bitmask, 0)
        before_tokens = state.num_accepted
        k = 1 + trial
        for _ in range(k):
            state.fill_bitmask(bitmask, 1)
            ids = allowed(bitmask, 1).nonzero()[:, 0]
            assert state.accept(int(ids[torch.randint(len(ids), (1,), generator=gen)]))
        state.rollback(k)
        state.fill_bitmask(bitmask, 1)
        assert state.num_accepted == before_tokens
        assert torch.equal(bitmask[0], bitmask[1]), f"trial {trial}: mask differs after rollback"


def test_draft_runs_with_rollback_still_end_in_valid_json(compiler, tokenizer):
    """Speculative decoding's pattern: accept a run of draft tokens, take back the rejected tail."""
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    gen = torch.Generator().manual_seed(2)
    bitmask = compiler.allocate_bitmask(1)
    for _ in range(6):
        state, kept = compiler.new_state(params), []
        while not state.is_terminated() and len(kept) < 300:
            draft = []
            for _ in range(4):
                state.fill_bitmask(bitmask, 0)
                ids = allowed(bitmask, 0).nonzero()[:, 0]
                token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
                assert state.accept(token)
                draft.append(token)
            rejected = int(torch.randint(4, (1,), generator=gen))  # keep at least one
            state.rollback(rejected)
            kept += draft[:len(draft) - rejected]
        text = tokenizer.decode(kept[:kept.index(EOS)], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        assert state.num_accepted == len(kept)


def test_once_terminated_only_stop_tokens_are_allowed(compiler, tokenizer):
    state = compiler.new_state(StructuredOutputsParams(regex="ab"))
    bitmask = compiler.allocate_bitmask(1)
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    assert not state.accept(EOS) and not state.accept(b)  # rejected tokens change nothing
    assert state.accept(a) and state.accept(b) and state.is_completed()
    state.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0).nonzero()[:, 0].tolist() == [EOS]
    assert state.accept(EOS) and state.is_terminated()
    state.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0).nonzero()[:, 0].tolist() == [EOS]
    assert not state.accept(a)
    assert state.accept(EOS) and state.accept(EOS) and state.num_accepted == 5
    state.rollback(3)  # the two extra stops and the terminating one
    assert not state.is_terminated() and state.is_completed() and state.num_accepted == 2
    with pytest.raises(ValueError, match=r"num_tokens=3 is invalid"):
        state.rollback(3)
    state.reset()
    assert state.num_accepted == 0 and state.accept(a)


def test_special_tokens_are_never_allowed(compiler, tokenizer):
    specials = [i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i != EOS]
    assert len(specials) >= 10  # <|endoftext|>, <|im_start|>, <repo_name>, ...
    params = StructuredOutputsParams(json={"type": "string"})
    state = accept_text(compiler, tokenizer, params, '"inside a string ')
    bitmask = compiler.allocate_bitmask(1)
    state.fill_bitmask(bitmask, 0)
    mask = allowed(bitmask, 0)
    assert mask.sum() > 40000  # almost any text may continue the string ...
    assert not mask[specials].any() and not mask[EOS]  # ... but no special token
    assert not state.accept(specials[1])


def test_model_vocab_wider_than_tokenizer_masks_the_padding(tokenizer):
    width = VOCAB + 100
    compiler = GrammarCompiler(tokenizer, width)
    bitmask = compiler.allocate_bitmask(1)
    assert bitmask.shape == (1, (width + 31) // 32) and bitmask.dtype == torch.int32
    compiler.new_state(StructuredOutputsParams(json={"type": "string"})).fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, width)
    apply_bitmask(logits, bitmask, [0])
    assert torch.isinf(logits[0, VOCAB:]).all()
    assert torch.isfinite(logits[0, :VOCAB]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_bitmask_masks_constrained_rows_only(compiler, tokenizer, dtype):
    params = [StructuredOutputsParams(json=SCHEMA), None, StructuredOutputsParams(regex=r"\d+"),
              None]
    states = [compiler.new_state(p) if p else None for p in params]
    states[0].accept(tokenizer.encode("{", add_special_tokens=False)[0])
    bitmask = compiler.allocate_bitmask(len(states))
    rows = fill_bitmasks(states, bitmask)
    assert rows == [0, 2]
    logits = torch.randn(len(states), VOCAB).to(dtype)
    expected = logits.clone()
    for r in rows:
        expected[r, ~allowed(bitmask, r)] = float("-inf")
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    apply_bitmask(logits, bitmask, [])  # no constrained row: nothing to do
    assert torch.equal(logits, expected)


def test_compiled_grammars_are_cached_by_params(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, cache_size=2)
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is first
    compact = compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert compact is not first
    compiler.compile(StructuredOutputsParams(regex="x+"))  # evicts the least recently used
    assert compiler.cache_len() == 2
    assert compiler.compile(StructuredOutputsParams(json=SCHEMA)) is not first


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"exactly one of json, regex, choice, grammar, json_object must be set; got none"),
    ({"json": SCHEMA, "regex": "a+"}, r"got json=\{.*\}, regex='a\+'"),
    ({"choice": ["a"], "json_object": True}, r"got choice=\['a'\], json_object=True"),
    ({"json": "{not json"}, r"^json='\{not json' is invalid: it is not valid JSON"),
    ({"json": 3}, r"^json=3 is invalid"),
    ({"json": "[1, 2]"}, r"^json='\[1, 2\]' is invalid: a JSON schema is an object"),
    ({"regex": ""}, r"^regex='' is invalid"),
    ({"grammar": 5}, r"^grammar=5 is invalid"),
    ({"choice": []}, r"^choice=\[\] is invalid"),
    ({"choice": ["a", ""]}, r"^choice=\['a', ''\] is invalid"),
    ({"choice": "ab"}, r"^choice='ab' is invalid"),
    ({"json_object": 1}, r"^json_object=1 is invalid"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, r"^disable_any_whitespace='yes' is invalid"),
])
def test_invalid_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"json": {"type": "foo"}}, r"^json=\{'type': 'foo'\} is invalid: .*Unsupported type \"foo\""),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, r"^json=.* is invalid: \S"),
    ({"regex": "a(b"}, r"^regex='a\(b' is invalid: .*parenthesis is not closed"),
    ({"grammar": "root ::= missing"}, r"^grammar='root ::= missing' is invalid: .*not defined"),
    ({"grammar": 'start ::= "a"'}, r"^grammar=.* is invalid: .*root rule"),
])
def test_bad_schema_regex_grammar_is_a_value_error_naming_the_field(compiler, kwargs, message):
    params = StructuredOutputsParams(**kwargs)  # well-formed fields: only compiling can tell
    with pytest.raises(ValueError, match=message) as err:
        compiler.compile(params)
    assert "/project/cpp" not in str(err.value)  # xgrammar's message, without its C++ location
