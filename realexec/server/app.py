"""The FastAPI app: OpenAI-compatible endpoints over an AsyncEngine.

    app = create_app(LLMEngine(args), served_model_name="SmolLM2-135M-Instruct")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true`
as server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health,
GET /metrics (Prometheus text). Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}}: 400 bad parameters or malformed JSON
or a prompt that does not fit the context, 404 unknown model or path, 503 queue full
(--max-waiting-requests) or engine down, 500 anything else.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from core import InvalidRequestError, SamplingParams
from realexec.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from realexec.server.metrics import ServerMetrics
from realexec.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      DeltaMessage, ModelCard, ModelList, TopLogprob, Usage, error_body)

if TYPE_CHECKING:
    from realexec.engine import LLMEngine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DISCONNECT_POLL_S = 0.5


def default_served_model_name(model: str | None) -> str:
    """The embedded model's name, else the checkpoint's directory or file name (no .gguf)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    from pathlib import Path
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before the answer was ready."""


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


_PARAM_RE = re.compile(r"(?:sampling )?parameter (\w+)")


def _invalid(e: InvalidRequestError, default_param: str | None = None) -> APIError:
    msg = str(e)
    m = _PARAM_RE.search(msg)
    param = m.group(1) if m else ("prompt" if msg.startswith(("prompt", "request")) else None) or default_param
    return APIError(400, msg, param=param, code="invalid_value")


class _SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however the stream ends (finished,
    client disconnected, task cancelled) so the engine aborts what is left."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:   # noqa: BLE001 - the generator was cancelled mid-await
                    pass


class OpenAIServer:
    """State shared by the handlers: the async engine, the names served, metrics."""

    def __init__(self, engine: "LLMEngine", served_model_names: list[str], max_waiting_requests: int | None):
        self.llm_engine = engine
        self.names = served_model_names
        self.metrics = ServerMetrics(served_model_names[0])
        self.engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, metrics=self.metrics)
        self.metrics.stats_source = lambda: self.engine.stats
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}

    # -- helpers --------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.names:
            return self.names[0] if name is None else name
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.tokenizer
            text = tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"
            self._token_text[token_id] = text
        return text

    async def start_stream(self, params: SamplingParams, *, prompts=None, messages=None, priority: int = 0,
                           request_id: str, param_name: str) -> RequestStream:
        if self.llm_engine.is_sleeping:
            raise APIError(503, "the engine is sleeping: POST /wake_up first", type="server_error",
                           code="engine_sleeping")
        try:
            return await self.engine.generate(prompts, params, messages=messages, priority=priority,
                                              request_id=request_id)
        except InvalidRequestError as e:
            raise _invalid(e, param_name) from None
        except QueueFullError as e:
            raise APIError(503, str(e), type="server_error", code="queue_full") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None

    async def collect(self, stream: RequestStream, raw: Request) -> dict:
        """Final RequestOutput per prompt index. If the client leaves first, abort the
        requests and raise ClientGone (answered with a 499 nobody reads)."""
        async def final_outputs():
            finals = {}
            async for index, out in stream:
                if out.finished:
                    finals[index] = out
            return finals

        task = asyncio.ensure_future(final_outputs())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    raise ClientGone()
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        finally:
            if not task.done():
                task.cancel()
            self.engine.abort(stream)

    # -- logprobs -------------------------------------------------------------------------------
    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                            offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for t, top in zip(token_ids, logprobs):
            text = self.token_text(t)
            out.tokens.append(text)
            out.token_logprobs.append(top.get(t))
            out.top_logprobs.append({self.token_text(k): v for k, v in
                                     sorted(top.items(), key=lambda kv: -kv[1])})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> ChatLogprobs:
        content = []
        for t, top in zip(token_ids, logprobs):
            text = self.token_text(t)
            best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            content.append(ChatTokenLogprob(
                token=text, logprob=top.get(t, float("-inf")), bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=self.token_text(a), logprob=v,
                                         bytes=list(self.token_text(a).encode())) for a, v in best]))
        return ChatLogprobs(content=content)


def create_app(engine: "LLMEngine | None" = None, *, engine_args=None,
               served_model_name: str | list[str] | None = None,
               max_waiting_requests: int | None = None) -> FastAPI:
    """Build the app around `engine` (or a new LLMEngine(engine_args)). The engine thread
    starts with the app (lifespan) and stops with it."""
    if engine is None:
        from realexec.engine import LLMEngine
        engine = LLMEngine(engine_args)
    if served_model_name is None:
        names = [default_served_model_name(engine.args.model)]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    server = OpenAIServer(engine, names, max_waiting_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.shutdown)
            await asyncio.to_thread(engine.shutdown)           # worker processes / Ray actors

    app = FastAPI(title="twinserve", lifespan=lifespan)
    app.state.server = server
    _install_error_handlers(app)

    # -- simple endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if server.engine.is_running:
            return {"status": "ok"}
        return APIError(503, "engine is not running", type="server_error", code="engine_dead").response()

    if engine.args.enable_sleep_mode:              # development endpoints (vLLM's dev mode)
        @app.post("/sleep")
        async def sleep(level: int = 1):
            try:
                released = await asyncio.to_thread(engine.sleep, level)
            except (ValueError, RuntimeError) as e:
                return APIError(400 if isinstance(e, ValueError) else 409, str(e), code="sleep_refused").response()
            return {"sleeping": True, "level": level, "released_bytes": released}

        @app.post("/wake_up")
        async def wake_up():
            await asyncio.to_thread(engine.wake_up)
            return {"sleeping": False}

        @app.get("/is_sleeping")
        async def is_sleeping():
            return {"is_sleeping": engine.is_sleeping}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=n, root=str(engine.args.model or DEFAULT_MODEL_NAME),
                                         max_model_len=engine.max_model_len) for n in names])

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- completions ----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        model = server.check_model(req.model)
        try:
            params = req.sampling_params()
            prompts = req.prompts()
        except InvalidRequestError as e:
            raise _invalid(e) from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await server.start_stream(params, prompts=prompts, priority=req.priority,
                                           request_id=request_id, param_name="prompt")
        created = int(time.time())
        if req.stream:
            return _SSEResponse(_completion_chunks(server, stream, req, params, request_id, model, created),
                                on_close=lambda: server.engine.abort(stream))
        finals = await server.collect(stream, raw)
        choices, completion_tokens = [], 0
        for index in range(len(prompts)):
            out = finals[index]
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = (server.completion_logprobs(c.token_ids, c.logprobs, 0)
                      if params.logprobs is not None and c.logprobs is not None else None)
                choices.append(CompletionChoice(index=index * params.n + c.index, text=c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage = Usage(prompt_tokens=stream.num_prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=stream.num_prompt_tokens + completion_tokens)
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)

    # -- chat -----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        model = server.check_model(req.model)
        try:
            params = req.sampling_params()
            conversation = req.conversation()
        except InvalidRequestError as e:
            raise _invalid(e) from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await server.start_stream(params, messages=conversation, priority=req.priority,
                                           request_id=request_id, param_name="messages")
        created = int(time.time())
        if req.stream:
            return _SSEResponse(_chat_chunks(server, stream, req, params, request_id, model, created),
                                on_close=lambda: server.engine.abort(stream))
        out = (await server.collect(stream, raw))[0]
        choices, completion_tokens = [], 0
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            lp = (server.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                  if req.logprobs and c.logprobs is not None else None)
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=lp,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage = Usage(prompt_tokens=stream.num_prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=stream.num_prompt_tokens + completion_tokens)
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)

    return app


# ----------------------------------------------------------------------------- streaming bodies

async def _outputs_or_error(stream: RequestStream):
    """The stream's (index, output) pairs; if the engine dies meanwhile, one final
    (-1, 'data: {"error": ...}' + '[DONE]') event (the 200 status is already sent)."""
    try:
        async for item in stream:
            yield item
    except EngineDeadError as e:
        body = error_body(str(e), type="server_error", code="engine_dead")
        yield -1, f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


async def _completion_chunks(server: OpenAIServer, stream: RequestStream, req: CompletionRequest,
                             params: SamplingParams, request_id: str, model: str, created: int):
    n, want_lp = params.n, params.logprobs is not None
    offsets: dict[int, int] = {}
    completion_tokens = 0
    usage_null = ', "usage": null' if req.include_usage else ""
    head = f'{{"id": "{request_id}", "object": "text_completion", "created": {created}, "model": {json.dumps(model)}, '
    async for index, out in _outputs_or_error(stream):
        if isinstance(out, str):
            yield out
            return
        for c in out.outputs:
            if not (c.text_delta or c.finished or (want_lp and c.token_ids_delta)):
                continue
            choice_index = index * n + c.index
            lp = None
            if want_lp and c.logprobs is not None and c.token_ids_delta:
                k = len(c.token_ids_delta)
                lp = server.completion_logprobs(c.token_ids_delta, c.logprobs[-k:], offsets.get(choice_index, 0))
            offsets[choice_index] = offsets.get(choice_index, 0) + len(c.text_delta)
            choice = CompletionChoice(index=choice_index, text=c.text_delta, logprobs=lp,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            yield f'data: {head}"choices": [{choice.model_dump_json()}]{usage_null}}}\n\n'
        if out.finished:
            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
    if req.include_usage:
        usage = Usage(prompt_tokens=stream.num_prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=stream.num_prompt_tokens + completion_tokens)
        yield f'data: {head}"choices": [], "usage": {usage.model_dump_json()}}}\n\n'
    yield "data: [DONE]\n\n"


async def _chat_chunks(server: OpenAIServer, stream: RequestStream, req: ChatCompletionRequest,
                       params: SamplingParams, request_id: str, model: str, created: int):
    want_lp = bool(req.logprobs)
    completion_tokens = 0

    def chunk(choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
        obj = ChatCompletionChunk(id=request_id, created=created, model=model,
                                  choices=[choice] if choice is not None else [], usage=usage)
        if req.include_usage or usage is not None:
            return f"data: {obj.model_dump_json()}\n\n"
        return f"data: {obj.model_dump_json(exclude={'usage'})}\n\n"

    for i in range(params.n):          # the role first, for every choice
        yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    async for _, out in _outputs_or_error(stream):
        if isinstance(out, str):
            yield out
            return
        for c in out.outputs:
            if not (c.text_delta or c.finished or (want_lp and c.token_ids_delta)):
                continue
            lp = None
            if want_lp and c.logprobs is not None and c.token_ids_delta:
                k = len(c.token_ids_delta)
                lp = server.chat_logprobs(c.token_ids_delta, c.logprobs[-k:], req.top_logprobs or 0)
            delta = DeltaMessage(content=c.text_delta) if c.text_delta or not c.finished else DeltaMessage()
            yield chunk(ChatChunkChoice(index=c.index, delta=delta, logprobs=lp,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        if out.finished:
            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
    if req.include_usage:
        yield chunk(None, Usage(prompt_tokens=stream.num_prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=stream.num_prompt_tokens + completion_tokens))
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------- errors

def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone):
        return APIError(499, "client closed the request", code="client_closed_request").response()

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, e: InvalidRequestError):
        return _invalid(e).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            err = next(err for err in errors if err.get("type") == "json_invalid")
            ctx = err.get("ctx", {}).get("error", "")
            return APIError(400, f"malformed JSON body: {ctx or err.get('msg')}", code="invalid_json").response()
        parts, param = [], None
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if loc and param is None:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return APIError(400, "; ".join(parts), param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()
