"""Lab 10 (production): the three small computations a production server adds around sampling
and scheduling: sampling penalties with min-p, the token bitmask of structured outputs, and
goodput under SLOs used to choose a batching setting.

The references are the engine's own:
- penalties and min-p are `apply_penalties` and `apply_min_p`
  (`workbench/sample/logits_processors.py`), called as the sampler calls them
  (`workbench/sample/sampler.py`): penalties on the processed row, then temperature, then min-p
  (transformers' RepetitionPenaltyLogitsProcessor and MinPLogitsWarper give the same rows);
- the bitmask is xgrammar's (the grammar engine of `workbench/sample/grammar.py`), compiled from
  the language's regex over the lab's tiny vocabulary; a pure-Python walk of the language's DFA
  stands in when xgrammar is not importable, and the two are compared when it is;
- goodput is `loadgen.summarize` (`workbench/loadtest/loadgen.py`) on `RequestResult`s built from the
  records.
Each checker runs in well under a second.
"""
from __future__ import annotations

import math
import random

from workbench.course.labs.core import Mismatch, call, exercise
from workbench.sample.logits_processors import History, apply_min_p, apply_penalties
from workbench.sampling_params import SamplingParams
from workbench.loadtest.loadgen import RequestResult, summarize

CHAPTER = "10_production"


# ---------------------------------------------------------------------------- 1. penalties
def reference_process(logits, prompt_ids, output_ids, presence_penalty=0.0,
                      frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0, min_p=0.0):
    """One row through the engine's processors, in the sampler's order."""

    params = SamplingParams(temperature=temperature, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty, min_p=min_p)
    row = apply_penalties(logits[None].clone(), [params],
                          [History(list(prompt_ids), list(output_ids))])[0]
    return apply_min_p(row / temperature, min_p)


def _variant(logits, prompt_ids, output_ids, pres, freq, rep, temp, min_p, mistake=None):
    """The processed row with one typical mistake switched on (None: the right answer)."""
    import torch

    x = logits.clone().double()
    counts_out = torch.zeros_like(x)
    for t in output_ids:
        counts_out[t] += 1
    counts_prompt = torch.zeros_like(x)
    for t in prompt_ids:
        counts_prompt[t] += 1
    counts_all = counts_out + counts_prompt
    if mistake == "temperature_first":
        x = x / temp

    def repetition(x):
        if rep == 1:
            return x
        seen = (counts_out > 0) if mistake == "rep_output_only" else (counts_all > 0)
        if mistake == "rep_multiplies_positive":
            pen = torch.where(x > 0, x * rep, x / rep)
        elif mistake == "rep_divides_all":
            pen = x / rep
        elif mistake == "rep_per_occurrence":
            times = counts_all
            pen = torch.where(x > 0, x / rep ** times, x * rep ** times)
        else:
            pen = torch.where(x > 0, x / rep, x * rep)
        return torch.where(seen, pen, x)

    def additive(x):
        counts = counts_all if mistake == "freq_pres_on_prompt" else counts_out
        freq_term = freq * ((counts > 0).double() if mistake == "freq_once" else counts)
        pres_term = pres * (counts if mistake == "presence_per_occurrence" else
                            (counts > 0).double())
        return x - freq_term - pres_term

    x = repetition(additive(x)) if mistake == "additive_first" else additive(repetition(x))
    raw = x
    if mistake != "temperature_first":
        x = x / temp
    if mistake == "no_temperature":
        x = raw
    if min_p > 0:
        base = raw if mistake == "min_p_raw" else x
        probs = base.softmax(-1)
        if mistake == "min_p_absolute":
            drop = probs < min_p
        elif mistake == "min_p_on_logits":
            drop = base < min_p * base.max()
        else:
            drop = probs < min_p * probs.max()
        x = x.masked_fill(drop, float("-inf"))
    return x


_PENALTY_HINTS = [
    ("freq_pres_on_prompt", "frequency and presence penalties count the *output* tokens only "
     "(what the model itself generated); the prompt's tokens are not penalized by them. Only the "
     "repetition penalty covers prompt and output."),
    ("rep_output_only", "the repetition penalty covers the prompt tokens too (prompt + output), "
     "unlike frequency and presence."),
    ("rep_multiplies_positive", "the repetition penalty makes a seen token less likely: a positive "
     "logit is divided by it, a negative one multiplied by it (you did the opposite)."),
    ("rep_divides_all", "a negative logit divided by the repetition penalty moves toward 0, which "
     "makes the token *more* likely: divide positive logits, multiply negative ones."),
    ("rep_per_occurrence", "the repetition penalty applies once per distinct token that appeared, "
     "not once per occurrence."),
    ("presence_per_occurrence", "the presence penalty is subtracted once for a token that appeared "
     "in the output, whatever its count: counting presence per occurrence makes it a second "
     "frequency penalty."),
    ("freq_once", "the frequency penalty scales with the count: subtract frequency_penalty times "
     "the number of times the token appears in the output."),
    ("additive_first", "vLLM's order: the repetition penalty first (on the raw logits), then "
     "frequency and presence."),
    ("temperature_first", "penalties apply to the raw logits; divide by the temperature after "
     "them, not before."),
    ("no_temperature", "return the tempered logits: divide the penalized logits by the "
     "temperature (min-p masks those)."),
    ("min_p_raw", "min-p applies to the tempered distribution: softmax(penalized / temperature), "
     "not softmax of the logits before temperature."),
    ("min_p_absolute", "min-p's threshold is relative: a token is dropped when its probability is "
     "below min_p times the top token's probability, not below min_p itself."),
    ("min_p_on_logits", "min-p compares probabilities (softmax of the tempered logits), not the "
     "logits themselves."),
]


def _penalty_cases(rng: random.Random):
    """Hand-picked cases that isolate one rule each, then seeded random ones."""
    import torch

    g = torch.Generator().manual_seed(10)
    vocab = 12
    base = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.5, 1.5, 0.0, -0.5, 1.0, 2.5, -3.0, 0.8])
    cases = [
        ("only a presence penalty; token 3 appears twice in the output",
         base, [0, 1], [3, 3, 5], dict(presence_penalty=0.7)),
        ("only a frequency penalty; token 2 appears three times",
         base, [9], [2, 2, 2, 8], dict(frequency_penalty=0.4)),
        ("frequency and presence: tokens 0 and 4 are in the prompt only",
         base, [0, 4, 0], [5, 6], dict(presence_penalty=0.5, frequency_penalty=0.3)),
        ("only a repetition penalty: a positive logit (3) and a negative one (4) in the output",
         base, [], [3, 4], dict(repetition_penalty=1.5)),
        ("only a repetition penalty: tokens 0, 1 and 9 are in the prompt only",
         base, [0, 1, 9], [6], dict(repetition_penalty=1.3)),
        ("only a repetition penalty: negative logits (1, 7, 10) seen",
         base, [7], [1, 10], dict(repetition_penalty=2.0)),
        ("only a repetition penalty: token 3 appears three times",
         base, [3], [3, 3], dict(repetition_penalty=1.4)),
        ("repetition then frequency on the same token",
         base, [], [3, 3, 4], dict(repetition_penalty=2.0, frequency_penalty=1.0)),
        ("temperature 0.5 with a presence penalty, no min-p",
         base, [], [3], dict(presence_penalty=1.0, temperature=0.5)),
        ("min-p 0.3 at temperature 1", base, [], [], dict(min_p=0.3)),
        ("min-p 0.1 at temperature 2.0", base, [], [], dict(min_p=0.1, temperature=2.0)),
        ("min-p 0.05 at temperature 0.7, a repetition penalty", base, [0], [9],
         dict(min_p=0.05, temperature=0.7, repetition_penalty=1.2)),
    ]
    for k in range(10):
        v = rng.choice([16, 50, 200])
        logits = torch.randn(v, generator=g) * rng.choice([1.0, 3.0])
        prompt = [rng.randrange(v) for _ in range(rng.randint(0, 12))]
        output = [rng.randrange(v) for _ in range(rng.randint(0, 20))]
        kw = dict(presence_penalty=rng.choice([0.0, 0.5, -0.3, 1.2]),
                  frequency_penalty=rng.choice([0.0, 0.2, 0.8, -0.1]),
                  repetition_penalty=rng.choice([1.0, 1.1, 1.5, 0.8]),
                  temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
                  min_p=rng.choice([0.0, 0.02, 0.1, 0.3]))
        cases.append((f"random case {k}", logits, prompt, output, kw))
    return cases


def _near_min_p_edge(row, min_p) -> bool:
    """True when a token's probability sits so close to the min-p threshold that float rounding
    could decide it (such cases are skipped)."""
    if min_p <= 0:
        return False
    probs = row.double().softmax(-1)
    ratio = probs / probs.max()
    return bool(((ratio - min_p).abs() < 1e-5).any())


@exercise("production.penalties_min_p", CHAPTER, "process",
          "repetition, frequency and presence penalties, temperature and min-p on one row",
          hint="repetition over prompt + output tokens (positive logits / penalty, negative ones "
               "* penalty, once per distinct token); then subtract frequency_penalty * count and "
               "presence_penalty * (count > 0) over the output tokens only; then divide by the "
               "temperature; then set to -inf every token whose probability under those tempered "
               "logits is below min_p times the top token's.")
def check_penalties_min_p(process) -> None:
    import torch

    rng = random.Random(10)
    for name, logits, prompt, output, kw in _penalty_cases(rng):
        kw = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
              "temperature": 1.0, "min_p": 0.0} | kw
        args = (prompt, output, kw["presence_penalty"], kw["frequency_penalty"],
                kw["repetition_penalty"], kw["temperature"], kw["min_p"])
        pre = reference_process(logits, prompt, output, kw["presence_penalty"],
                                kw["frequency_penalty"], kw["repetition_penalty"], 1.0, 0.0)
        if _near_min_p_edge(pre / kw["temperature"], kw["min_p"]):
            continue
        expected = reference_process(logits, *args)
        shown = [round(v, 3) for v in logits.tolist()]
        listed = str(shown) if len(shown) <= 16 else str(shown[:16])[:-1] + ", ...]"
        what = (f"{name}:\n  process(logits={listed},\n          prompt_ids={prompt}, "
                f"output_ids={output},\n          "
                + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")\n ")
        got = call(process, what, logits.clone(), list(prompt), list(output), *args[2:])
        if got is None:
            raise Mismatch(f"{what} returned None", "your function returned None: did you forget "
                           "`return`?")
        got_t = torch.as_tensor(got).double()
        if tuple(got_t.shape) != tuple(expected.shape):
            raise Mismatch(f"{what} expected a tensor of shape {tuple(expected.shape)}, got shape "
                           f"{tuple(got_t.shape)}", "return one row: the processed logits, the "
                           "same length as the input.")
        exp = expected.double()
        if _rows_match(got_t, exp):
            continue
        hint = ""
        exp_masked = torch.isinf(exp)
        if exp_masked.any() and not torch.isinf(got_t).any() and \
                (got_t[exp_masked] < got_t[~exp_masked].min()).all():
            hint = ("masked tokens are -inf (float('-inf')), not a large negative number or 0: "
                    "softmax must give them probability exactly 0.")
        else:
            for mistake, text in _PENALTY_HINTS:
                wrong = _variant(logits, prompt, output, kw["presence_penalty"],
                                 kw["frequency_penalty"], kw["repetition_penalty"],
                                 kw["temperature"], kw["min_p"], mistake)
                if not _rows_match(wrong, exp) and _rows_match(got_t, wrong):
                    hint = text
                    break
        bad = _first_difference(got_t, exp)
        raise Mismatch(f"{what} at token {bad}: expected {exp[bad].item():.5g}, got "
                       f"{got_t[bad].item():.5g}\n  expected {_fmt(exp)}\n  got      {_fmt(got_t)}",
                       hint)


def _rows_match(a, b, atol: float = 1e-4) -> bool:
    import torch

    a_inf, b_inf = torch.isneginf(a), torch.isneginf(b)
    if not torch.equal(a_inf, b_inf):
        return False
    fin = ~a_inf
    return bool(torch.isfinite(a[fin]).all() and ((a[fin] - b[fin]).abs() <= atol).all())


def _first_difference(a, b) -> int:
    for i in range(a.shape[0]):
        if not _rows_match(a[i:i + 1], b[i:i + 1]):
            return i
    return 0


def _fmt(row) -> str:
    vals = ["-inf" if math.isinf(v) and v < 0 else f"{v:.3f}" for v in row.tolist()[:16]]
    return "[" + ", ".join(vals) + (", ...]" if row.shape[0] > 16 else "]")


# ---------------------------------------------------------------------------- 2. bitmask
DIGITS = "0123456789"


def _dfa(start: int, accepting: list[int], edges: dict[int, dict[str, int]]) -> dict:
    return {"start": start, "accepting": sorted(accepting),
            "next": {s: dict(sorted(e.items())) for s, e in edges.items()}}


def _digits_to(state: int) -> dict[str, int]:
    return {d: state for d in DIGITS}


# Each language: its regex (what xgrammar compiles) and the same language as a DFA (what the
# learner walks). A state missing from "next", or a character missing from a state's edges,
# means no string of the language continues that way.
LANGUAGES = {
    "decimal": (r"[0-9]+(\.[0-9]+)?",
                _dfa(0, [1, 3], {0: _digits_to(1), 1: _digits_to(1) | {".": 2},
                                 2: _digits_to(3), 3: _digits_to(3)})),
    "signed integer": (r"-?[0-9]+",
                       _dfa(0, [2], {0: _digits_to(2) | {"-": 1}, 1: _digits_to(2),
                                     2: _digits_to(2)})),
    "yes or no": (r"(yes|no)",
                  _dfa(0, [3, 5], {0: {"y": 1, "n": 4}, 1: {"e": 2}, 2: {"s": 3}, 4: {"o": 5}})),
    "ab repeated, then !": (r"(ab)+!?",
                            _dfa(0, [2, 3], {0: {"a": 1}, 1: {"b": 2}, 2: {"a": 1, "!": 3}})),
}

# The lab's vocabulary: 38 tokens, so the mask takes two 32-bit words (token 31 is "n", the sign
# bit of the first); EOS is the last id, 37.
VOCAB = ([str(d) for d in range(10)] +
         [".", "-", "12", "3.", ".5", "..", "0.", "1.5", "-7", "--", "a", "b", "ab", "ba", "!",
          "ab!", "y", "yes", "no", "e", "es", "n", "o", " ", "x", "05", "s", "<eos>"])
EOS_ID = len(VOCAB) - 1


def walk(dfa: dict, state: int | None, text: str) -> int | None:
    """The DFA's state after reading text from state (None once no string can continue)."""
    for ch in text:
        if state is None:
            return None
        state = dfa["next"].get(state, {}).get(ch)
    return state


def pack(allowed: list[bool]) -> list[int]:
    """Allowed flags -> int32 words, bit j of word i = token 32 * i + j (two's complement)."""
    words = []
    for i in range(0, len(allowed), 32):
        word = sum(1 << j for j, ok in enumerate(allowed[i:i + 32]) if ok)
        words.append(word - (1 << 32) if word >= 1 << 31 else word)
    return words


def dfa_bitmask(prefix: str, vocab: list[str], eos_id: int, dfa: dict, mistake=None) -> list[int]:
    """The pure-Python reference (with one typical mistake switched on when asked)."""
    here = dfa["start"] if mistake == "prefix_ignored" else walk(dfa, dfa["start"], prefix)
    allowed = []
    for tid, text in enumerate(vocab):
        if tid == eos_id:
            if mistake == "eos_never":
                ok = False
            elif mistake == "eos_always":
                ok = True
            else:
                ok = here in dfa["accepting"]
        elif mistake == "first_char_only":
            ok = walk(dfa, here, text[:1]) is not None
        elif mistake == "must_accept":
            ok = walk(dfa, here, text) in dfa["accepting"]
        else:
            ok = walk(dfa, here, text) is not None
        allowed.append(ok)
    if mistake == "msb_first":
        words = []
        for i in range(0, len(allowed), 32):
            chunk = allowed[i:i + 32]
            word = sum(1 << (31 - j) for j, ok in enumerate(chunk) if ok)
            words.append(word - (1 << 32) if word >= 1 << 31 else word)
        return words
    words = pack(allowed)
    if mistake == "unsigned":
        return [w & 0xFFFFFFFF for w in words]
    if mistake == "padding_ones":
        n = len(vocab)
        if n % 32:
            last = words[-1] & 0xFFFFFFFF
            last |= (0xFFFFFFFF << (n % 32)) & 0xFFFFFFFF
            words[-1] = last - (1 << 32) if last >= 1 << 31 else last
    return words


_XGR: dict = {}


def xgrammar_bitmask(prefix: str, vocab: list[str], eos_id: int, regex: str) -> list[int] | None:
    """xgrammar's bitmask after the text `prefix` (None when xgrammar is not importable).

    The vocabulary is padded to a multiple of 32 ids (`vocab_size`), so the bits past it are 0,
    as for a model whose logits are exactly that wide."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    width = 32 * math.ceil(len(vocab) / 32)
    key = (tuple(vocab), eos_id, regex)
    if key not in _XGR:
        info = xgr.TokenizerInfo(list(vocab), xgr.VocabType.RAW, vocab_size=width,
                                 stop_token_ids=[eos_id])
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        _XGR[key] = compiler.compile_regex(regex)
    matcher = xgr.GrammarMatcher(_XGR[key])
    if prefix and not matcher.accept_string(prefix):
        raise RuntimeError(f"xgrammar rejects the prefix {prefix!r} of {regex!r}: the lab's "
                           "cases are out of date")
    mask = xgr.allocate_token_bitmask(1, width)
    matcher.fill_next_token_bitmask(mask, 0)
    return [int(w) for w in mask[0].tolist()]


def reference_bitmask(prefix: str, vocab: list[str], eos_id: int, language: str) -> list[int]:
    regex, dfa = LANGUAGES[language]
    mine = dfa_bitmask(prefix, vocab, eos_id, dfa)
    theirs = xgrammar_bitmask(prefix, vocab, eos_id, regex)
    if theirs is not None and theirs != mine:
        raise RuntimeError(f"xgrammar and the DFA of {language!r} disagree after {prefix!r}: "
                           f"{theirs} vs {mine}; the lab's languages are out of date")
    return mine


_BITMASK_HINTS = [
    ("unsigned", "the words are int32, two's complement, as in the int32 tensor xgrammar fills: "
     "a word whose bit 31 is set is negative (subtract 2**32)."),
    ("msb_first", "bit j of word i is token 32 * i + j, counting from the least significant bit: "
     "token 0 is 1 << 0, token 31 is bit 31 (the sign bit)."),
    ("padding_ones", "bits past the last token (in the last word) are 0: there is no such token "
     "to allow."),
    ("eos_never", "the EOS bit is set iff the prefix is already a complete match (its DFA state "
     "is accepting): then the request may end there."),
    ("eos_always", "the EOS bit is set only when the prefix is a complete match: ending in the "
     "middle (after '1.' or '-') would leave text outside the language."),
    ("prefix_ignored", "start from the state the prefix leads to: walk the whole prefix from "
     "dfa['start'] first, then try each token from there."),
    ("first_char_only", "a token is allowed iff its *whole* text keeps the prefix inside the "
     "language: walk every character of the token, not only the first."),
    ("must_accept", "a token is allowed when prefix + token can still be completed (the walk "
     "never falls off the DFA); it need not land in an accepting state."),
]

# (language, prefix) pairs: the empty prefix, the middle of a word, complete matches that can and
# cannot continue.
_PREFIXES = [("decimal", ""), ("decimal", "1"), ("decimal", "12."), ("decimal", "3.14"),
             ("signed integer", ""), ("signed integer", "-"), ("signed integer", "-40"),
             ("yes or no", ""), ("yes or no", "y"), ("yes or no", "ye"), ("yes or no", "no"),
             ("ab repeated, then !", ""), ("ab repeated, then !", "a"),
             ("ab repeated, then !", "abab"), ("ab repeated, then !", "ab!")]


def _random_vocab(rng: random.Random) -> tuple[list[str], int]:
    alphabet = DIGITS + ".-abyesno! x"
    size = rng.choice([20, 32, 45, 70])
    vocab: list[str] = []
    while len(vocab) < size - 1:
        tok = "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 1, 2, 3])))
        if tok not in vocab:
            vocab.append(tok)
    eos = rng.randrange(size)
    vocab.insert(eos, "<eos>")
    return vocab, eos


def _bitmask_cases(rng: random.Random):
    cases = [(lang, prefix, VOCAB, EOS_ID) for lang, prefix in _PREFIXES]
    for _ in range(12):
        vocab, eos = _random_vocab(rng)
        lang = rng.choice(list(LANGUAGES))
        _, dfa = LANGUAGES[lang]
        prefix, state = "", dfa["start"]
        for _ in range(rng.randint(0, 5)):          # a random walk inside the language
            moves = list(dfa["next"].get(state, {}).items())
            if not moves:
                break
            ch, state = rng.choice(moves)
            prefix += ch
        cases.append((lang, prefix, vocab, eos))
    return cases


def _show_mask(words: list[int], vocab: list[str], eos_id: int) -> str:
    allowed = [vocab[t] if t != eos_id else "<eos>" for t in range(len(vocab))
               if (words[t // 32] >> (t % 32)) & 1]
    return f"{words} (allows {allowed})"


@exercise("production.regex_bitmask", CHAPTER, "bitmask",
          "the token bitmask that constrains the next token to a regular language",
          hint="walk the prefix through the DFA from dfa['start']; token t (other than EOS) is "
               "allowed iff walking its whole text from there never falls off the DFA; EOS is "
               "allowed iff the prefix's state is accepting; bit t % 32 of word t // 32, "
               "ceil(len(vocab) / 32) int32 words, two's complement.")
def check_regex_bitmask(bitmask) -> None:
    import copy

    rng = random.Random(32)
    for lang, prefix, vocab, eos in _bitmask_cases(rng):
        regex, dfa = LANGUAGES[lang]
        expected = reference_bitmask(prefix, vocab, eos, lang)
        shown = vocab if len(vocab) <= 40 else vocab[:40] + ["..."]
        what = (f"bitmask(prefix={prefix!r}, vocab={shown}, eos_id={eos}, dfa=<{lang}: "
                f"{regex}>)\n ")
        got = call(bitmask, what, prefix, list(vocab), eos, copy.deepcopy(dfa))
        if got is None:
            raise Mismatch(f"{what} returned None", "your function returned None: did you forget "
                           "`return`?")
        try:
            got = [int(w) for w in got]
        except (TypeError, ValueError):
            raise Mismatch(f"{what} expected a list of ints, got {got!r:.120}") from None
        if got == expected:
            continue
        if len(got) != len(expected):
            raise Mismatch(f"{what} expected {len(expected)} words ({len(vocab)} tokens), got "
                           f"{len(got)}: {got}", "one 32-bit word per 32 tokens, the last one "
                           "partly filled: ceil(len(vocab) / 32) words.")
        hint = ""
        for mistake, text in _BITMASK_HINTS:
            wrong = dfa_bitmask(prefix, vocab, eos, dfa, mistake)
            if wrong != expected and wrong == got:
                hint = text
                break
        if not hint and all(-(1 << 31) <= w < (1 << 31) for w in got):
            got_eos = (got[eos // 32] >> (eos % 32)) & 1
            exp_eos = (expected[eos // 32] >> (eos % 32)) & 1
            if got_eos != exp_eos:
                hint = ("the EOS bit is set iff the prefix is a complete match (its state is "
                        "accepting); EOS is never allowed as text.")
        raise Mismatch(f"{what} expected {_show_mask(expected, vocab, eos)}\n  got      "
                       f"{_show_mask(got, vocab, eos)}", hint)


# ---------------------------------------------------------------------------- 3. goodput
SETTINGS = ("max_num_batched_tokens=256", "max_num_batched_tokens=1024",
            "max_num_batched_tokens=4096", "tpot_slo=0.05 (adaptive)")


def make_runs(seed: int = 0, num: int = 60, rate: float = 6.0) -> dict[str, list[dict]]:
    """Per-request records of one request mix served at each setting.

    The numbers are generated, not measured: each setting draws TTFT and TPOT from a shape like
    the chapter's runs (a small prefill budget queues prompts, so TTFT grows; a large one stalls
    decodes behind long prefills, so TPOT grows; the adaptive budget keeps TPOT near its target).
    A few requests fail (no first token)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(rate)
        arrivals.append(t)
    lengths = [rng.choice([1, 8, 32, 64, 128]) for _ in range(num)]
    shapes = {SETTINGS[0]: (1.6, 0.035), SETTINGS[1]: (0.55, 0.05),
              SETTINGS[2]: (0.25, 0.075), SETTINGS[3]: (0.45, 0.045)}
    runs = {}
    for name, (ttft_mean, tpot_mean) in shapes.items():
        records = []
        for arrival, n in zip(arrivals, lengths):
            if rng.random() < 0.04:
                records.append({"arrival": round(arrival, 4), "first_token": None,
                                "finish": round(arrival + rng.uniform(0.01, 0.5), 4),
                                "output_tokens": 0})
                continue
            ttft = ttft_mean * rng.lognormvariate(0, 0.5)
            tpot = tpot_mean * rng.lognormvariate(0, 0.25)
            first = arrival + ttft
            records.append({"arrival": round(arrival, 4), "first_token": round(first, 4),
                            "finish": round(first + tpot * (n - 1), 4), "output_tokens": n})
        runs[name] = records
    return runs


def reference_goodput(records: list[dict], slo_ttft: float, slo_tpot: float) -> float:
    """loadgen.summarize's goodput for the records: the span is the run's duration."""

    if not records:
        return 0.0
    results = []
    for r in records:
        ok = r["first_token"] is not None
        results.append(RequestResult(0, max(1, r["output_tokens"]), ok=ok,
                                     output_tokens=r["output_tokens"],
                                     ttft=r["first_token"] - r["arrival"] if ok else None,
                                     e2e=r["finish"] - r["arrival"]))
    span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
    return summarize(results, span, slo_ttft, slo_tpot)["goodput"]


def _goodput_variant(records, slo_ttft, slo_tpot, mistake=None) -> float:
    def tpot(r):
        if mistake == "tpot_with_first":
            return (r["finish"] - r["arrival"]) / r["output_tokens"]
        if mistake == "tpot_divides_n":
            return (r["finish"] - r["first_token"]) / r["output_tokens"]
        if r["output_tokens"] < 2:
            return None
        return (r["finish"] - r["first_token"]) / (r["output_tokens"] - 1)

    def within(v, slo):
        if v is None:
            return mistake != "one_token_fails"
        return v < slo if mistake == "strict" else v <= slo

    good = 0
    for r in records:
        if r["first_token"] is None:
            continue
        ttft_ok = within(r["first_token"] - r["arrival"], slo_ttft)
        tpot_ok = within(tpot(r), slo_tpot)
        if mistake == "either":
            good += ttft_ok or tpot_ok
        elif mistake == "ttft_only":
            good += ttft_ok
        elif mistake == "tpot_only":
            good += tpot_ok
        else:
            good += ttft_ok and tpot_ok
    completed = sum(r["first_token"] is not None for r in records)
    if mistake == "throughput":
        good = completed
    first = min(r["arrival"] for r in records)
    last = max(r["finish"] for r in records)
    if mistake == "per_request":
        return good / len(records)
    if mistake == "per_completed":
        return good / completed if completed else 0.0
    if mistake == "span_from_zero":
        return good / last
    if mistake == "span_from_first_token":
        return good / (last - min(r["first_token"] for r in records
                                  if r["first_token"] is not None))
    if mistake == "span_completed_only":
        done = [r for r in records if r["first_token"] is not None]
        return good / (max(r["finish"] for r in done) - min(r["arrival"] for r in done))
    if mistake == "sum_of_latencies":
        return good / sum(r["finish"] - r["arrival"] for r in records)
    return good / (last - first)


_GOODPUT_HINTS = [
    ("either", "a good request meets *both* SLOs: TTFT <= slo_ttft and TPOT <= slo_tpot, not "
     "either one."),
    ("ttft_only", "check TPOT too: a good request meets both SLOs."),
    ("tpot_only", "check TTFT too: a good request meets both SLOs."),
    ("throughput", "that is the throughput of completed requests: keep only those within both "
     "SLOs."),
    ("per_request", "goodput is a rate, requests per second: divide by the run's span (last "
     "finish - first arrival), not by the number of requests."),
    ("per_completed", "goodput is a rate, requests per second: divide by the run's span, not by "
     "the number of completed requests."),
    ("tpot_with_first", "TPOT excludes the first token: (finish - first_token) / "
     "(output_tokens - 1), not (finish - arrival) / output_tokens."),
    ("tpot_divides_n", "TPOT is the time per token after the first: (finish - first_token) "
     "covers output_tokens - 1 tokens, so divide by that."),
    ("one_token_fails", "a one-token request has no TPOT (nothing between tokens): it cannot miss "
     "the TPOT SLO, only the TTFT one."),
    ("strict", "a request exactly at its SLO meets it: compare with <=, not <."),
    ("span_from_zero", "the span starts at the first arrival, not at time 0: last finish - first "
     "arrival."),
    ("span_from_first_token", "the span starts at the first arrival, not the first token: last "
     "finish - first arrival."),
    ("span_completed_only", "the span covers every request, failed ones included: the run lasts "
     "from the first arrival to the last finish."),
    ("sum_of_latencies", "the span is the run's wall time (last finish - first arrival); requests "
     "overlap, so their latencies do not add up."),
]


def _goodput_cases(rng: random.Random):
    """(runs, slo_ttft, slo_tpot): small hand-made runs with one trap each, then generated ones
    with a unique best setting."""
    a = {"arrival": 0.0, "first_token": 0.5, "finish": 1.0, "output_tokens": 11}     # tpot .05
    b = {"arrival": 0.5, "first_token": 2.5, "finish": 2.6, "output_tokens": 3}      # ttft 2
    c = {"arrival": 1.0, "first_token": 1.2, "finish": 4.0, "output_tokens": 8}      # tpot .4
    one = {"arrival": 1.5, "first_token": 1.8, "finish": 1.8, "output_tokens": 1}
    fail = {"arrival": 2.0, "first_token": None, "finish": 5.0, "output_tokens": 0}
    d = {"arrival": 0.2, "first_token": 0.4, "finish": 1.4, "output_tokens": 21}     # tpot .05
    cases = [
        ({"fixed": [a, b, c], "adaptive": [a, d]}, 1.0, 0.1),
        ({"fixed": [a, one, c], "adaptive": [b, c]}, 1.0, 0.1),
        ({"fixed": [a, d, one], "adaptive": [a, b, c, fail]}, 2.0, 0.1),
        ({"fixed": [a, d], "adaptive": [a, one, fail]}, 0.5, 0.05),
    ]
    for k in range(6):
        runs = make_runs(seed=100 + k, num=rng.randint(20, 60), rate=rng.choice([3.0, 6.0, 10.0]))
        slo_ttft, slo_tpot = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.04, 0.05, 0.06, 0.08])
        values = sorted(reference_goodput(r, slo_ttft, slo_tpot) for r in runs.values())
        if values[-1] > values[-2]:
            cases.append((runs, slo_ttft, slo_tpot))
    return cases


@exercise("production.goodput", CHAPTER, "best_setting",
          "goodput under TTFT and TPOT SLOs, and the setting that maximises it",
          hint="per setting: of the requests with a first token, count those with TTFT = "
               "first_token - arrival <= slo_ttft and TPOT = (finish - first_token) / "
               "(output_tokens - 1) <= slo_tpot (a one-token request has no TPOT and cannot "
               "miss it); divide by the span, last finish - first arrival over all the run's "
               "records; return the setting with the highest goodput and the dict of goodputs.")
def check_goodput(best_setting) -> None:
    rng = random.Random(11)
    cases = _goodput_cases(rng)
    answers = []                  # every case's answer first: a hint names the mistake that
    for runs, slo_ttft, slo_tpot in cases:     # explains all of them, not only the first case
        answers.append(_call_best_setting(best_setting, runs, slo_ttft, slo_tpot))
    for (runs, slo_ttft, slo_tpot), (what, got) in zip(cases, answers):
        expected = {name: reference_goodput(recs, slo_ttft, slo_tpot)
                    for name, recs in runs.items()}
        best = max(expected, key=expected.get)
        name, goodputs = got
        for setting, value in expected.items():
            g = goodputs[setting]
            if _is_number(g) and math.isclose(g, value, rel_tol=1e-9, abs_tol=1e-12):
                continue
            raise Mismatch(f"{what} goodput of {setting!r}: expected {value!r} requests/s, got "
                           f"{g!r}", _goodput_hint(cases, answers, runs, setting, value, g))
        if name != best:
            raise Mismatch(f"{what} expected the best setting {best!r} (goodputs {expected}), got "
                           f"{name!r}", _choice_hint(cases, answers))


def _is_number(x) -> bool:
    import numbers
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _call_best_setting(best_setting, runs, slo_ttft, slo_tpot):
    sizes = {name: len(recs) for name, recs in runs.items()}
    if all(n <= 4 for n in sizes.values()):
        shown = "\n".join(f"    {name!r}: {recs}" for name, recs in runs.items())
    else:
        shown = "\n".join(f"    {name!r}: {len(recs)} records, the first {recs[0]}"
                          for name, recs in runs.items())
    what = f"best_setting(runs, slo_ttft={slo_ttft}, slo_tpot={slo_tpot}) with runs =\n{shown}\n "
    given = {name: [dict(r) for r in recs] for name, recs in runs.items()}
    try:
        got = call(best_setting, what, given, slo_ttft, slo_tpot)
    except Mismatch as m:
        if isinstance(m.__cause__, TypeError) and "NoneType" in str(m.__cause__):
            raise Mismatch(m.message, "a failed request has first_token None: it never counts, "
                           "so leave it out before computing its TTFT and TPOT (it still "
                           "belongs to the run's span).") from None
        if isinstance(m.__cause__, ZeroDivisionError):
            raise Mismatch(m.message, "a one-token request has no TPOT (output_tokens - 1 is 0): "
                           "it cannot miss the TPOT SLO.") from None
        raise
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], dict)):
        raise Mismatch(f"{what} expected a pair (best setting, {{setting: goodput}}), got "
                       f"{got!r:.200}", "your function returned None: did you forget `return`?"
                       if got is None else "return (name, goodputs).")
    if set(got[1]) != set(runs):
        raise Mismatch(f"{what} the dict's keys should be the settings {sorted(runs)}, got "
                       f"{sorted(map(str, got[1]))}")
    return what, got


def _goodput_hint(cases, answers, runs, setting, value, got) -> str:
    """The hint of the mistake that reproduces this answer and, of those, the most others."""
    if not _is_number(got):
        return "each goodput is a number: requests per second."
    best, best_score = "", -1
    for mistake, text in _GOODPUT_HINTS:
        try:
            wrong = _goodput_variant(runs[setting], *_slos(cases, runs), mistake)
        except (ZeroDivisionError, TypeError, ValueError):
            continue
        if math.isclose(wrong, value, rel_tol=1e-9) or not math.isclose(got, wrong, rel_tol=1e-9):
            continue
        score = 0
        for (r, t, p), (_, (_, goodputs)) in zip(cases, answers):
            for s, recs in r.items():
                try:
                    w = _goodput_variant(recs, t, p, mistake)
                except (ZeroDivisionError, TypeError, ValueError):
                    continue
                score += _is_number(goodputs[s]) and math.isclose(goodputs[s], w, rel_tol=1e-9)
        if score > best_score:
            best, best_score = text, score
    return best


def _slos(cases, runs):
    for r, t, p in cases:
        if r is runs:
            return t, p
    raise KeyError("runs")


def _choice_hint(cases, answers) -> str:
    """Why the chosen settings differ from the best, judged over every case."""
    names = [got[0] for _, got in answers]
    lowest = [min(r, key=lambda s: reference_goodput(r[s], t, p)) for r, t, p in cases]
    most_done = [max(r, key=lambda s: sum(x["first_token"] is not None for x in r[s]))
                 for r, _, _ in cases]
    if names == lowest:
        return "the best setting has the *highest* goodput (use max, not min)."
    if names == most_done:
        return ("pick by goodput, not by completed requests or throughput: a setting that "
                "finishes everything late serves nobody within the SLOs.")
    return "return the setting whose goodput is highest."
