"""SamplingParams rejects every invalid value with a message naming the field, value and range."""
import pytest

from workbench import SamplingParams

BAD = [
    ("temperature", -0.1, "must be a number >= 0"),
    ("temperature", float("nan"), "must be a number >= 0"),
    ("temperature", "hot", "must be a number >= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.5, "in (0, 1]"),
    ("top_p", -1, "in (0, 1]"),
    ("top_k", -2, "positive integer, or -1 or 0"),
    ("top_k", 2.5, "positive integer, or -1 or 0"),
    ("top_k", True, "positive integer, or -1 or 0"),
    ("max_tokens", 0, "integer >= 1"),
    ("max_tokens", -5, "integer >= 1"),
    ("max_tokens", 3.0, "integer >= 1"),
    ("logprobs", -1, "integer >= 0"),
    ("prompt_logprobs", "all", "integer >= 0"),
    ("seed", 1.5, "integer"),
    ("stop", [""], "non-empty str"),
    ("stop_token_ids", [-1], "token ids >= 0"),
    ("n", 0, "integer >= 1"),
    ("best_of", 0, "integer >= n=1"),
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("frequency_penalty", -3, "in [-2, 2]"),
    ("repetition_penalty", 0.0, "number > 0"),
    ("min_p", 1.5, "in [0, 1]"),
    ("min_tokens", 17, "in [0, max_tokens=16]"),
    ("bad_words", "word", "list of non-empty str"),
    ("logit_bias", [1, 2], "dict {token_id: bias}"),
]


@pytest.mark.parametrize("field,value,allowed", BAD)
def test_invalid_values_name_field_value_and_allowed_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert message.startswith(f"{field}=")
    assert repr(value) in message or str(value) in message
    assert allowed in message


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_accepts_disabled_values_and_positive_integers(top_k):
    p = SamplingParams(top_k=top_k)
    assert p.top_k_enabled == (top_k > 0)


def test_defaults_follow_vllm_and_stop_string_becomes_list():
    p = SamplingParams(stop="###")
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, -1, 16)
    assert p.stop_list == ["###"] and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_logit_bias_keys_may_be_strings_as_in_openai_json_and_values_are_bounded():
    assert SamplingParams(logit_bias={"42": -100, 7: 1.5}).logit_bias == {42: -100.0, 7: 1.5}
    with pytest.raises(ValueError, match=r"^logit_bias\[3\]=101 is invalid: .*\[-100, 100\]"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match=r"^logit_bias key 'x' is invalid"):
        SamplingParams(logit_bias={"x": 1})


def test_best_of_defaults_to_n_and_is_refused_for_greedy():
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(n=2, temperature=0).best_of == 2
    with pytest.raises(ValueError, match=r"^best_of=3 is invalid with temperature=0"):
        SamplingParams(n=2, best_of=3, temperature=0)
