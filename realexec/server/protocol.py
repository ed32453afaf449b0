"""OpenAI API shapes: pydantic request models (validated on the way in) and response
models (serialized on the way out), plus the error body.

Only the fields we serve are declared; unknown fields are accepted and ignored (as
vLLM does; the server logs each unknown name once), so clients that send e.g. `user`
keep working. A missing `model` means the first served model. Non-OpenAI extras follow
vLLM's names: top_k, ignore_eos, priority, min_tokens, stop_token_ids,
include_stop_str_in_output, cache_salt.
"""
from __future__ import annotations

import json
import json.encoder
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from core import InvalidRequestError, SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields common to /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None          # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    top_k: int | None = None                  # extra; 0 or -1 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                  # extra
    priority: int = 0                         # extra: lower is served first (with --queue-policy priority)
    min_tokens: int = 0                       # extra
    stop_token_ids: list[int] | None = None   # extra
    include_stop_str_in_output: bool = False  # extra
    cache_salt: str | None = None             # extra: prefix-cache blocks are shared only within one salt
    frequency_penalty: float | None = None    # accepted only as 0 (not implemented)
    presence_penalty: float | None = None     # accepted only as 0 (not implemented)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: "
                                          f"only 0 is supported", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("invalid sampling parameter stream_options: only allowed with stream=true",
                                      "stream_options")
        top_k = self.top_k or 0
        return SamplingParams(
            n=self.n, max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, cache_salt=self.cache_salt)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None                # refused above n: candidates are not ranked here

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (choices are prompt-major, then sample index)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("invalid parameter prompt: empty list", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("invalid parameter echo=True: echo is not supported", "echo")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"invalid parameter best_of={self.best_of}: only best_of == n is supported "
                                      f"(ask for n samples instead)", "best_of")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ContentPart(_Request):
    type: str = "text"
    text: str = ""


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise InvalidRequestError("invalid parameter messages: only text content parts are supported",
                                          "messages")
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None               # deprecated by OpenAI, still accepted
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("invalid parameter top_logprobs: requires logprobs=true", "top_logprobs")
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, str]]:
        return [m.as_template_dict() for m in self.messages]


# ----------------------------------------------------------------------------- responses

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A chunk's delta: only the keys that are set (`{"role": "assistant", "content": ""}`
    first, then `{"content": "..."}`, and `{}` in a final chunk with no new text)."""
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ----------------------------------------------------------------------------- streamed chunks, fast
# One SSE event per token per choice: building and dumping a pydantic model for each costs
# more than the JSON itself. These write the same bytes as the models' model_dump_json()
# (compact separators, non-ASCII as UTF-8; test_server_schema checks them against the
# models) for the common case without logprobs; chunks with logprobs use the models.

_quote = json.encoder.encode_basestring        # a JSON string literal, non-ASCII as is (C)


def _scalar(value: str | int | None) -> str:
    """A finish or stop reason as JSON (json.dumps takes ~5x as long for None)."""
    if value is None:
        return "null"
    return _quote(value) if isinstance(value, str) else str(int(value))


def completion_choice_json(index: int, text: str, finish_reason: str | None,
                           stop_reason: str | int | None) -> str:
    """CompletionChoice(index=..., text=..., logprobs=None, ...).model_dump_json()."""
    return (f'{{"index":{index:d},"text":{_quote(text)},"logprobs":null,'
            f'"finish_reason":{_scalar(finish_reason)},"stop_reason":{_scalar(stop_reason)}}}')


def chat_chunk_choice_json(index: int, content: str | None, finish_reason: str | None,
                           stop_reason: str | int | None) -> str:
    """ChatChunkChoice(index=..., delta=DeltaMessage(content=content), logprobs=None, ...)
    .model_dump_json(); content None is the empty delta `{}`."""
    delta = "{}" if content is None else f'{{"content":{_quote(content)}}}'
    return (f'{{"index":{index:d},"delta":{delta},"logprobs":null,'
            f'"finish_reason":{_scalar(finish_reason)},"stop_reason":{_scalar(stop_reason)}}}')


def chat_chunk_frame(request_id: str, created: int, model: str, include_usage: bool) -> tuple[str, str]:
    """(head, tail) of a ChatCompletionChunk's JSON around its choices: head + choice + tail is
    the chunk's model_dump_json() (with `"usage":null` when `include_usage`, else without)."""
    empty = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[])
    text = empty.model_dump_json() if include_usage else empty.model_dump_json(exclude={"usage"})
    head, sep, tail = text.partition('"choices":[]')
    return head + '"choices":[', "]" + tail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "twinserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
