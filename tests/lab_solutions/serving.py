"""Reference solutions and typical wrong answers for lab 08 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "serving.parse_stream": '''
import json

def parse_stream(body):
    text, finish_reason, completion_tokens = "", None, None
    for line in body.splitlines():
        if not line.startswith("data: "):
            continue                                  # the blank lines between events
        if line == "data: [DONE]":
            break
        event = json.loads(line[len("data: "):])
        if event.get("usage"):
            completion_tokens = event["usage"]["completion_tokens"]
        for choice in event["choices"]:
            piece = choice["text"] if "text" in choice else choice["delta"].get("content")
            text += piece or ""
            if choice["finish_reason"] is not None:
                finish_reason = choice["finish_reason"]
    return {"text": text, "finish_reason": finish_reason, "completion_tokens": completion_tokens}
''',
    "serving.request_metrics": '''
def request_metrics(sent, events, done):
    ttft, itl, last, output_tokens = None, [], None, 0
    for t, event in events:
        if event.get("usage"):
            output_tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event["choices"]):
            if ttft is None:
                ttft = t - sent
            else:
                itl.append(t - last)
            last = t
    e2e = done - sent
    tpot = (e2e - ttft) / (output_tokens - 1) if ttft is not None and output_tokens >= 2 else None
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": e2e, "output_tokens": output_tokens}
''',
    "serving.goodput": '''
def goodput(results, duration, slo_ttft=None, slo_tpot=None, slo_e2e=None):
    def within(value, slo):
        return slo is None or value is None or value <= slo
    good = [r for r in results if r["ok"] and within(r["ttft"], slo_ttft)
            and within(r["tpot"], slo_tpot) and within(r["e2e"], slo_e2e)]
    return len(good) / duration
''',
}

WRONG = [
    ("serving.parse_stream", '''
import json

def parse_stream(body):
    text, finish_reason, completion_tokens = "", None, None
    for line in body.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])                  # also the [DONE] line
        for choice in event["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish_reason = choice["finish_reason"] or finish_reason
        if event.get("usage"):
            completion_tokens = event["usage"]["completion_tokens"]
    return {"text": text, "finish_reason": finish_reason, "completion_tokens": completion_tokens}
''', "not JSON"),
    ("serving.parse_stream", '''
import json

def parse_stream(body):
    text, finish_reason, completion_tokens = "", None, None
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        choice = event["choices"][0]                  # the usage chunk has none
        text += choice.get("text") or choice.get("delta", {}).get("content") or ""
        finish_reason = choice["finish_reason"] or finish_reason
    return {"text": text, "finish_reason": finish_reason, "completion_tokens": completion_tokens}
''', "empty choices list"),
    ("serving.parse_stream", '''
import json

def parse_stream(body):
    text, finish_reason, completion_tokens = "", None, None
    for line in body.splitlines():
        if "[DONE]" in line:                          # also matches text that contains it
            break
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        for choice in event["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish_reason = choice["finish_reason"] or finish_reason
        if event.get("usage"):
            completion_tokens = event["usage"]["completion_tokens"]
    return {"text": text, "finish_reason": finish_reason, "completion_tokens": completion_tokens}
''', "exactly 'data: [DONE]'"),
    ("serving.parse_stream", '''
import json

def parse_stream(body):
    text, finish_reason, chunks = "", None, 0
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        for choice in event["choices"]:
            piece = choice.get("text") or choice.get("delta", {}).get("content") or ""
            text += piece
            chunks += bool(piece)                     # one token per chunk: not so
            finish_reason = choice["finish_reason"] or finish_reason
    return {"text": text, "finish_reason": finish_reason, "completion_tokens": chunks}
''', "usage chunk"),
    ("serving.parse_stream", '''
import json

def parse_stream(body):
    text, finish_reason, completion_tokens = "", None, None
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        for choice in event["choices"]:
            text += choice["delta"]["content"] if "delta" in choice else choice["text"]
            finish_reason = choice["finish_reason"] or finish_reason
        if event.get("usage"):
            completion_tokens = event["usage"]["completion_tokens"]
    return {"text": text, "finish_reason": finish_reason, "completion_tokens": completion_tokens}
''', "delta.get('content')"),
    ("serving.request_metrics", '''
def request_metrics(sent, events, done):
    ttft, itl, last, output_tokens = None, [], None, 0
    for t, event in events:
        if event.get("usage"):
            output_tokens = event["usage"]["completion_tokens"]
            continue
        if ttft is None:                              # any chunk, even one without text
            ttft = t - sent
        elif event["choices"][0]["text"]:
            itl.append(t - last)
        last = t
    e2e = done - sent
    tpot = (e2e - ttft) / (output_tokens - 1) if ttft is not None and output_tokens >= 2 else None
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": e2e, "output_tokens": output_tokens}
''', "first chunk with non-empty text"),
    ("serving.request_metrics", '''
def request_metrics(sent, events, done):
    ttft, itl, last, output_tokens = None, [], None, 0
    for t, event in events:
        if event.get("usage"):
            output_tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event["choices"]):
            if ttft is None:
                ttft = t - sent
            else:
                itl.append(t - last)
            last = t
    e2e = done - sent
    tpot = (e2e - ttft) / output_tokens if ttft is not None and output_tokens >= 2 else None
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": e2e, "output_tokens": output_tokens}
''', "output_tokens - 1"),
    ("serving.request_metrics", '''
def request_metrics(sent, events, done):
    ttft, itl, last, output_tokens = None, [], None, 0
    for t, event in events:
        if event.get("usage"):
            output_tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event["choices"]):
            if ttft is None:
                ttft = t - sent
            else:
                itl.append(t - last)
            last = t
    e2e = done - sent
    tpot = sum(itl) / len(itl) if itl else None       # the mean gap between chunks
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": e2e, "output_tokens": output_tokens}
''', "per token"),
    ("serving.request_metrics", '''
def request_metrics(sent, events, done):
    ttft, itl, last, output_tokens = None, [], sent, 0
    for t, event in events:
        if event.get("usage"):
            output_tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event["choices"]):
            if ttft is None:
                ttft = t - sent
            itl.append(t - last)                      # the first gap is the TTFT
            last = t
    e2e = done - sent
    tpot = (e2e - ttft) / (output_tokens - 1) if ttft is not None and output_tokens >= 2 else None
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": e2e, "output_tokens": output_tokens}
''', "not an inter-token gap"),
    ("serving.goodput", '''
def goodput(results, duration, slo_ttft=None, slo_tpot=None, slo_e2e=None):
    good = [r for r in results if r["ok"]
            and (slo_ttft is None or r["ttft"] < slo_ttft)
            and (slo_tpot is None or r["tpot"] is None or r["tpot"] < slo_tpot)
            and (slo_e2e is None or r["e2e"] < slo_e2e)]
    return len(good) / duration
''', "<=, not <"),
    ("serving.goodput", '''
def goodput(results, duration, slo_ttft=None, slo_tpot=None, slo_e2e=None):
    good = [r for r in results if r["ok"]
            and (slo_ttft is None or r["ttft"] <= slo_ttft)
            and (slo_tpot is None or (r["tpot"] is not None and r["tpot"] <= slo_tpot))
            and (slo_e2e is None or r["e2e"] <= slo_e2e)]
    return len(good) / duration
''', "cannot miss the TPOT SLO"),
    ("serving.goodput", '''
def goodput(results, duration, slo_ttft=None, slo_tpot=None, slo_e2e=None):
    good = [r for r in results                        # failed requests too
            if (slo_ttft is None or r["ttft"] <= slo_ttft)
            and (slo_tpot is None or r["tpot"] is None or r["tpot"] <= slo_tpot)
            and (slo_e2e is None or r["e2e"] <= slo_e2e)]
    return len(good) / duration
''', "failed requests"),
    ("serving.goodput", '''
def goodput(results, duration, slo_ttft=None, slo_tpot=None, slo_e2e=None):
    good = [r for r in results if r["ok"]
            and (slo_ttft is None or r["ttft"] <= slo_ttft)
            and (slo_tpot is None or r["tpot"] is None or r["tpot"] <= slo_tpot)
            and (slo_e2e is None or r["e2e"] <= slo_e2e)]
    return len(good) / max(1, len(results))           # a share, not a rate
''', "divide by duration"),
]
