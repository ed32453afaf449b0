"""The server's per-request fast paths (issue 32: CPU per request) keep the wire format.

* Streamed chunks are written from templates, not pydantic models: the same bytes as the
  models' model_dump_json() for every character a token's text may hold.
* A stream's last output, its usage event and `data: [DONE]` go out in one body write.
* A small body is parsed and tokenized on the event loop, a large one in a worker thread.
Driven through the ASGI app directly (every body message the server sends is seen).
"""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from realexec.config import EngineArgs
from realexec.server.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice, DeltaMessage,
                                      chat_chunk_choice_json, chat_chunk_frame, completion_choice_json)

TEXTS = ["", " tok", "".join(map(chr, range(0x80))), 'say "hi" \\ / </script>', "é日本語 😀 \u2028\u2029 \ufffd",
         "\x7f\x80\x9f\xa0\xad", "\ud7ff\ue000\uffff"]
REASONS = [(None, None), ("stop", None), ("length", None), ("stop", "\n\"end\""), ("stop", 128001), ("abort", 0)]


def test_completion_choice_json_is_the_models_bytes():
    for text in TEXTS:
        for finish, stop in REASONS:
            model = CompletionChoice(index=7, text=text, logprobs=None, finish_reason=finish, stop_reason=stop)
            assert completion_choice_json(7, text, finish, stop) == model.model_dump_json()


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunk_json_is_the_models_bytes(include_usage):
    rid, model_name = 'chatcmpl-"x"\\', "Llama-3 é"
    head, tail = chat_chunk_frame(rid, 1700000000, model_name, include_usage)
    for text in TEXTS + [None]:
        for finish, stop in REASONS:
            delta = DeltaMessage() if text is None else DeltaMessage(content=text)
            chunk = ChatCompletionChunk(id=rid, created=1700000000, model=model_name, choices=[
                ChatChunkChoice(index=2, delta=delta, finish_reason=finish, stop_reason=stop)])
            want = chunk.model_dump_json() if include_usage else chunk.model_dump_json(exclude={"usage"})
            assert head + chat_chunk_choice_json(2, text, finish, stop) + tail == want


# ----------------------------------------------------------------------------- through the app

@pytest.fixture(scope="module")
def app():
    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.app import create_app

    engine = LLMEngine(EngineArgs(simulate="roofline", sim_model="Llama-3-8B", sim_hardware="H100",
                                  num_gpu_blocks=256))
    app = create_app(engine, served_model_name="sim")
    app.state.server.engine.start()          # called directly: no lifespan
    yield app
    app.state.server.engine.shutdown()


def _call(app, path: str, body: dict | bytes) -> tuple[int, list[bytes]]:
    """POST `body` to the ASGI app; -> (status, the body of every body message sent)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent, status = [], []

    async def main():
        done = asyncio.Event()
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
            elif msg["type"] == "http.response.body":
                sent.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    done.set()

        await app(scope, receive, send)

    asyncio.run(main())
    return status[0], sent


def _events(body: bytes) -> list[str]:
    text = body.decode()
    assert text.endswith("\n\n"), text
    return [e.removeprefix("data: ") for e in text.split("\n\n")[:-1]]


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": "count to ten"}),
                                         ("/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "count to ten"}]})])
def test_the_last_output_usage_and_done_are_one_write(app, path, extra):
    body = {**extra, "max_tokens": 5, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    status, writes = _call(app, path, body)
    assert status == 200 and writes[-1] == b""               # the response's end
    writes = [w for w in writes if w]
    per_write = [_events(w) for w in writes]
    last = per_write[-1]
    assert last[-1] == "[DONE]" and json.loads(last[-2])["usage"]["completion_tokens"] == 5
    assert json.loads(last[-3])["choices"][0]["finish_reason"] == "length"   # the last token, same write
    assert all("[DONE]" not in events for events in per_write[:-1])
    chunks = [json.loads(e) for events in per_write for e in events if e != "[DONE]"]
    texts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
             for c in chunks if c["choices"]]
    assert len([t for t in texts if t]) >= 4                 # one chunk per token with text


def test_small_bodies_are_prepared_on_the_loop_large_ones_in_a_thread(app, monkeypatch):
    from realexec.server.app import INLINE_PREPARE_MAX_BYTES

    server, threads = app.state.server, []
    prepare = server.prepare

    def spy(body, kind):
        threads.append(threading.current_thread() is threading.main_thread())
        return prepare(body, kind)

    monkeypatch.setattr(server, "prepare", spy)
    small = {"prompt": "hello", "max_tokens": 1}
    large = {"prompt": "hello " * (INLINE_PREPARE_MAX_BYTES // 6 + 1), "max_tokens": 1}
    assert len(json.dumps(small)) <= INLINE_PREPARE_MAX_BYTES < len(json.dumps(large))
    assert _call(app, "/v1/completions", small)[0] == 200
    assert _call(app, "/v1/completions", large)[0] == 200
    assert threads == [True, False]          # asyncio.run runs the loop on this (the main) thread
