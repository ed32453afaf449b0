"""The floor of `bench simulate-cpu`: what the least OpenAI-shaped streaming server costs in
this Python, with no framework, no tokenizer and no engine.

    python realexec/bench/sse_floor.py PORT [STEP_SECONDS]

One asyncio protocol on uvloop parses HTTP/1.1 with httptools (keep-alive), answers
GET /health and GET /v1/models, and answers every POST with a `text/event-stream` of `max_tokens`
completion chunks (JSON, one per step of STEP_SECONDS on the loop's timers, chunked
transfer encoding), then `data: [DONE]`: the wire work a simulated replica cannot avoid,
one write per token. `bench simulate-cpu --floor` serves the same load from it in the same
run and prints the simulated server's CPU per request against it. Prints "ready" once
listening. Imports no torch and nothing of twinserve.
"""
from __future__ import annotations

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
        try:
            n = max(1, int(json.loads(body).get("max_tokens") or 16))
        except (ValueError, AttributeError, TypeError):
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            return
        self.transport.write(SSE_HEAD)
        asyncio.get_running_loop().call_later(self.step_s, self.emit, "cmpl-%x" % id(self), 0, n)

    def emit(self, rid: str, i: int, n: int):
        if self.transport.is_closing():
            return
        last = i == n - 1
        event = json.dumps({"id": rid, "object": "text_completion", "created": 0, "model": "floor",
                            "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                         "finish_reason": "length" if last else None}]}).encode()
        out = chunk(b"data: " + event + b"\n\n")
        if last:
            self.transport.write(out + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            self.transport.write(out)
            asyncio.get_running_loop().call_later(self.step_s, self.emit, rid, i + 1, n)


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(FloorProtocol, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    if len(argv) == 2:
        FloorProtocol.step_s = float(argv[1])
    uvloop.run(serve(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
