"""Calibration and evaluation text that exists offline on every machine: CPython's documentation.

`pydoc_data.topics.topics` (what `help("assert")` prints) ships with every CPython: English prose
mixed with code and grammar (in 3.11, 79 topics and about 113k SmolLM2 tokens). It is split once,
by topic, into two disjoint parts:

- held-out: topics whose name's SHA-256, read as an integer, is 0 mod 4 (about a quarter);
- calibration: all other topics.

A hash of the name, rather than alternating through the sorted list, keeps neighbours such as
'atom-identifiers' and 'atom-literals' from being spread over both sides in a fixed pattern, and a
topic never changes sides when a CPython release adds or removes other topics (the text of a topic
does change between releases: results are comparable for one Python version).

Topics repeat each other's paragraphs, so calibration also drops every paragraph that shares a
line with the held-out text (`part_paragraphs`; in 3.11 that leaves about 28k held-out and 64k
calibration tokens). Each part is one token stream (its paragraphs in topic-name order, tokenized
without special tokens) cut into non-overlapping windows of `window_len` tokens; the stream's tail
shorter than a window is dropped. Held-out windows are taken in order from the start, so they are
the same for every caller; calibration windows are a seeded random choice among all windows.
"""
from __future__ import annotations

import functools
import hashlib
import random

HELDOUT_MODULUS = 4  # one topic in HELDOUT_MODULUS (by hash) is held out


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics   # imported late: 500 kB of text
    return topics


def is_heldout(topic: str) -> bool:
    """Whether a pydoc topic belongs to the held-out part (a stable function of its name)."""
    digest = hashlib.sha256(topic.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELDOUT_MODULUS == 0


def split_topics() -> tuple[list[str], list[str]]:
    """(calibration topics, held-out topics), each sorted by name; disjoint, together all topics."""
    names = sorted(_topics())
    return ([t for t in names if not is_heldout(t)], [t for t in names if is_heldout(t)])


SHARED_LINE_CHARS = 40   # a line this long found in both parts counts as leaked text


def _long_lines(paragraph: str) -> set[str]:
    return {line.strip() for line in paragraph.split("\n")
            if len(line.strip()) >= SHARED_LINE_CHARS}


def _paragraphs(topics: list[str]) -> list[str]:
    """The topics' paragraphs in order, each distinct paragraph once."""
    texts, seen, out = _topics(), set(), []
    for t in topics:
        for p in texts[t].split("\n\n"):
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def part_paragraphs(part: str) -> list[str]:
    """The paragraphs of one part ("calibration" or "heldout").

    Topics overlap: 'specialnames' repeats 'attribute-access' and 'sequence-types' paragraph for
    paragraph, 'compound' repeats 'with', 'if' and 'else' are the same text. The topic split alone
    would leak held-out text into calibration, so the held-out part keeps its topics whole (each
    repeated paragraph once) and the calibration part drops every paragraph that shares a line of
    SHARED_LINE_CHARS or more characters with the held-out text (short lines such as "   try:"
    are common code, not leaked text)."""
    if part not in ("calibration", "heldout"):
        raise ValueError(f"part={part!r} is invalid: allowed values are 'calibration', 'heldout'")
    calibration, heldout = split_topics()
    held = _paragraphs(heldout)
    if part == "heldout":
        return held
    held_lines = set().union(*map(_long_lines, held))
    return [p for p in _paragraphs(calibration) if not _long_lines(p) & held_lines]


@functools.lru_cache(maxsize=2)
def part_text(part: str) -> str:
    """The text of one part: its paragraphs (topics in name order), separated by blank lines."""
    return "\n\n".join(part_paragraphs(part))


def part_tokens(tokenizer, part: str) -> list[int]:
    """The part's text as one token stream. No BOS or other special tokens: windows are cut
    anywhere in the stream, so a window's first token is ordinary text, as in perplexity
    evaluations on WikiText."""
    return list(tokenizer(part_text(part), add_special_tokens=False)["input_ids"])


def _windows(tokens: list[int], window_len: int) -> list[list[int]]:
    if isinstance(window_len, bool) or not isinstance(window_len, int) or window_len < 2:
        raise ValueError(f"window_len={window_len!r} is invalid: it must be an integer >= 2 "
                         "(a window needs a token to predict)")
    return [tokens[i:i + window_len] for i in range(0, len(tokens) - window_len + 1, window_len)]


def _check_count(num_windows, available: int, window_len: int, part: str) -> None:
    if isinstance(num_windows, bool) or not isinstance(num_windows, int) or num_windows < 1:
        raise ValueError(f"num_windows={num_windows!r} is invalid: it must be an integer >= 1")
    if num_windows > available:
        raise ValueError(f"num_windows={num_windows} is invalid: the {part} text holds "
                         f"{available} windows of window_len={window_len} tokens")


def heldout_windows(tokenizer, num_windows: int, window_len: int) -> list[list[int]]:
    """The first `num_windows` non-overlapping windows of the held-out text."""
    windows = _windows(part_tokens(tokenizer, "heldout"), window_len)
    _check_count(num_windows, len(windows), window_len, "held-out")
    return windows[:num_windows]


def calibration_windows(tokenizer, num_windows: int, window_len: int,
                        seed: int = 0) -> list[list[int]]:
    """`num_windows` distinct non-overlapping windows of the calibration text, chosen at random
    with `seed` (random.Random, so the choice is the same on every machine and Python 3)."""
    windows = _windows(part_tokens(tokenizer, "calibration"), window_len)
    _check_count(num_windows, len(windows), window_len, "calibration")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} is invalid: it must be an integer")
    chosen = random.Random(seed).sample(range(len(windows)), num_windows)
    return [windows[i] for i in chosen]
