"""StructuredOutputsParams: what a request's output must match (vLLM's names), validated at
construction without importing the grammar engine (grammar.py compiles it)."""
from __future__ import annotations

import json as jsonlib
from collections.abc import Sequence
from dataclasses import dataclass, field

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What one request's output must match; exactly one of the first five fields is set.

    json: a JSON schema, as a dict or a JSON string; the output is one JSON value that validates.
        xgrammar 0.2.9 (its issue #800): a string with minLength/maxLength admits no escape such
        as \\n or \\", and does admit raw control characters (TAB, \\x08) that strict JSON
        parsers reject; parse such output with json.loads(text, strict=False).
    regex: the output matches this regular expression in full (xgrammar's dialect: no lookaround,
        no backreferences).
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's GBNF dialect) whose start rule is named `root`.
    json_object: the output is any JSON object.
    disable_any_whitespace: for json / json_object, allow no free whitespace between tokens (one
        compact line with ", " and ": " separators); by default whitespace is allowed, as in
        vLLM, in runs of at most grammar.MAX_WHITESPACE characters, so that a model cannot emit
        whitespace forever.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    # (kind, canonical text, whitespace flag): the compiled-grammar cache key.
    cache_key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object={self.json_object!r} is invalid: it must be True or "
                             "False")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace={self.disable_any_whitespace!r} is invalid: "
                             "it must be True or False")
        given = [name for name in _FIELDS[:-1] if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            got = ", ".join(f"{name}={getattr(self, name)!r}" for name in given) or "none"
            raise ValueError(f"exactly one of {', '.join(_FIELDS)} must be set; got {got}")
        kind = given[0]
        text = _canonical_text(kind, getattr(self, kind))
        self.cache_key = (kind, text, self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return self.cache_key[0]


def _canonical_text(kind: str, value) -> str:
    """Validate one field's value and return the text that identifies it in the cache."""
    if kind == "json":
        if isinstance(value, str):
            try:
                parsed = jsonlib.loads(value)
            except ValueError as err:
                raise ValueError(f"json={value!r} is invalid: it is not valid JSON ({err})") \
                    from None
        elif isinstance(value, dict):
            parsed = value
        else:
            raise ValueError(f"json={value!r} is invalid: it must be a JSON schema, as a dict or "
                             "a JSON string")
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"json={value!r} is invalid: a JSON schema is an object or a boolean")
        try:
            # Key order stays: xgrammar emits properties in the schema's declared order.
            return jsonlib.dumps(parsed, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"json={value!r} is invalid: it is not JSON-serializable ({err})") \
                from None
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{kind}={value!r} is invalid: it must be a non-empty string")
        return value
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value \
                or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"choice={value!r} is invalid: it must be a non-empty list of "
                             "non-empty strings")
        return jsonlib.dumps(list(value), ensure_ascii=False)
    return ""  # json_object carries no text


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes suit xgrammar)."""
    return "root ::= " + " | ".join(jsonlib.dumps(c, ensure_ascii=False) for c in choices)
