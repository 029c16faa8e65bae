"""Lab 08 (serving): read a streamed answer, time it the way the load generator does, and count
the requests that met their SLOs.

The references are the engine's own, run in this process without a server or a socket:
- the streams are produced by the server's real FastAPI app (`workbench/serve/app.py`,
  `build_app`), called through httpx's in-process ASGI transport, with a stand-in for the
  AsyncEngine that replays chosen Deltas (text, token ids, finish reason): every byte of the SSE
  body is the server's own serialisation;
- the timings are the load generator's `send` (`workbench/loadtest/loadgen.py`), fed that body through an
  httpx MockTransport and a scripted clock, so its TTFT, ITL, TPOT and e2e are computed by its own
  code from known arrival times;
- goodput is `loadgen.summarize`.
Each checker runs in a few tens of milliseconds. FastAPI is imported on first use only.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from types import SimpleNamespace

from workbench.course.labs.core import Mismatch, call, exercise
from workbench.loadtest import loadgen
from workbench.serve.app import build_app
from workbench.serve.async_engine import Delta
from workbench.loadtest.loadgen import RequestResult, summarize

CHAPTER = "08_serving"


# ---------------------------------------------------------------------------------- streams
class _ReplayStream:
    """What AsyncEngine.submit returns, replaying fixed Deltas."""

    def __init__(self, deltas, num_prompt_tokens: int):
        self._deltas, self.num_prompt_tokens, self.done = list(deltas), num_prompt_tokens, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._deltas:
            raise StopAsyncIteration
        return self._deltas.pop(0)

    def abort(self) -> None:
        self.done = True


class _ReplayEngine:
    """The part of AsyncEngine that build_app touches: the next request replays `deltas`."""

    def __init__(self):
        self.engine = SimpleNamespace(plan=SimpleNamespace(max_model_len=256), tokenizer=None)
        self.metrics, self.error, self.deltas, self.stopping = None, None, [], False

    async def submit(self, prompt, params, priority=0, prompt_tokens=1):
        stream = _ReplayStream(self.deltas, num_prompt_tokens=7)
        stream.n = params.n
        return stream

    def shutdown(self, timeout: float = 0.0) -> None:
        pass


_APP: dict = {}


def _in_thread(coro_factory):
    """asyncio.run on a thread of its own: a notebook's kernel already runs an event loop."""
    box: dict = {}

    def target():
        try:
            box["result"] = asyncio.run(coro_factory())
        except BaseException as err:          # re-raised in the caller's thread
            box["error"] = err
    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def server_stream(deltas: list[tuple], chat: bool = False, include_usage: bool = True) -> str:
    """The SSE body the server sends for a streamed request whose engine output is `deltas`:
    (text, number of tokens[, finish_reason]) per engine step, the last one finishing the request.
    Produced by the server's own app, in-process."""
    import httpx


    if "app" not in _APP:
        _APP["engine"] = _ReplayEngine()
        _APP["app"] = build_app(_APP["engine"], "smollm2")
    engine, out = _APP["engine"], []
    next_id = 1000
    for i, d in enumerate(deltas):
        text, n = d[0], d[1]
        ids = list(range(next_id, next_id + n))
        next_id += n
        last = i == len(deltas) - 1
        out.append(Delta(text, ids, finished=last, finish_reason=(d[2] if len(d) > 2 else "length")
                         if last else None))
    engine.deltas = out
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "smollm2", "stream": True, "max_tokens": 64,
            "stream_options": {"include_usage": include_usage}}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hello!"}]
    else:
        body["prompt"] = [1, 2, 3, 4, 5, 6, 7]

    async def post():
        transport = httpx.ASGITransport(app=_APP["app"])
        async with httpx.AsyncClient(transport=transport, base_url="http://lab") as client:
            r = await client.post(path, json=body)
            r.raise_for_status()
            return r.text
    return _in_thread(post)


# Engine outputs, one tuple per engine step: (text, tokens[, finish_reason of the last]).
# An empty text with tokens is text held back (a partial UTF-8 character or a possible stop
# string); a step can release the text of several tokens at once; the last step of a request
# stopped by a stop string brings no text.
_STREAMS = {
    "three tokens": [("Hello", 1), (" world", 1), ("!", 1, "length")],
    "held-back text, a quoted [DONE] in the text, a stop string":
        [("", 1), ('é "data: [DONE]"\n', 2), ("", 0, "stop")],
    "one token": [("Hi", 1, "length")],
    "unicode and blank lines in the text":
        [("日本語", 2), (" 🙂", 1), ("\n\n", 1), ("data: x", 2, "length")],
    "aborted": [("ab", 1), ("", 0, "abort")],
    "nothing generated": [("", 0, "abort")],
}


# ---------------------------------------------------------------------------------- 1. parse
def _crash_hint(err: BaseException | None) -> str:
    """A hint for the ways a stream parser typically crashes."""
    if isinstance(err, json.JSONDecodeError):
        doc = (err.doc or "").strip()
        if doc == "[DONE]" or doc.endswith("[DONE]"):
            return ("the stream ends with the line `data: [DONE]`, which is not JSON: stop "
                    "there instead of parsing it.")
        if not doc:
            return ("events are separated by blank lines: skip every line that does not "
                    "start with 'data: '.")
        if doc.startswith("data:"):
            return "strip the 'data: ' prefix before json.loads."
        return ("json.loads takes one event's payload: split the body into lines first, and "
                "parse what follows 'data: ' on each.")
    if isinstance(err, IndexError):
        return ("with stream_options.include_usage the last chunk before [DONE] carries the usage "
                "and an empty choices list: check `if event['choices']` before reading "
                "choices[0].")
    if isinstance(err, KeyError) and err.args and err.args[0] == "content":
        return ("a chat chunk's delta may have no 'content' (the chunk that carries the finish "
                "reason has delta {}): use delta.get('content').")
    if isinstance(err, KeyError) and err.args and err.args[0] in ("text", "delta"):
        return ("/v1/completions chunks carry choices[0]['text']; /v1/chat/completions chunks "
                "carry choices[0]['delta'], with an optional 'content'. Handle both.")
    if isinstance(err, KeyError) and err.args and err.args[0] == "usage":
        return "only the last chunk (and only with include_usage) has 'usage': use .get."
    if isinstance(err, TypeError) and "NoneType" in str(err):
        return "fields can be null (None): finish_reason until the end, usage when not asked."
    return ""


def _call_with_hints(fn, what: str, *args):
    try:
        return call(fn, what, *args)
    except Mismatch as m:
        hint = _crash_hint(m.__cause__)
        if hint:
            raise Mismatch(m.message, hint) from None
        raise


@exercise("serving.parse_stream", CHAPTER, "parse_stream",
          "the text, finish reason and token count of a streamed OpenAI response",
          hint="for each line: skip it unless it starts with 'data: '; stop at 'data: [DONE]'; "
               "json.loads the rest. A chunk with usage gives completion_tokens; a chunk with "
               "choices gives text (choices[0]['text'], or choices[0]['delta'].get('content') in "
               "chat) and, when not null, the finish_reason.")
def check_parse_stream(parse_stream) -> None:
    for name, deltas in _STREAMS.items():
        for chat in (False, True):
            for include_usage in (True, False):
                body = server_stream(deltas, chat, include_usage)
                expected = {"text": "".join(d[0] for d in deltas),
                            "finish_reason": deltas[-1][2] if len(deltas[-1]) > 2 else "length",
                            "completion_tokens": sum(d[1] for d in deltas) if include_usage
                            else None}
                endpoint = "/v1/chat/completions" if chat else "/v1/completions"
                shown = "\n".join("    " + line for line in body.splitlines() if line)
                what = (f"parse_stream(body) for a {endpoint} stream ({name}; include_usage="
                        f"{include_usage}); the body (blank lines between the events left "
                        f"out):\n{shown}\n ")
                got = _call_with_hints(parse_stream, what, body)
                if not isinstance(got, dict):
                    raise Mismatch(f"{what} expected a dict like {expected!r}, got "
                                   f"{type(got).__name__} {got!r:.100}",
                                   "return {'text': ..., 'finish_reason': ..., "
                                   "'completion_tokens': ...}." if got is not None else
                                   "your function returned None: did you forget `return`?")
                missing = [k for k in expected if k not in got]
                if missing:
                    raise Mismatch(f"{what} the dict has no key {missing[0]!r} (expected "
                                   f"{expected!r}, got {got!r})")
                got = {k: got[k] for k in expected}
                if got == expected:
                    continue
                hint = ""
                if got["text"] != expected["text"]:
                    if isinstance(got["text"], str) and expected["text"].startswith(got["text"]) \
                            and "[DONE]" in expected["text"]:
                        hint = ("you stopped at a chunk whose *text* contains [DONE]: the stream "
                                "ends at the line that is exactly 'data: [DONE]', not at any "
                                "line containing it.")
                    elif isinstance(got["text"], str) and \
                            "".join(got["text"].split()) == "".join(expected["text"].split()):
                        hint = ("keep the text exactly as sent, newlines and spaces included: "
                                "join the pieces with '' and strip nothing.")
                    elif isinstance(got["text"], str) and "\\u" in got["text"]:
                        hint = "json.loads decodes the \\u escapes: do not parse JSON by hand."
                elif got["finish_reason"] != expected["finish_reason"]:
                    hint = ("the finish reason arrives with the last chunk that has a choice "
                            "(null before it; the usage chunk after it has no choices): keep "
                            "the last one that is not null.")
                elif got["completion_tokens"] != expected["completion_tokens"]:
                    if expected["completion_tokens"] is None:
                        hint = ("without stream_options.include_usage the server sends no usage "
                                "chunk: completion_tokens is None, not a count of chunks.")
                    else:
                        hint = ("take completion_tokens from the usage chunk: a chunk may carry "
                                "several tokens, or none (text held back), so counting chunks "
                                "is not counting tokens.")
                raise Mismatch(f"{what} expected {expected!r}\n  got      {got!r}", hint)


# ---------------------------------------------------------------------------------- 2. timing
def _timed_events(body: str, rng: random.Random) -> tuple[float, list[tuple[float, dict]], float]:
    """Arrival times for the body's events: the send time, (time, event) per `data:` line other
    than [DONE], and the time the stream closed."""
    sent = round(rng.uniform(100, 1000), 3)
    t, events = sent, []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            t += rng.choice([0.004, 0.012, 0.03, 0.09, 0.35])
            events.append((round(t, 6), json.loads(line[6:])))
    return sent, events, round(t + rng.choice([0.001, 0.02]), 6)


def _loadgen_measure(body: str, sent: float, events, done: float):
    """The load generator's own `send`, given `body` by a mock transport and the arrival times
    by a scripted clock: it reads the clock when it sends, at every event, and at the end."""
    import httpx


    clock = iter([sent] + [t for t, _ in events] + [done])

    class ScriptedTime:
        @staticmethod
        def perf_counter() -> float:
            return next(clock)

    def reply(request):
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def measure():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            return await loadgen.send(client, "http://lab", None,
                                      {"prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 64}, {})

    real = loadgen.time
    loadgen.time = ScriptedTime           # only for this call; restored below
    try:
        res = _in_thread(measure)
    finally:
        loadgen.time = real
    if next(clock, None) is not None or res.error:
        raise RuntimeError(f"the load generator read the clock differently ({res.error}): the "
                           "lab's reference is out of date")
    return res


def _same(a, b, tol: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, list) or isinstance(b, list):
        return (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
                and all(_same(x, y, tol) for x, y in zip(a, b)))
    try:
        return isinstance(a, (int, float)) and not isinstance(a, bool) and \
            math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=tol)
    except (TypeError, ValueError):
        return False


def _text_times(events) -> list[float]:
    return [t for t, e in events for c in e.get("choices", []) if c.get("text")]


@exercise("serving.request_metrics", CHAPTER, "request_metrics",
          "TTFT, ITL, TPOT and end-to-end latency of one streamed request",
          hint="only chunks with non-empty text count: TTFT = first such arrival - sent; ITL = "
               "gaps between consecutive such arrivals; output_tokens from the usage chunk; "
               "e2e = done - sent; TPOT = (e2e - TTFT) / (output_tokens - 1), None below 2 "
               "tokens or without a first token.")
def check_request_metrics(request_metrics) -> None:
    rng = random.Random(8)
    streams = dict(_STREAMS)
    streams["two tokens in one chunk"] = [("ab", 2, "length")]
    for j in range(3):          # longer runs: random token counts, some text held back
        streams[f"random {j}"] = [("" if rng.random() < 0.25 else f" w{k}", rng.randint(1, 3))
                                  for k in range(rng.randint(4, 12))] + [("", 0, "stop")]
    for name, deltas in streams.items():
        body = server_stream(deltas, chat=False, include_usage=True)
        sent, events, done = _timed_events(body, rng)
        res = _loadgen_measure(body, sent, events, done)
        expected = {"ttft": res.ttft, "itl": res.itl, "tpot": res.tpot, "e2e": res.e2e,
                    "output_tokens": res.output_tokens}
        shown = "\n".join(f"    {t:.3f}: {json.dumps(e)[:150]}" for t, e in events)
        what = (f"request_metrics(sent={sent}, events=[...], done={done}) for a /v1/completions "
                f"stream ({name}); the events:\n{shown}\n ")
        got = _call_with_hints(request_metrics, what, sent, [(t, json.loads(json.dumps(e)))
                                                             for t, e in events], done)
        if not isinstance(got, dict):
            raise Mismatch(f"{what} expected a dict with keys {list(expected)}, got "
                           f"{type(got).__name__}",
                           "your function returned None: did you forget `return`?"
                           if got is None else "")
        # Causes before effects: TPOT is computed from e2e, TTFT and the token count.
        for key in ("output_tokens", "ttft", "itl", "e2e", "tpot"):
            if key not in got:
                raise Mismatch(f"{what} the dict has no key {key!r}")
            if _same(got[key], expected[key]):
                continue
            texts = _text_times(events)
            n = expected["output_tokens"]
            hint = ""
            if key == "ttft" and events and _same(got[key], events[0][0] - sent):
                hint = ("the first event carried no text (held back, or only the usage): TTFT is "
                        "the arrival of the first chunk with non-empty text.")
            elif key == "ttft" and expected["ttft"] is None:
                hint = "no chunk had any text: there is no first token, so TTFT is None."
            elif key == "itl" and texts and _same(got[key], [texts[0] - sent] + res.itl):
                hint = ("the wait for the first token is TTFT, not an inter-token gap: ITL starts "
                        "at the second chunk with text.")
            elif key == "itl" and isinstance(got[key], list) and len(got[key]) > len(res.itl):
                hint = ("only chunks with non-empty text count: a chunk with empty text (held "
                        "back, the finish reason, the usage) brings no token to the screen.")
            elif key == "output_tokens" and got[key] == len(texts):
                hint = ("a chunk may carry several tokens (text released at once) or none: take "
                        "the count from the usage chunk's completion_tokens.")
            elif key == "e2e" and texts and _same(got[key], texts[-1] - sent):
                hint = ("end-to-end runs until the stream is over (`done`), not to the last text: "
                        "the finish and usage chunks come after it.")
            elif key == "itl" and not isinstance(got[key], list):
                hint = "itl is a Python list of floats (empty with at most one text chunk)."
            elif key == "tpot" and expected["tpot"] is None:
                hint = ("with fewer than 2 output tokens (or no first token) there is no time "
                        "*between* tokens: TPOT is None.")
            elif key == "tpot" and n and _same(got[key], (res.e2e - res.ttft) / n):
                hint = ("the first token's time is TTFT: the e2e - TTFT that follows it covers "
                        "output_tokens - 1 tokens, so divide by that.")
            elif key == "tpot" and res.itl and _same(got[key], sum(res.itl) / len(res.itl)):
                hint = ("the mean ITL is per chunk, and a chunk may carry several tokens: TPOT is "
                        "(e2e - TTFT) / (output_tokens - 1), per token.")
            raise Mismatch(f"{what} {key}: expected {expected[key]!r}, got {got[key]!r}", hint)


# ---------------------------------------------------------------------------------- 3. goodput
def _results(rng: random.Random, num: int):
    """Seeded RequestResults as the load generator records them: most complete, a few fail
    (an HTTP error before any token: no TTFT, no e2e; or a stream that ended without text)."""
    out = []
    for _ in range(num):
        r = RequestResult(prompt_tokens=rng.randint(8, 256), max_tokens=64)
        u = rng.random()
        if u < 0.08:
            r.error = "HTTP 503: the server is shutting down"
        elif u < 0.12:
            r.e2e = round(rng.uniform(0.05, 2), 3)           # finished, but never sent text
        else:
            r.ok = True
            r.output_tokens = rng.choice([1, 2, 8, 32, 64])
            r.ttft = round(rng.choice([0.1, 0.25, 0.5, 1.0, 2.0]) * rng.uniform(0.5, 1.5), 3)
            tpot = rng.choice([0.02, 0.05, 0.1]) * rng.uniform(0.5, 1.5)
            r.e2e = round(r.ttft + tpot * (r.output_tokens - 1), 4)
        out.append(r)
    return out


def _as_dict(r) -> dict:
    return {"ok": r.ok, "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e,
            "output_tokens": r.output_tokens}


def _good(results, slo_ttft, slo_tpot, slo_e2e, strict=False, tpot_none_fails=False):
    """Count of requests meeting the SLOs, with one of the typical mistakes switched on."""
    def meets(value, slo):
        if slo is None:
            return True
        if value is None:
            return not tpot_none_fails
        return value < slo if strict else value <= slo
    return sum(1 for r in results if r.ok and meets(r.ttft, slo_ttft) and meets(r.tpot, slo_tpot)
               and meets(r.e2e, slo_e2e))


@exercise("serving.goodput", CHAPTER, "goodput",
          "completed requests per second that met every SLO",
          hint="keep the requests with ok true; of those, the ones whose ttft, tpot and e2e are "
               "each within their SLO (<=), where an SLO of None sets no limit and a tpot of "
               "None (one output token) cannot miss it; divide their number by duration.")
def check_goodput(goodput) -> None:

    rng = random.Random(5)
    one_token = RequestResult(8, 1, ok=True, output_tokens=1, ttft=0.4, e2e=0.4)
    on_the_line = RequestResult(8, 16, ok=True, output_tokens=11, ttft=0.5, e2e=1.5)   # tpot 0.1
    failed = RequestResult(8, 16, error="HTTP 500")
    # One trap per hand-picked case, so that the hint can name it: a one-token request under a
    # TPOT SLO, a request exactly at its SLOs, no SLO at all, only failures, no requests.
    cases = [([one_token, failed], 2.0, None, 0.1, None),
             ([on_the_line, failed], 2.0, 0.5, 0.1, 1.5),
             ([one_token, on_the_line], 1.0, None, 0.05, None),
             ([one_token, on_the_line, failed], 4.0, None, None, None),
             ([failed, failed], 3.0, 1.0, None, None),
             ([], 1.0, 1.0, None, None)]
    for _ in range(12):
        results = _results(rng, rng.randint(5, 40))
        cases.append((results, round(rng.uniform(2, 30), 2), rng.choice([None, 0.3, 0.5, 1.0]),
                      rng.choice([None, 0.03, 0.05, 0.1]), rng.choice([None, None, 2.0, 4.0])))
    for results, duration, slo_ttft, slo_tpot, slo_e2e in cases:
        expected = summarize(results, duration, slo_ttft, slo_tpot, slo_e2e)["goodput"]
        given = [_as_dict(r) for r in results]
        shown = ("[" + ",\n   ".join(map(str, given[:8])) +
                 (f",\n   ... {len(given) - 8} more" if len(given) > 8 else "") + "]")
        what = (f"goodput(results, duration={duration}, slo_ttft={slo_ttft}, slo_tpot={slo_tpot},"
                f" slo_e2e={slo_e2e}) with results =\n  {shown}\n ")
        try:
            got = call(goodput, what, given, duration, slo_ttft, slo_tpot, slo_e2e)
        except Mismatch as m:
            if isinstance(m.__cause__, TypeError) and "NoneType" in str(m.__cause__):
                raise Mismatch(m.message, "a failed request (ok False) has no ttft, and a "
                               "one-token request no tpot; an SLO may be None (no limit): "
                               "leave out the failed requests first, and compare only values "
                               "and limits that are not None.") from None
            raise
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise Mismatch(f"{what} expected a number (requests per second), got "
                           f"{type(got).__name__} {got!r:.80}",
                           "your function returned None: did you forget `return`?"
                           if got is None else "")
        if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
            continue
        hint = ""
        done = [r for r in results if r.ok]
        if results and math.isclose(got, expected * duration / len(results), rel_tol=1e-9):
            hint = ("goodput is a rate, requests per second: divide by duration, not by the "
                    "number of requests.")
        elif math.isclose(got, _good(results, slo_ttft, slo_tpot, slo_e2e, strict=True)
                          / duration, rel_tol=1e-9):
            hint = "a request exactly at its SLO meets it: compare with <=, not <."
        elif math.isclose(got, _good(results, slo_ttft, slo_tpot, slo_e2e,
                                     tpot_none_fails=True) / duration, rel_tol=1e-9):
            hint = ("a one-token request has no TPOT (None): there is no time between tokens "
                    "to be too slow, so it cannot miss the TPOT SLO.")
        elif math.isclose(got, len(done) / duration, rel_tol=1e-9):
            hint = "that is the throughput of completed requests: keep only those within the SLOs."
        elif math.isclose(got, len(results) / duration, rel_tol=1e-9) or math.isclose(
                got, sum(1 for r in results if _meets_all_ignoring_ok(r, slo_ttft, slo_tpot,
                                                                     slo_e2e)) / duration,
                rel_tol=1e-9):
            hint = "failed requests (ok false) never count, whatever their times."
        elif got == 0 and expected > 0 and None in (slo_ttft, slo_tpot, slo_e2e):
            hint = "an SLO of None means no limit on that metric, not a limit of 0."
        raise Mismatch(f"{what} expected {expected!r} requests/s, got {got!r}", hint)


def _meets_all_ignoring_ok(r, slo_ttft, slo_tpot, slo_e2e) -> bool:
    checks = ((r.ttft, slo_ttft), (r.tpot, slo_tpot), (r.e2e, slo_e2e))
    return all(s is None or v is None or v <= s for v, s in checks)
