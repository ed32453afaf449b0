"""The floors of `bench simulate-cpu`: what the least OpenAI-shaped streaming server costs
in this Python, with no tokenizer and no engine.

    python realexec/bench/sse_floor.py PORT [STEP_SECONDS] [--fastapi]

Raw (the default): one asyncio protocol on uvloop parses HTTP/1.1 with httptools
(keep-alive), answers GET /health and GET /v1/models, and answers every POST with a
`text/event-stream` of `max_tokens` completion chunks (JSON, one per step of STEP_SECONDS
on the loop's timers, chunked transfer encoding), then `data: [DONE]`: the wire work a
simulated replica cannot avoid, one write per token.

--fastapi: the same answers from a FastAPI app under uvicorn (uvloop + httptools, as
`realexec serve` runs): a handler that reads the body, parses it and returns a
StreamingResponse of the same events (an asyncio.sleep per step), with nothing else: the
framework's share of the simulated server's CPU.

`bench simulate-cpu --floor` serves the same load from both in the same run and prints the
simulated server's CPU per request against them. Prints "ready" once listening. Imports
no torch and nothing of twinserve.
"""
# (no `from __future__ import annotations`: FastAPI reads the handler's `Request` annotation)
import asyncio
import json
import sys

import httptools
import uvloop

MODELS = json.dumps({"object": "list", "data": [{"id": "floor", "object": "model", "owned_by": "twinserve"}]}).encode()
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class FloorProtocol(asyncio.Protocol):
    step_s = 0.01

    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.body = b"", []

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url):
        self.url += url

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        if url.startswith(b"/health"):
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        if url.startswith(b"/v1/models"):
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(MODELS), MODELS))
            return
        n = requested_tokens(body)
        if n is None:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            return
        self.transport.write(SSE_HEAD)
        asyncio.get_running_loop().call_later(self.step_s, self.emit, "cmpl-%x" % id(self), 0, n)

    def emit(self, rid: str, i: int, n: int):
        if self.transport.is_closing():
            return
        last = i == n - 1
        out = chunk(completion_event(rid, last).encode())
        if last:
            self.transport.write(out + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            self.transport.write(out)
            asyncio.get_running_loop().call_later(self.step_s, self.emit, rid, i + 1, n)


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(FloorProtocol, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()


def requested_tokens(body: bytes) -> int | None:
    """A completion body's max_tokens (16 if unset, at least 1); None if it is not a JSON object."""
    try:
        return max(1, int(json.loads(body).get("max_tokens") or 16))
    except (ValueError, AttributeError, TypeError):
        return None


def completion_event(rid: str, last: bool) -> str:
    return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": 0, "model": "floor",
                                  "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                               "finish_reason": "length" if last else None}]}) + "\n\n"


def serve_fastapi(port: int, step_s: float) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return Response()

    @app.get("/v1/models")
    async def models():
        return Response(MODELS, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        n = requested_tokens(await request.body())
        if n is None:
            return JSONResponse({"error": "bad body"}, status_code=400)
        rid = "cmpl-%x" % id(request)

        async def events():
            for i in range(n):
                await asyncio.sleep(step_s)
                yield completion_event(rid, i == n - 1)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")
    server = uvicorn.Server(config)

    async def run():
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            if serving.done():
                return serving.result()
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        await serving
    uvloop.run(run())


def main(argv: list[str]) -> int:
    fastapi = "--fastapi" in argv
    argv = [a for a in argv if a != "--fastapi"]
    if not 1 <= len(argv) <= 2:
        print(__doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    if len(argv) == 2:
        FloorProtocol.step_s = float(argv[1])
    if fastapi:
        serve_fastapi(int(argv[0]), FloorProtocol.step_s)
    else:
        uvloop.run(serve(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
