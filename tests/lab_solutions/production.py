"""Reference solutions and typical wrong answers for lab 10 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
Each wrong answer is the solution with one line changed, so the mistake it carries is the only one.
"""

PROCESS = '''
import torch

def process(logits, prompt_ids, output_ids, presence_penalty, frequency_penalty,
            repetition_penalty, temperature, min_p):
    logits = logits.clone().float()
    counts = torch.zeros_like(logits)
    for t in output_ids:
        counts[t] += 1
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[list(prompt_ids) + list(output_ids)] = True
    penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0).float()
    logits = logits / temperature
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
'''

BITMASK = '''
def bitmask(prefix, vocab, eos_id, dfa):
    def walk(state, text):
        for ch in text:
            state = dfa["next"].get(state, {}).get(ch)
            if state is None:
                return None
        return state

    here = walk(dfa["start"], prefix)
    allowed = [here in dfa["accepting"] if t == eos_id else walk(here, text) is not None
               for t, text in enumerate(vocab)]
    words = []
    for i in range(0, len(vocab), 32):
        word = sum(1 << j for j, ok in enumerate(allowed[i:i + 32]) if ok)
        words.append(word - (1 << 32) if word >= 1 << 31 else word)
    return words
'''

BEST_SETTING = '''
def best_setting(runs, slo_ttft, slo_tpot):
    goodputs = {}
    for name, records in runs.items():
        good = 0
        for r in records:
            if r["first_token"] is None:
                continue
            ttft = r["first_token"] - r["arrival"]
            n = r["output_tokens"]
            tpot = (r["finish"] - r["first_token"]) / (n - 1) if n >= 2 else None
            if ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot):
                good += 1
        span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
        goodputs[name] = good / span
    return max(goodputs, key=goodputs.get), goodputs
'''

SOLUTIONS = {
    "production.penalties_min_p": PROCESS,
    "production.regex_bitmask": BITMASK,
    "production.goodput": BEST_SETTING,
}


def _mutate(source: str, old: str, new: str) -> str:
    assert old in source, old
    return source.replace(old, new)


WRONG = [
    # penalties and min-p
    ("production.penalties_min_p", _mutate(
        PROCESS, "    for t in output_ids:\n",
        "    for t in list(prompt_ids) + list(output_ids):\n"),
     "output* tokens only"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "logits / repetition_penalty, logits * repetition_penalty",
        "logits * repetition_penalty, logits / repetition_penalty"),
     "you did the opposite"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "logits / repetition_penalty, logits * repetition_penalty",
        "logits / repetition_penalty, logits / repetition_penalty"),
     "multiply negative ones"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "seen[list(prompt_ids) + list(output_ids)] = True",
        "seen[list(output_ids)] = True"),
     "covers the prompt tokens too"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "presence_penalty * (counts > 0).float()", "presence_penalty * counts"),
     "counting presence per occurrence"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "frequency_penalty * counts", "frequency_penalty * (counts > 0).float()"),
     "scales with the count"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "    probs = logits.softmax(-1)\n",
        "    probs = (logits * temperature).softmax(-1)          # before temperature\n"),
     "tempered distribution"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "probs < min_p * probs.max()", "probs < min_p"),
     "threshold is relative"),
    ("production.penalties_min_p", _mutate(
        PROCESS, 'float("-inf"))', "-1e9)"),
     "float('-inf')"),
    ("production.penalties_min_p", _mutate(
        PROCESS, "    logits = logits.clone().float()\n",
        "    logits = logits.clone().float() / temperature\n").replace(
        "    logits = logits / temperature\n", ""),
     "divide by the temperature after"),
    # the token bitmask
    ("production.regex_bitmask", _mutate(
        BITMASK, "        words.append(word - (1 << 32) if word >= 1 << 31 else word)",
        "        words.append(word)"),
     "two's complement"),
    ("production.regex_bitmask", _mutate(
        BITMASK, "sum(1 << j for j,", "sum(1 << (31 - j) for j,"),
     "least significant bit"),
    ("production.regex_bitmask", _mutate(
        BITMASK, "here in dfa[\"accepting\"] if t == eos_id", "False if t == eos_id"),
     "complete match"),
    ("production.regex_bitmask", _mutate(
        BITMASK, "here in dfa[\"accepting\"] if t == eos_id", "True if t == eos_id"),
     "only when the prefix is a complete match"),
    ("production.regex_bitmask", _mutate(
        BITMASK, "walk(here, text) is not None", "walk(here, text[0]) is not None"),
     "*whole* text"),
    ("production.regex_bitmask", _mutate(
        BITMASK, "walk(here, text) is not None", "walk(here, text) in dfa[\"accepting\"]"),
     "need not land in an accepting state"),
    ("production.regex_bitmask", _mutate(
        BITMASK, "    here = walk(dfa[\"start\"], prefix)\n",
        "    here = dfa[\"start\"]\n"),
     "walk the whole prefix"),
    ("production.regex_bitmask", _mutate(
        BITMASK, "for i in range(0, len(vocab), 32):", "for i in range(0, len(vocab) - 31, 32):"),
     "ceil(len(vocab) / 32) words"),
    # goodput and the best setting
    ("production.goodput", _mutate(
        BEST_SETTING, "if ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot):",
        "if ttft <= slo_ttft or (tpot is None or tpot <= slo_tpot):"),
     "meets *both* SLOs"),
    ("production.goodput", _mutate(
        BEST_SETTING, "goodputs[name] = good / span", "goodputs[name] = good / len(records)"),
     "divide by the run's span"),
    ("production.goodput", _mutate(
        BEST_SETTING, 'tpot = (r["finish"] - r["first_token"]) / (n - 1) if n >= 2 else None',
        'tpot = (r["finish"] - r["arrival"]) / n'),
     "TPOT excludes the first token"),
    ("production.goodput", _mutate(
        BEST_SETTING, 'tpot = (r["finish"] - r["first_token"]) / (n - 1) if n >= 2 else None',
        'tpot = (r["finish"] - r["first_token"]) / n'),
     "output_tokens - 1 tokens"),
    ("production.goodput", _mutate(
        BEST_SETTING, "(tpot is None or tpot <= slo_tpot)",
        "(tpot is not None and tpot <= slo_tpot)"),
     "cannot miss the TPOT SLO"),
    ("production.goodput", _mutate(
        BEST_SETTING, "if ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot):",
        "if ttft < slo_ttft and (tpot is None or tpot < slo_tpot):"),
     "<=, not <"),
    ("production.goodput", _mutate(
        BEST_SETTING,
        'span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)',
        'span = max(r["finish"] for r in records)'),
     "not at time 0"),
    ("production.goodput", _mutate(
        BEST_SETTING, "            if r[\"first_token\"] is None:\n                continue\n", ""),
     "first_token None"),
    ("production.goodput", _mutate(
        BEST_SETTING, "            if ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot):\n"
                      "                good += 1\n",
        "            good += 1\n"),
     "throughput of completed requests"),
    ("production.goodput", _mutate(
        BEST_SETTING, "return max(goodputs, key=goodputs.get), goodputs",
        "return min(goodputs, key=goodputs.get), goodputs"),
     "*highest* goodput"),
    ("production.goodput", _mutate(
        BEST_SETTING, "return max(goodputs, key=goodputs.get), goodputs",
        "done = {s: sum(r['first_token'] is not None for r in recs) for s, recs in runs.items()}\n"
        "    return max(done, key=done.get), goodputs"),
     "not by completed requests"),
]
