"""The OpenAI request bodies the server accepts (pydantic), their translation to SamplingParams,
and OpenAI-shaped errors.

Fields the workbench cannot honour are refused by name (echo) rather than ignored. Extensions, as
vLLM has them: top_k, min_p, repetition_penalty, min_tokens, bad_words, structured_outputs,
ignore_eos, priority (lower served first). OpenAI's response_format (json_object, json_schema)
becomes structured_outputs."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workbench.sampling_params import SamplingParams


class OpenAIError(Exception):
    """An error the client should see as {"error": {...}} with this HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (message, param, status,
                                                                        kind, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def param_of(message: str) -> str | None:
    """'temperature=-1 is invalid: ...' -> 'temperature' (the engine's errors start that way)."""
    head = message.split("=", 1)[0].split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return head if head.isidentifier() else None


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise OpenAIError("response_format.json_schema.schema is missing: type "
                              "'json_schema' needs {'json_schema': {'name': ..., 'schema': "
                              "{...}}}", "response_format")
        return {"json": self.json_schema.schema_}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    ignore_eos: bool = False
    priority: int = 0

    def _structured(self) -> dict | None:
        fmt = self.response_format.structured() if self.response_format else None
        if fmt is not None and self.structured_outputs is not None:
            raise OpenAIError("response_format and structured_outputs are both set: give one",
                              "structured_outputs")
        return fmt if fmt is not None else self.structured_outputs

    def sampling_params(self, max_tokens_default: int, logprobs: int | None,
                        best_of: int | None = None) -> SamplingParams:
        if self.stream and best_of is not None and best_of > self.n:
            raise OpenAIError(f"best_of={best_of} is invalid with stream=true: the best {self.n} "
                              "samples are known only when all have finished", "best_of")
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                max_tokens=self.max_tokens if self.max_tokens is not None else max_tokens_default,
                stop=self.stop, seed=self.seed, ignore_eos=self.ignore_eos, logprobs=logprobs,
                n=self.n, best_of=best_of, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias,
                min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens, bad_words=self.bad_words,
                structured_outputs=self._structured())
        except ValueError as err:
            raise OpenAIError(str(err), param_of(str(err))) from None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    def prompt_input(self) -> str | list[int]:
        if self.echo:
            raise OpenAIError("echo=true is not supported by this server", "echo")
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise OpenAIError(f"prompt is a list of {len(p)} strings: send one prompt per "
                                  "request", "prompt")
            p = p[0]
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def chat_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def __init__(self, **data):
        super().__init__(**data)
        if self.max_completion_tokens is not None:      # the newer name wins
            self.max_tokens = self.max_completion_tokens
