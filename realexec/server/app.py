"""The FastAPI app: OpenAI-compatible endpoints over an engine driver (AsyncEngine's
thread, or a LoopEngine for a simulated engine: async_engine.py).

    app = create_app(LLMEngine(args), served_model_name="SmolLM2-135M-Instruct",
                     config=ServerConfig(api_key="sk-...", request_timeout=60))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true`
as server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health,
GET /metrics (Prometheus text). Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}} (errors.py); every one is counted in
/metrics as request_rejected_total{reason=<code>}.

A POST's life: the guard (an ASGI middleware) answers 401 without a valid API key and
503 while the server drains for shutdown; the handler checks the content type (415),
reads the body up to --max-request-body-bytes (413, before any parsing) within
--body-read-timeout (408), then decodes, parses, validates and tokenizes it in a worker
thread (`prepare`: 400 for bad UTF-8, bad or too deeply nested JSON, bad fields, n /
logprobs / prompts x n over the limits, prompt + max_tokens over the context), so a huge
body never holds up the event loop or the engine thread (a body of at most 1 KiB is
prepared on the loop: cheaper than the hand-off). Only token ids reach the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from core import InvalidRequestError, SamplingParams
from realexec.server.async_engine import RequestStream, make_async_engine
from realexec.server.config import ServerConfig
from realexec.server.errors import (APIError, EngineDeadError, QueueFullError, RequestTimeoutError,
                                    ShuttingDownError, as_api_error)
from realexec.server.metrics import ServerMetrics
from realexec.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                      DeltaMessage, ModelCard, ModelList, TopLogprob, Usage, chat_chunk_choice_json,
                                      chat_chunk_frame, completion_choice_json)

if TYPE_CHECKING:
    from realexec.engine.llm_engine import LLMEngine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DISCONNECT_POLL_S = 0.5
MAX_UNKNOWN_FIELDS_LOGGED = 64
# Bodies up to this size are parsed and tokenized on the event loop: the hand-off to a
# worker thread and back costs ~60 us of CPU, more than parsing such a body (a prompt of
# at most ~1 KB: tens of microseconds, a chat template ~0.1 ms); larger ones go to a thread.
INLINE_PREPARE_MAX_BYTES = 1024
logger = logging.getLogger("twinserve.server")


def default_served_model_name(model: str | None) -> str:
    """The embedded model's name, else the checkpoint's directory or file name (no .gguf)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    from pathlib import Path
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before the answer was ready."""


def _reject_json_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


@dataclass
class Prepared:
    """A request body turned into what the engine needs (built in a worker thread)."""
    req: CompletionRequest | ChatCompletionRequest
    model: str
    params: SamplingParams
    prompt_token_ids: list[list[int]]


class _SSEResponse(StreamingResponse):
    """A request stream's SSE response; however it ends (finished, client disconnected,
    task cancelled) the engine aborts what is left of the stream's requests.

    The body is written from the handler's own task, and one watcher task waits for the
    client's disconnect (uvicorn's `send` drops writes to a gone client silently: only
    `receive` tells) and then aborts the requests and ends their stream
    (`OpenAIServer.client_gone`), so the body ends at once even while no output is due (a
    request still queued). Starlette's own StreamingResponse runs an anyio task group per response for
    this: 0.5 ms of CPU per streamed request (the simulated server at 100 req/s: 31.5% of
    a core with it, 26% without) and ~2 ms more to the first event under that load."""

    def __init__(self, content: AsyncIterator[str], server: "OpenAIServer", stream: RequestStream):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._server = server
        self._stream = stream

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._server.client_gone(self._stream)

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await self.stream_response(send)
        finally:
            watcher.cancel()
            self._server.engine.abort(self._stream)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:   # noqa: BLE001 - the generator was cancelled mid-await
                    pass


class OpenAIServer:
    """State shared by the handlers: the async engine, the names served, limits, metrics."""

    def __init__(self, engine: "LLMEngine", served_model_names: list[str], config: ServerConfig):
        self.llm_engine = engine
        self.names = served_model_names
        self.config = config
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(served_model_names[0])
        self.engine = make_async_engine(engine, max_waiting_requests=config.max_waiting_requests, metrics=self.metrics)
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}
        self._unknown_fields_logged: set[str] = set()
        self.draining = False
        self.in_flight = 0                     # /v1 requests being answered (streams included)
        self.before_engine = 0                 # ... of which still reading / parsing their body
        self._body_reads: set[asyncio.Future] = set()   # resolved when the drain starts

    # -- errors -------------------------------------------------------------------------------
    def reject(self, e: BaseException, **kw) -> Response:
        """The error response for `e`, counted in /metrics under its code."""
        err = as_api_error(e, **kw)
        if err.status >= 500 and err.code == "internal_error":
            logger.error("internal error answering a request", exc_info=e)
        self.metrics.request_rejected(err.code)
        return err.response()

    # -- parsing and validation (worker thread) -------------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.names:
            return self.names[0] if name is None else name
        raise APIError(404, f"The model `{name}` does not exist.", type="not_found_error", param="model",
                       code="model_not_found")

    def prepare(self, body: bytes, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> Prepared:
        """Decode, parse, validate and tokenize one request body; raises APIError or
        InvalidRequestError. Runs in a worker thread: nothing here touches the engine."""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start})",
                           code="invalid_encoding") from None
        try:
            data = json.loads(text, parse_constant=_reject_json_constant)
        except ValueError as e:
            raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        except RecursionError:          # e.g. 200 KB of "[": the parser recurses once per level
            raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
        try:
            req = kind.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        self._log_unknown_fields(kind, data)
        model = self.check_model(req.model)
        params = req.sampling_params()
        chat = kind is ChatCompletionRequest
        cfg = self.config
        if params.n > cfg.max_n:
            raise APIError(400, f"n={params.n} is more than this server allows per request "
                                f"(--max-n {cfg.max_n})", param="n")
        if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
            raise APIError(400, f"{'top_logprobs' if chat else 'logprobs'}={params.logprobs} is more than this "
                                f"server returns (--max-logprobs {cfg.max_logprobs})",
                           param="top_logprobs" if chat else "logprobs")
        raw_prompts = None if chat else req.prompts()
        self._check_batch_size(1 if chat else len(raw_prompts), params.n)
        if chat:
            prompts = [self._tokenize(req.conversation(), "messages")]
        else:
            prompts = []
            for p in raw_prompts:
                if isinstance(p, str):
                    if not p:
                        raise APIError(400, "prompt is empty", param="prompt")
                    prompts.append(self._tokenize(p, "prompt"))
                else:
                    prompts.append(list(p))
        for ids in prompts:
            self._check_context(len(ids), params.max_tokens, req, chat)
        return Prepared(req, model, params, prompts)

    def _check_batch_size(self, num_prompts: int, n: int) -> None:
        """Before tokenizing: prompts x n over --max-choices-per-request, or more prompts than
        --max-waiting-requests (such a request would get 503 queue_full forever) are a 400."""
        cfg = self.config
        if num_prompts * n > cfg.max_choices_per_request:
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} choices is more than this "
                                f"server answers in one request (--max-choices-per-request "
                                f"{cfg.max_choices_per_request}); split the prompts over several requests",
                           param="prompt" if num_prompts > 1 else "n")
        limit = cfg.max_waiting_requests
        if limit is not None and num_prompts > limit:
            raise APIError(400, f"{num_prompts} prompts in one request can never be queued: at most {limit} "
                                f"requests may wait (--max-waiting-requests {limit}); split the prompts over "
                                f"several requests", param="prompt")

    def _tokenize(self, what: str | list[dict], param: str) -> list[int]:
        engine = self.llm_engine
        try:
            return engine.encode_chat(what) if param == "messages" else engine.encode(what)
        except InvalidRequestError:
            raise
        except Exception as e:   # noqa: BLE001 - the template or tokenizer refused this input
            raise APIError(400, f"{param} could not be tokenized: {type(e).__name__}: {e}", param=param) from None

    def _check_context(self, prompt_len: int, max_tokens: int | None, req, chat: bool) -> None:
        limit = self.max_model_len
        where = "messages" if chat else "prompt"
        if prompt_len == 0:
            raise APIError(400, f"{where} is empty", param=where)
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                f"{where} has {prompt_len} tokens (at least one more is needed for the "
                                f"completion). Please reduce the length of the {where}.",
                           param=where, code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > limit:
            field = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where}, "
                                f"{max_tokens} in the completion). Please reduce the length of the {where} "
                                f"or completion.", param=field, code="context_length_exceeded")

    def _log_unknown_fields(self, kind: type[BaseModel], data: dict) -> None:
        seen = self._unknown_fields_logged
        if len(seen) >= MAX_UNKNOWN_FIELDS_LOGGED:      # a client inventing names cannot flood the log
            return
        unknown = sorted(set(data) - set(kind.model_fields) - seen)[:MAX_UNKNOWN_FIELDS_LOGGED - len(seen)]
        if unknown:
            seen.update(unknown)
            logger.warning("ignoring unknown request field(s) %s (logged once per name)",
                           ", ".join(repr(name[:40]) for name in unknown))

    # -- helpers --------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.tokenizer
            text = tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"
            self._token_text[token_id] = text
        return text

    async def read_prepared(self, raw: Request, kind) -> Prepared:
        """Content type (415), body size (413, checked while reading, before parsing), the
        body in time (408) unless the drain starts first (503), then `prepare`: in a worker
        thread, or on the loop for a body of at most INLINE_PREPARE_MAX_BYTES. Counted in `before_engine` throughout: the drain does not wait for these."""
        self.before_engine += 1
        try:
            body = await self._read_body(raw)
            if len(body) <= INLINE_PREPARE_MAX_BYTES:
                return self.prepare(body, kind)
            return await asyncio.to_thread(self.prepare, body, kind)
        finally:
            self.before_engine -= 1

    async def _read_body(self, raw: Request) -> bytes:
        ctype = raw.headers.get("content-type", "")
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'}: send "
                                f"'Content-Type: application/json' with a JSON body", code="unsupported_media_type")
        limit = self.config.max_request_body_bytes
        too_large = APIError(413, f"request body is larger than this server accepts "
                                  f"(--max-request-body-bytes {limit})", code="request_too_large")
        declared = raw.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in raw.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
            return b"".join(chunks)

        reading = asyncio.ensure_future(read())
        drain_started = asyncio.get_running_loop().create_future()
        self._body_reads.add(drain_started)
        timeout = self.config.body_read_timeout
        try:
            done, _ = await asyncio.wait({reading, drain_started}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._body_reads.discard(drain_started)
            if not reading.done():
                reading.cancel()
        if reading in done:
            return reading.result()
        # The rest of the body may still come: close the connection after answering.
        close = {"Connection": "close"}
        if drain_started in done:
            err = as_api_error(ShuttingDownError("the server is shutting down; retry on another replica"))
            err.headers = {**(err.headers or {}), **close}
            raise err
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (--body-read-timeout)",
                       type="timeout_error", code="body_read_timeout", headers=close)

    async def start_stream(self, prep: Prepared, request_id: str) -> RequestStream:
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica")
        if self.llm_engine.is_sleeping:
            raise APIError(503, "the engine is sleeping: POST /wake_up first", type="server_error",
                           code="engine_sleeping", headers={"Retry-After": "1"})
        return await self.engine.generate(prep.prompt_token_ids, prep.params, priority=prep.req.priority,
                                          request_id=request_id, timeout=self.config.request_timeout)

    def client_gone(self, stream: RequestStream) -> None:
        """A streaming client disconnected: abort its requests and end their stream."""
        self.engine.abort(stream)
        stream.close()

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
        finally:
            if not task.done():
                task.cancel()
            self.engine.abort(stream)

    # -- shutdown -------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Refuse new requests (503) and those whose body is still arriving, wait up to
        `timeout` s for the ones in the engine (not for any still being read or parsed:
        those meet the 503 in start_stream), then abort the rest: each gets a final error
        (an SSE error event when streaming)."""
        self.draining = True
        for drain_started in list(self._body_reads):    # bodies still arriving: answered 503 now
            if not drain_started.done():
                drain_started.set_result(None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.engine_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine_requests:
            logger.warning("shutdown: aborting %d request(s) still running after %.1f s",
                           self.engine_requests, timeout)
            self.engine.abort_all(ShuttingDownError(
                f"the server shut down before this request finished (--shutdown-timeout {timeout:g} s)"))
            deadline = loop.time() + 5.0
            while self.engine_requests and loop.time() < deadline:
                await asyncio.sleep(0.05)

    @property
    def engine_requests(self) -> int:
        """/v1 requests in flight that got past reading and parsing (the ones a drain waits for)."""
        return self.in_flight - self.before_engine

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
               served_model_name: str | list[str] | None = None, config: ServerConfig | None = None) -> FastAPI:
    """Build the app around `engine` (or a new LLMEngine(engine_args)). The engine thread
    starts with the app (lifespan) and stops with it."""
    config = config if config is not None else ServerConfig()
    config.validate()
    if engine is None:
        from realexec.engine.llm_engine import LLMEngine
        engine = LLMEngine(engine_args)
    if served_model_name is None:
        names = [default_served_model_name(engine.args.model)]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    server = OpenAIServer(engine, names, config)

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
    _install_error_handlers(app, server)
    app.add_middleware(_Guard, server=server)

    # -- simple endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health():             # 503 (not counted as a rejection) tells a load balancer to stop
        if server.draining:
            return as_api_error(ShuttingDownError("the server is shutting down")).response()
        if server.engine.is_running:
            return {"status": "ok"}
        return APIError(503, "the engine is not running" + (
            f": it failed with {server.engine.error!r}" if server.engine.error else ""),
            type="server_error", code="engine_dead").response()

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
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(raw: Request):
        prep = await server.read_prepared(raw, CompletionRequest)
        req, params, model = prep.req, prep.params, prep.model
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await server.start_stream(prep, request_id)
        created = int(time.time())
        if req.stream:
            return _SSEResponse(_completion_chunks(server, stream, req, params, request_id, model, created), server, stream)
        finals = await server.collect(stream, raw)
        choices, completion_tokens = [], 0
        for index in range(len(prep.prompt_token_ids)):
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
    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(raw: Request):
        prep = await server.read_prepared(raw, ChatCompletionRequest)
        req, params, model = prep.req, prep.params, prep.model
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await server.start_stream(prep, request_id)
        created = int(time.time())
        if req.stream:
            return _SSEResponse(_chat_chunks(server, stream, req, params, request_id, model, created), server, stream)
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

    _install_openapi(app, [CompletionRequest, ChatCompletionRequest])
    return app


# ----------------------------------------------------------------------------- guard: auth, drain

class _Guard:
    """ASGI middleware in front of every route: the API key (401, compared in constant
    time) on every route but /health (and /metrics unless --protect-metrics: the /v1 API,
    the schema, the sleep-mode dev endpoints), 503 for new /v1 requests while draining,
    and the count of /v1 requests in flight (a stream counts until it ends)."""

    def __init__(self, app, server: OpenAIServer):
        self.app = app
        self.server = server
        key = server.config.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        server = self.server
        api = path == "/v1" or path.startswith("/v1/")
        protected = path != "/health" and (path != "/metrics" or server.config.protect_metrics)
        if protected and self.expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                why = ("Incorrect API key provided." if given else
                       "Missing API key: send the header 'Authorization: Bearer <key>'.")
                resp = server.reject(APIError(401, why, code="invalid_api_key",
                                              headers={"WWW-Authenticate": "Bearer"}))
                return await resp(scope, receive, send)
        if not api:
            return await self.app(scope, receive, send)
        if server.draining:
            resp = server.reject(ShuttingDownError("the server is shutting down; retry on another replica"))
            return await resp(scope, receive, send)
        server.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            server.in_flight -= 1


# ----------------------------------------------------------------------------- streaming bodies

async def _outputs_or_error(server: OpenAIServer, stream: RequestStream):
    """The stream's (index, output) pairs; if it ends in an error (engine failure,
    timeout, shutdown), one final (-1, 'data: {"error": ...}' + '[DONE]') event (the 200
    status is already sent). Counted in /metrics like any other refusal."""
    try:
        async for item in stream:
            yield item
    except Exception as e:   # noqa: BLE001 - whatever ended the stream, the client hears of it
        err = as_api_error(e)
        server.metrics.request_rejected(err.code)
        server.engine.abort(stream)
        yield -1, f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n"


async def _sse_events(server: OpenAIServer, stream: RequestStream, events_of, usage_event):
    """The loop both streamed endpoints share. `events_of(index, output)` -> the SSE events
    of one engine output, which go out as one body write (one syscall); the stream's end
    (`usage_event(usage)` when the client asked for usage, then `[DONE]`) goes out in the
    same write as the last output's events: the bytes on the wire are the same events, in
    fewer writes. An error ends the stream with its own event (_outputs_or_error)."""
    completion_tokens = 0
    events: list[str] = []
    async for index, out in _outputs_or_error(server, stream):
        if isinstance(out, str):
            yield out
            return
        events = events_of(index, out)
        if out.finished:
            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if stream.finished:
            break
        if events:
            yield "".join(events)
    else:
        events = []                     # every output's events went out already
    if usage_event is not None:
        events.append(usage_event(Usage(prompt_tokens=stream.num_prompt_tokens, completion_tokens=completion_tokens,
                                        total_tokens=stream.num_prompt_tokens + completion_tokens)))
    events.append("data: [DONE]\n\n")
    yield "".join(events)


async def _completion_chunks(server: OpenAIServer, stream: RequestStream, req: CompletionRequest,
                             params: SamplingParams, request_id: str, model: str, created: int):
    """The SSE events of a streamed completion (written as _sse_events says)."""
    n, want_lp = params.n, params.logprobs is not None
    offsets: dict[int, int] = {}
    usage_null = ', "usage": null' if req.include_usage else ""
    head = f'data: {{"id": "{request_id}", "object": "text_completion", "created": {created}, ' \
           f'"model": {json.dumps(model)}, '
    choice_head, choice_tail = head + '"choices": [', f"]{usage_null}}}\n\n"

    def events_of(index: int, out) -> list[str]:
        events = []
        for c in out.outputs:
            if not (c.text_delta or c.finished or (want_lp and c.token_ids_delta)):
                continue
            choice_index = index * n + c.index
            if want_lp and c.logprobs is not None and c.token_ids_delta:
                k = len(c.token_ids_delta)
                lp = server.completion_logprobs(c.token_ids_delta, c.logprobs[-k:], offsets.get(choice_index, 0))
                choice = CompletionChoice(index=choice_index, text=c.text_delta, logprobs=lp,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason).model_dump_json()
            else:
                choice = completion_choice_json(choice_index, c.text_delta, c.finish_reason, c.stop_reason)
            offsets[choice_index] = offsets.get(choice_index, 0) + len(c.text_delta)
            events.append(choice_head + choice + choice_tail)
        return events

    def usage_event(usage: Usage) -> str:
        return f'{head}"choices": [], "usage": {usage.model_dump_json()}}}\n\n'

    async for event in _sse_events(server, stream, events_of, usage_event if req.include_usage else None):
        yield event


async def _chat_chunks(server: OpenAIServer, stream: RequestStream, req: ChatCompletionRequest,
                       params: SamplingParams, request_id: str, model: str, created: int):
    """The SSE events of a streamed chat completion: each choice's role first, then as
    _sse_events says."""
    want_lp = bool(req.logprobs)
    head, tail = chat_chunk_frame(request_id, created, model, req.include_usage)
    head, tail = "data: " + head, tail + "\n\n"

    def chunk(choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
        obj = ChatCompletionChunk(id=request_id, created=created, model=model,
                                  choices=[choice] if choice is not None else [], usage=usage)
        if req.include_usage or usage is not None:
            return f"data: {obj.model_dump_json()}\n\n"
        return f"data: {obj.model_dump_json(exclude={'usage'})}\n\n"

    def events_of(_index: int, out) -> list[str]:
        events = []
        for c in out.outputs:
            if not (c.text_delta or c.finished or (want_lp and c.token_ids_delta)):
                continue
            content = c.text_delta if c.text_delta or not c.finished else None
            if want_lp and c.logprobs is not None and c.token_ids_delta:
                k = len(c.token_ids_delta)
                lp = server.chat_logprobs(c.token_ids_delta, c.logprobs[-k:], req.top_logprobs or 0)
                delta = DeltaMessage() if content is None else DeltaMessage(content=content)
                events.append(chunk(ChatChunkChoice(index=c.index, delta=delta, logprobs=lp,
                                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)))
            else:
                events.append(head + chat_chunk_choice_json(c.index, content, c.finish_reason, c.stop_reason)
                              + tail)
        return events

    for i in range(params.n):          # the role first, for every choice
        yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    async for event in _sse_events(server, stream, events_of,
                                   (lambda usage: chunk(None, usage)) if req.include_usage else None):
        yield event


# ----------------------------------------------------------------------------- errors, schema

def _validation_error(e: ValidationError) -> APIError:
    parts, param = [], None
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ())]
        if loc and param is None:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return APIError(400, "; ".join(parts), param=param, code="invalid_value")


def _install_error_handlers(app: FastAPI, server: OpenAIServer) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return server.reject(e)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone):
        return server.reject(APIError(499, "client closed the request", code="client_closed_request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return server.reject(APIError(404, str(e.detail), type="not_found_error", code="not_found"))
        if e.status_code == 405:
            return server.reject(APIError(405, str(e.detail), code="method_not_allowed"))
        return server.reject(APIError(e.status_code, str(e.detail), code="invalid_value"))

    async def known_error(request: Request, e: Exception):
        chat = request.url.path.endswith("/chat/completions")
        return server.reject(e, prompt_param="messages" if chat else "prompt")

    for kind in (InvalidRequestError, QueueFullError, EngineDeadError, ShuttingDownError, RequestTimeoutError):
        app.add_exception_handler(kind, known_error)
    app.add_exception_handler(Exception, known_error)        # anything else: a logged 500


def _body_schema(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _install_openapi(app: FastAPI, bodies: list[type[BaseModel]]) -> None:
    """The handlers read raw bodies (to bound and parse them off the loop), so the request
    schemas are added to the generated OpenAPI document by hand."""
    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in bodies:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
