"""AsyncEngine: the engine on a thread of its own, requests from asyncio coroutines.

The engine is not thread-safe, so exactly one thread touches it. Coroutines post commands (add a
request, abort one) on a queue and get their answers through futures on their event loop; after
every step the engine thread publishes each live request's new output as a `Delta` on the
request's asyncio.Queue (loop.call_soon_threadsafe). A request's stream ends with a Delta whose
`finished` is true, carrying the RequestOutput (with its metrics).

Admission control (admission.py) reads plain attributes instead of asking the thread: the
coroutine side counts what it submitted (`num_submitted`, `submitted_tokens`), the engine thread
counts what it took off the command queue (`num_taken`, `taken_tokens`) and publishes, after
each step, its waiting sequences and their prompt tokens. Each counter has one writer.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.llm import LLM
from workbench.engine.output_processor import OutputProcessor
from workbench.outputs import Logprob, RequestOutput
from workbench.sampling_params import SamplingParams
from workbench.serve.admission import Admission, QueueState


@dataclass
class Delta:
    """What one choice of a request produced since its previous Delta. A request with n > 1
    streams its choices interleaved, each with its `index`; `finished` ends a choice, `last` the
    request (the Delta that carries the RequestOutput)."""
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None   # one dict per new token, when asked
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = field(default=None, repr=False)   # on the last Delta
    index: int = 0
    last: bool = False


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # index: (text, tokens) sent
    num_prompt_tokens: int = 0
    last_token_time: float | None = None
    scheduled: bool = False


class EngineStopped(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, llm: LLM, metrics=None, admission: Admission | None = None,
                 max_prompt_tokens: int | None = None):
        """metrics: a ServerMetrics (metrics.py), fed on the engine thread: every step record,
        every gap between a request's tokens, every finished request. admission: the waiting
        bounds checked at submit. max_prompt_tokens: refuse longer prompts (after tokenizing)."""
        self.llm, self.engine = llm, llm.engine
        self.metrics = metrics
        self.admission = admission
        self.max_prompt_tokens = max_prompt_tokens
        # Written by the coroutine side only.
        self.num_submitted = 0
        self.submitted_tokens = 0
        # Written by the engine thread only.
        self.num_taken = 0
        self.taken_tokens = 0
        self.num_waiting = 0
        self.waiting_prompt_tokens = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._shutdown_lock = threading.Lock()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="workbench-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the coroutine side
    async def submit(self, prompt: str | list[int] | Callable, params: SamplingParams,
                     priority: int = 0, request_id: str | None = None,
                     prompt_tokens: int = 1) -> "RequestStream":
        """Queue one request; returns its stream of Deltas once the engine accepted it. `prompt`
        may be a callable returning token ids (run on the engine thread: chat templates use the
        engine's tokenizer). `prompt_tokens` estimates its prompt length for the admission
        bounds (a Refusal past them). An invalid request raises the engine's ValueError here."""
        if self._stopping:
            raise EngineStopped("the server is shutting down")
        if self.error is not None:
            raise EngineStopped(f"the engine failed: {self.error!r}")
        if self.admission is not None:
            self.admission.admit(self.queue_state(), prompt_tokens)
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(loop, asyncio.Queue())
        added = loop.create_future()
        self.num_submitted += 1
        self.submitted_tokens += prompt_tokens
        self._post(("add", request_id, prompt, params, priority, stream, added, prompt_tokens))
        await added
        return RequestStream(self, request_id, stream, params.n)

    def queue_state(self) -> QueueState:
        """Accepted but not yet scheduled: in the command queue, or waiting in the engine. The
        engine thread publishes its counts before it counts the commands it took, so a request
        in between is counted twice rather than missed."""
        taken, taken_tokens = self.num_taken, self.taken_tokens
        return QueueState(self.num_submitted - taken + self.num_waiting,
                          self.submitted_tokens - taken_tokens + self.waiting_prompt_tokens)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _post(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while True:
                self._drain_commands()
                if self._stopping and not self._streams:
                    return
                if self.engine.has_unfinished_requests():
                    before = len(self.engine.trace)
                    self.engine.step()
                    if self.metrics is not None and len(self.engine.trace) > before:
                        self.metrics.observe_step(self.engine, self.engine.trace[-1])
                    self._publish()
                    self._publish_waiting()
                else:
                    if self.metrics is not None:
                        self.metrics.idle(self.engine)
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as err:                  # the engine broke: fail every stream
            self.error = err
            for rid, stream in list(self._streams.items()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
            self._streams.clear()

    def _drain_commands(self) -> None:
        handled = taken = taken_tokens = 0
        try:
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    return
                handled += 1
                if command[0] == "add":
                    taken += 1
                    taken_tokens += command[7]
                self._handle(command)
        finally:
            if handled:
                self._publish_waiting()
                self.num_taken += taken
                self.taken_tokens += taken_tokens

    def _handle(self, command) -> None:
        if command[0] == "add":
            _, rid, prompt, params, priority, stream, added, _ = command
            try:
                if callable(prompt):
                    prompt = prompt()
                self.engine.add_request(prompt, params, request_id=rid, priority=priority)
                n = len(self.engine.get_sequence(rid).prompt_token_ids)
                if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
                    self.engine.abort_request(rid)
                    raise ValueError(f"prompt is too long: {n} tokens, and this server "
                                     f"allows at most {self.max_prompt_tokens} "
                                     "(--max-prompt-tokens)")
                stream.num_prompt_tokens = n
                self._streams[rid] = stream
                stream.loop.call_soon_threadsafe(_resolve, added, None)
            except Exception as err:               # ValueError: the request is invalid
                stream.loop.call_soon_threadsafe(_resolve, added, err)
        elif command[0] == "abort":
            rid = command[1]
            if self._streams.pop(rid, None) is not None:
                self.engine.abort_request(rid)
        elif command[0] == "stop":
            self._stopping = True
            for rid in list(self._streams):        # whatever is still running ends here
                stream = self._streams.pop(rid)
                self.engine.abort_request(rid)
                stream.loop.call_soon_threadsafe(
                    stream.queue.put_nowait, Delta("", [], finished=True,
                                                   finish_reason="abort", last=True))

    def _publish_waiting(self) -> None:
        waiting = [seq for s in self.engine.schedulers for seq in s.waiting]
        self.waiting_prompt_tokens = sum(seq.num_prompt_tokens for seq in waiting)
        self.num_waiting = len(waiting)

    def _publish(self) -> None:
        for rid, stream in list(self._streams.items()):
            seq = self.engine.get_sequence(rid)
            if not stream.scheduled and seq.first_scheduled_time is not None:
                stream.scheduled = True            # it left the waiting queue: the drain rate
                if self.admission is not None:
                    self.admission.drain.note()
            deltas = []
            if not seq.params.ranks_samples:       # best_of's winners are known only at the end
                for member in seq.members or [seq]:
                    delta = self._member_delta(stream, member)
                    if delta is not None:
                        deltas.append(delta)
            if seq.group_finished:
                output = self.engine.pop_output(rid)
                del self._streams[rid]
                if seq.params.ranks_samples:
                    deltas = [Delta(c.text, c.token_ids, c.logprobs, True, c.finish_reason,
                                    index=c.index) for c in output.outputs]
                last = deltas[-1] if deltas else Delta("", [], finished=True,
                                                       finish_reason=seq.finish_reason)
                if not deltas:
                    deltas.append(last)
                last.output, last.last = output, True
                if self.metrics is not None:
                    self.metrics.observe_finished(output, stream.num_prompt_tokens)
            for delta in deltas:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _member_delta(self, stream: _Stream, seq) -> Delta | None:
        """One sample's new text and tokens since its last Delta (None if nothing new)."""
        text_sent, tokens_sent = stream.sent.get(seq.index, (0, 0))
        if tokens_sent < 0:                        # this choice already said it finished
            return None
        stable = OutputProcessor.stable_text_len(seq)
        new_tokens = len(seq.output_token_ids) - tokens_sent
        if stable <= text_sent and not new_tokens and not seq.is_finished:
            return None
        delta = Delta(seq.text[text_sent:max(stable, text_sent)],
                      seq.output_token_ids[tokens_sent:],
                      seq.logprobs[tokens_sent:] if seq.logprobs is not None else None,
                      index=seq.index)
        stream.sent[seq.index] = (max(text_sent, stable), len(seq.output_token_ids))
        if new_tokens and self.metrics is not None and seq.index == 0:
            if stream.last_token_time is not None:   # tokens of one step share the gap
                gap = (seq.last_token_time - stream.last_token_time) / new_tokens
                for _ in range(new_tokens):
                    self.metrics.observe_token_gap(gap)
            stream.last_token_time = seq.last_token_time
        if seq.is_finished:
            delta.finished, delta.finish_reason = True, seq.finish_reason
            stream.sent[seq.index] = (0, -1)
        return delta

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 10.0) -> None:
        """Let running requests finish for up to `timeout` seconds, then abort the rest (their
        streams end with finish_reason "abort"), stop the thread and close the LLM."""
        with self._shutdown_lock:                      # a signal and the app's lifespan both call it
            self._stopping = True
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._post(("stop",))
                self._thread.join(10)
            self.llm.close()

    @property
    def num_active(self) -> int:
        return len(self._streams)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class RequestStream:
    """The Deltas of one request, as an async iterator. `abort()` (idempotent) frees the
    request's blocks if it has not finished: call it when the client goes away."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream, n: int = 1):
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.n = n                                 # choices the request streams
        self.done = False

    @property
    def num_prompt_tokens(self) -> int:
        return self._stream.num_prompt_tokens

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        delta = await self._stream.queue.get()
        if isinstance(delta, BaseException):
            self.done = True
            raise delta
        self.done = delta.last
        return delta

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.engine._post(("abort", self.request_id))
