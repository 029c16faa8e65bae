"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health
and /metrics. Responses follow the OpenAI schema (choices, finish_reason, usage, logprobs, SSE
chunks ending with `data: [DONE]`). Keys, limits, screening, rate limits and the access log live
in gateway.py (a middleware and a stream wrapper); the waiting bounds in admission.py."""
from __future__ import annotations

import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from workbench.serve.admission import Refusal
from workbench.serve.async_engine import AsyncEngine, Delta, EngineStopped, RequestStream
from workbench.serve.gateway import (Gateway, GuardedStream, ServingPolicy, current_request, note_refusal,
                      screened_token_prompt, shutdown_retry_after, sse_errors)
from workbench.serve.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, param_of
from workbench.serve.security import ApiKeys, KeySpec, Screen


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              shutdown_timeout: float = 10.0, policy: ServingPolicy | None = None,
              screen_input: Screen | None = None,
              screen_output: Screen | None = None) -> FastAPI:
    """policy: keys, limits, filters, rate limits, timeout, access log (gateway.py); `api_key`
    adds one key to them (named key-<n>). screen_input / screen_output:
    `f(text) -> policy name | None`, run on prompts and messages / on generated text, after the
    policy's own patterns."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown(shutdown_timeout)    # finish what runs, abort the rest, stop the workers

    app = FastAPI(title="inference workbench", lifespan=lifespan)
    max_model_len = engine.engine.plan.max_model_len
    policy = policy if policy is not None else ServingPolicy()
    if api_key is not None:
        specs = policy.api_keys.specs if policy.api_keys is not None else []
        policy.api_keys = ApiKeys([*specs, KeySpec(f"key-{len(specs) + 1}", api_key)])
    policy.input_filter.screens += [screen_input] if screen_input else []
    policy.output_filter.screens += [screen_output] if screen_output else []
    retry_after = shutdown_retry_after(shutdown_timeout)
    app.add_middleware(Gateway, policy=policy, engine=engine, max_model_len=max_model_len,
                       shutdown_retry_after=retry_after)

    # ------------------------------------------------------------------ errors and auth
    @app.exception_handler(OpenAIError)
    async def _openai_error(request, err: OpenAIError):
        if isinstance(err, Refusal):
            note_refusal(err)
        return JSONResponse(err.body(), status_code=err.status,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):
        """FastAPI's own refusals (a body that is not UTF-8, an unknown path) in OpenAI's shape."""
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        e = OpenAIError(f"{err.detail} (HTTP {err.status_code})", status=err.status_code,
                        kind=kind)
        return JSONResponse(e.body(), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, err: RequestValidationError):
        first = err.errors()[0]
        if first.get("type") == "json_invalid":
            e = OpenAIError(f"the request body is not valid JSON: {first.get('msg')}")
        else:
            loc = [str(x) for x in first.get("loc", ())[1:]]
            e = OpenAIError(f"{'.'.join(loc) or 'body'}: {first.get('msg')} "
                            f"(got {first.get('input')!r:.80})", loc[0] if loc else None)
        return JSONResponse(e.body(), status_code=400)

    def check_model(name: str | None) -> None:
        if name not in (None, model_name):
            raise OpenAIError(f"model={name!r} is invalid: this server serves {model_name!r}",
                              "model", code="model_not_found")

    async def submit(prompt, params, priority) -> GuardedStream:
        ctx = current_request()
        prompt = screened_token_prompt(prompt, policy.input_filter, engine.engine.tokenizer)
        try:
            stream = await engine.submit(prompt, params, priority,
                                         prompt_tokens=ctx.prompt_estimate if ctx else 1)
        except EngineStopped as err:
            if engine.stopping:
                raise Refusal(str(err), "shutting_down", status=503, kind="server_error",
                              retry_after=retry_after) from None
            raise OpenAIError(str(err), status=503, kind="server_error") from None
        except ValueError as err:
            raise OpenAIError(str(err), param_of(str(err))) from None
        return GuardedStream(stream, ctx, policy)

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, 500)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if engine.metrics is None:
            return Response("", media_type="text/plain")
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": int(time.time()),
                                            "owned_by": "workbench",
                                            "max_model_len": max_model_len}]}

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        params = body.sampling_params(policy.limits.default_max_tokens(16), body.logprobs,
                                      body.best_of)
        stream = await submit(body.prompt_input(), params, body.priority)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n_top = body.logprobs

        def choice(delta, text, offset):
            return {"index": delta.index, "text": text, "finish_reason": delta.finish_reason,
                    "logprobs": completion_logprobs(delta.logprobs, delta.token_ids, n_top,
                                                    offset) if n_top is not None else None}

        def chunk(choices, usage=None):
            out = {"id": rid, "object": "text_completion", "created": created,
                   "model": model_name, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events():
                offsets, generated = {}, 0
                try:
                    async for delta in stream:
                        generated += len(delta.token_ids)
                        offset = offsets.get(delta.index, 0)
                        yield sse(chunk([choice(delta, delta.text, offset)]))
                        offsets[delta.index] = offset + len(delta.text)
                    if include_usage:
                        yield sse(chunk([], usage(stream.num_prompt_tokens, generated)))
                    yield "data: [DONE]\n\n"
                finally:
                    stream.abort()            # a disconnected client: free the blocks now
            return StreamingResponse(sse_errors(events()), media_type="text/event-stream")

        wholes = await collect(stream)
        return chunk([choice(w, w.text, 0) for w in wholes],
                     usage(stream.num_prompt_tokens, sum(len(w.token_ids) for w in wholes)))

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check_model(body.model)
        n_top = body.chat_logprobs()
        params = body.sampling_params(policy.limits.default_max_tokens(max_model_len), n_top)
        messages = [m.model_dump() for m in body.messages]
        stream = await submit(lambda: engine.llm.apply_chat_template(messages), params,
                              body.priority)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def lp(delta):
            return chat_logprobs(delta.logprobs, delta.token_ids, n_top) \
                if n_top is not None else None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(delta_body, finish_reason=None, logprobs=None, usage_body=None, index=0):
                out = {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": model_name,
                       "choices": [{"index": index, "delta": delta_body, "logprobs": logprobs,
                                    "finish_reason": finish_reason}]
                       if delta_body is not None else []}
                if usage_body is not None:
                    out["usage"] = usage_body
                return out

            async def events():
                generated = 0
                try:
                    for index in range(params.n):
                        yield sse(chunk({"role": "assistant", "content": ""}, index=index))
                    async for delta in stream:
                        generated += len(delta.token_ids)
                        body_ = {"content": delta.text} if delta.text else {}
                        if body_ or delta.finished or delta.token_ids:
                            yield sse(chunk(body_, delta.finish_reason, lp(delta),
                                            index=delta.index))
                    if include_usage:
                        yield sse(chunk(None, usage_body=usage(stream.num_prompt_tokens,
                                                               generated)))
                    yield "data: [DONE]\n\n"
                finally:
                    stream.abort()
            return StreamingResponse(sse_errors(events()), media_type="text/event-stream")

        wholes = await collect(stream)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": w.index, "message": {"role": "assistant",
                                                           "content": w.text},
                             "logprobs": lp(w), "finish_reason": w.finish_reason}
                            for w in wholes],
                "usage": usage(stream.num_prompt_tokens,
                               sum(len(w.token_ids) for w in wholes))}

    return app


async def collect(stream: RequestStream | GuardedStream) -> list[Delta]:
    """A whole (non-streamed) answer: every Delta of each choice joined into one, by index."""
    wholes: dict[int, Delta] = {}
    try:
        async for delta in stream:
            whole = wholes.setdefault(delta.index, Delta("", [], [], index=delta.index))
            whole.text += delta.text
            whole.token_ids += delta.token_ids
            whole.logprobs += delta.logprobs or []
            if delta.finished:
                whole.finished, whole.finish_reason = True, delta.finish_reason
    finally:
        stream.abort()                 # the client went away before the end: free the blocks
    return [wholes[i] for i in sorted(wholes)] or [Delta("", [], [])]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top(entries: dict, n: int) -> list:
    """The n most likely (token id, Logprob) of one position."""
    return sorted(entries.items(), key=lambda kv: -kv[1].logprob)[:n]


def completion_logprobs(logprobs, token_ids, n_top: int, offset: int) -> dict:
    """The legacy completions format: parallel lists per token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entries, tid in zip(logprobs or [], token_ids):
        chosen = entries[tid]
        tokens.append(chosen.decoded_token)
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for _, lp in _top(entries, n_top)}
                    if n_top else None)
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(logprobs, token_ids, n_top: int) -> dict:
    """The chat format: one entry per token, with its bytes and its top alternatives."""
    def entry(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
    content = []
    for entries, tid in zip(logprobs or [], token_ids):
        e = entry(entries[tid])
        e["top_logprobs"] = [entry(lp) for _, lp in _top(entries, n_top)]
        content.append(e)
    return {"content": content}
