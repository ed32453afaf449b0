"""Serving you can expose: API keys, limits, timeouts, rejection metrics, engine faults,
and graceful shutdown of a real `python -m realexec serve` process.

One guarded in-process server (API key, small body limit, n/logprobs caps, a request
timeout, prefix caching) for most tests; a crashing one for the engine fault; the
shutdown tests start the CLI as a subprocess and signal it.
"""
from __future__ import annotations

import contextlib
import json
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from core.procs import realexec_server
from realexec.server.config import ServerConfig
from tests.realexec.server.test_server import IGNORE_EOS, ROOT, TINY, _error, metrics, serve, tiny_dir, tiny_engine, wait_for  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 20_000
TIMEOUT_S = 2.0
BODY_READ_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    from realexec.server.app import create_app

    config = ServerConfig(api_key=KEY, protect_metrics=True, max_request_body_bytes=BODY_LIMIT, max_n=4,
                          max_logprobs=5, request_timeout=TIMEOUT_S, body_read_timeout=BODY_READ_TIMEOUT_S)
    app = create_app(tiny_engine(tiny_dir, enable_prefix_caching=True), served_model_name=TINY, config=config)
    with serve(app) as base, httpx.Client(base_url=base, timeout=60, headers=AUTH) as client:
        yield client


def rejected(http, code: str) -> float:
    return metrics(http)[f"twinserve:request_rejected_total{{reason={code}}}"]


def raw_http(base: str, data: bytes, timeout: float = 30,
             close_wait: float = 0.0) -> tuple[int, dict[str, str], bytes, bool | None]:
    """Send `data` as is on a fresh connection (whatever framing it claims) and read one
    response: (status, headers, body, whether the server then closed the connection within
    `close_wait` s; None without close_wait)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"connection closed before a response: {buf!r}"
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
        length = int(headers["content-length"])
        while len(body) < length:
            chunk = s.recv(65536)
            assert chunk, "connection closed mid-response"
            body += chunk
        body = body[:length]                     # (a pipelined second response may follow)
        closed = None
        if close_wait:
            s.settimeout(close_wait)
            try:
                closed = s.recv(1) == b""
            except socket.timeout:
                closed = False
        return int(status_line.split()[1]), headers, body, closed


def post_head(content_length: int | None = None, chunked: bool = False, auth: bool = True) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if auth:
        lines.append(f"Authorization: Bearer {KEY}")
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_error(status: int, headers: dict, body: bytes, want_status: int) -> dict:
    assert status == want_status, (status, body)
    assert headers["content-type"] == "application/json", headers
    return json.loads(body)["error"]


def idle(http) -> dict:
    def check():
        m = metrics(http)
        return m if (m["twinserve:num_requests_running"] == m["twinserve:num_requests_waiting"] == 0
                     and m["twinserve:num_used_gpu_blocks"] == 0) else None
    return wait_for(check, what="the engine to drain and free every KV block")


# ----------------------------------------------------------------------------- auth

def test_api_key_required_on_v1_and_protected_metrics(guarded):
    url = str(guarded.base_url)
    with httpx.Client(base_url=url, timeout=30) as anon:
        before = rejected(guarded, "invalid_api_key")
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                             ("POST", "/v1/nothing"), ("GET", "/openapi.json")):
            resp = anon.request(method, path, json={"prompt": "hi"})
            e = _error(resp, 401)
            assert e["code"] == "invalid_api_key" and "Missing API key" in e["message"]
            assert resp.headers["www-authenticate"] == "Bearer"
        for wrong in (f"Bearer {KEY}x", KEY, f"Bearer {KEY[:-1]}", "Basic abc"):
            e = _error(anon.get("/v1/models", headers={"Authorization": wrong}), 401)
            assert e["message"] == "Incorrect API key provided."
        assert anon.get("/health").json() == {"status": "ok"}          # always open
        assert rejected(guarded, "invalid_api_key") == before + 9
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=TINY, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("TWINSERVE_API_KEY", "from-env")
    assert ServerConfig().api_key == "from-env"
    assert ServerConfig(api_key="flag").api_key == "flag"
    monkeypatch.delenv("TWINSERVE_API_KEY")
    assert ServerConfig().api_key is None


# ----------------------------------------------------------------------------- limits

def test_body_size_limit_before_parsing(guarded):
    before = rejected(guarded, "request_too_large")
    big = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    e = _error(guarded.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert e["code"] == "request_too_large" and str(BODY_LIMIT) in e["message"]

    def chunks():                                  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1000 + 1):
            yield b"y" * 1000
        yield b'"}'
    _error(guarded.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    # a lying Content-Length header is no way around it either: the body is counted as read.
    # A small one next to a chunked body: RFC 9112 lets a server frame it by the chunks (h11:
    # the app still sees "Content-Length: 100" and counts the body: 413) or refuse it (httptools,
    # the `server` extra's parser: 400 before the app, so not counted); never is it parsed.
    big_chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks()) + b"0\r\n\r\n"
    status, headers, body, _ = raw_http(str(guarded.base_url), post_head(100, chunked=True) + big_chunked)
    framed_by_chunks = status != 400
    if framed_by_chunks:
        assert json_error(status, headers, body, 413)["code"] == "request_too_large"
    else:
        assert body == b"Invalid HTTP request received.", body
    # a small one with a large body: only the declared bytes are the body (here a JSON
    # fragment), the rest is no request at all; nothing past the limit is ever parsed. h11
    # answers the fragment first (the app's 400 invalid_json); httptools parses what follows
    # at once and refuses it (its 400) before the app's answer
    status, _, body, _ = raw_http(str(guarded.base_url), post_head(12) + big)
    assert status == 400
    if body.startswith(b"{"):
        assert json.loads(body)["error"]["code"] == "invalid_json"
    else:                                          # only the parser that refused the framing above
        assert not framed_by_chunks and body == b"Invalid HTTP request received.", body
    assert rejected(guarded, "request_too_large") == before + 2 + framed_by_chunks
    ok = json.dumps({"prompt": "x " * 100, "max_tokens": 1}).encode()
    assert guarded.post("/v1/completions", content=ok, headers={"content-type": "application/json"}).status_code == 200


def test_n_logprobs_and_context_limits(guarded):
    before = rejected(guarded, "invalid_value"), rejected(guarded, "context_length_exceeded")
    e = _error(guarded.post("/v1/completions", json={"prompt": "hi", "n": 5}), 400, "n")
    assert "--max-n 4" in e["message"]
    _error(guarded.post("/v1/completions", json={"prompt": "hi", "logprobs": 6}), 400, "logprobs")
    _error(guarded.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": True, "top_logprobs": 6}), 400, "top_logprobs")
    t0 = time.monotonic()
    e = _error(guarded.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100_000_000}), 400, "max_tokens")
    assert time.monotonic() - t0 < 5                                   # refused, not run for minutes
    assert e["code"] == "context_length_exceeded"
    assert e["message"].startswith("This model's maximum context length is 2048 tokens. However, you requested "
                                   "100000001 tokens (1 in the prompt, 100000000 in the completion).")
    e = _error(guarded.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_completion_tokens": 5000}), 400,
               "max_completion_tokens")
    assert (rejected(guarded, "invalid_value"), rejected(guarded, "context_length_exceeded")) == \
        (before[0] + 3, before[1] + 2)
    r = guarded.post("/v1/completions", json={"prompt": "hi", "n": 4, "logprobs": 5, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    idle(guarded)


def test_context_length_boundary(guarded):
    """prompt + max_tokens == max_model_len (2048) is served; one token more is refused, and
    so is a prompt that leaves no room for a completion."""
    ok = guarded.post("/v1/completions", json={"prompt": [1] * 2047, "max_tokens": 1, **IGNORE_EOS})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"] == {"prompt_tokens": 2047, "completion_tokens": 1, "total_tokens": 2048}
    e = _error(guarded.post("/v1/completions", json={"prompt": [1] * 2047, "max_tokens": 2}), 400, "max_tokens")
    assert e["code"] == "context_length_exceeded" and "you requested 2049 tokens" in e["message"]
    e = _error(guarded.post("/v1/completions", json={"prompt": [1] * 2048, "max_tokens": 1}), 400, "prompt")
    assert e["code"] == "context_length_exceeded" and "your prompt has 2048 tokens" in e["message"]
    idle(guarded)


def test_stalled_upload_gets_a_json_408(guarded):
    """Issue 26, defect 6: headers promising 1000 bytes, then 13 and silence: after
    --body-read-timeout the client gets an OpenAI-style JSON 408 and the connection closes."""
    before = rejected(guarded, "body_read_timeout")
    t0 = time.monotonic()
    status, headers, body, closed = raw_http(str(guarded.base_url), post_head(1000) + b'{"prompt": "h',
                                             close_wait=5)
    elapsed = time.monotonic() - t0
    e = json_error(status, headers, body, 408)
    assert e["code"] == "body_read_timeout" and "--body-read-timeout" in e["message"]
    assert BODY_READ_TIMEOUT_S <= elapsed < BODY_READ_TIMEOUT_S + 3, elapsed
    assert closed                               # the other 987 bytes will not be read as a request
    assert rejected(guarded, "body_read_timeout") == before + 1


def test_request_timeout(guarded):
    before = rejected(guarded, "request_timeout")
    long = {"prompt": "Go on", "max_tokens": 2000, **IGNORE_EOS}
    t0 = time.monotonic()
    e = _error(guarded.post("/v1/completions", json=long), 408)
    assert e["code"] == "request_timeout" and TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 3
    with guarded.stream("POST", "/v1/completions", json={**long, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3                                              # it did stream before the cut
    assert rejected(guarded, "request_timeout") == before + 2
    m = idle(guarded)
    assert m["twinserve:request_success_total{finished_reason=abort}"] == 2


def test_cache_salt_through_the_server(guarded):
    prompt = {"prompt": "The same long shared system prompt, word for word, " * 4, "max_tokens": 1}
    hits = lambda: metrics(guarded)["twinserve:prefix_cache_hits_total"]   # noqa: E731
    guarded.post("/v1/completions", json={**prompt, "cache_salt": "tenant-a"}).raise_for_status()
    h0 = hits()
    guarded.post("/v1/completions", json={**prompt, "cache_salt": "tenant-b"}).raise_for_status()
    assert hits() == h0                                                  # another tenant: no hit
    guarded.post("/v1/completions", json={**prompt, "cache_salt": "tenant-a"}).raise_for_status()
    assert hits() > h0                                                   # the same tenant: hit
    _error(guarded.post("/v1/completions", json={**prompt, "cache_salt": ""}), 400, "cache_salt")


# ----------------------------------------------------------------------------- engine fault

def test_engine_fault_answers_every_waiting_client(tiny_dir):
    from realexec.server.app import create_app

    app = create_app(tiny_engine(tiny_dir, max_num_seqs=2), served_model_name=TINY)
    engine, steps, fail = app.state.server.engine, [0], threading.Event()

    def before_step():
        steps[0] += 1
        if fail.is_set():
            raise RuntimeError("injected executor failure")
    engine.before_step = before_step
    results: dict[str, object] = {}
    body = {"prompt": "Keep going", "max_tokens": 1500, **IGNORE_EOS}

    with serve(app) as base:
        def stream_client(name):
            with httpx.Client(base_url=base, timeout=60) as c, \
                    c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                results[name] = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]

        def plain_client(name):
            with httpx.Client(base_url=base, timeout=60) as c:
                results[name] = c.post("/v1/completions", json=body)

        threads = [threading.Thread(target=f, args=(n,)) for f, n in
                   ((stream_client, "s1"), (stream_client, "s2"), (plain_client, "p1"), (plain_client, "p2"))]
        for t in threads:                  # 2 run, 2 wait (max_num_seqs=2)
            t.start()
        with httpx.Client(base_url=base, timeout=30) as c:
            wait_for(lambda: (m := metrics(c))["twinserve:num_requests_running"] == 2
                     and m["twinserve:num_requests_waiting"] == 2, what="2 running + 2 waiting")
            fail.set()
            t0 = time.monotonic()
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 5, "clients hang"
            for name in ("s1", "s2"):
                assert results[name][-1] == "[DONE]"
                assert json.loads(results[name][-2])["error"]["code"] == "engine_dead"
            for name in ("p1", "p2"):
                e = _error(results[name], 503)
                assert e["code"] == "engine_dead" and "injected executor failure" in e["message"]
            e = _error(c.get("/health"), 503)
            assert "injected executor failure" in e["message"]
            _error(c.post("/v1/completions", json={"prompt": "hi"}), 503)
            assert metrics(c)["twinserve:request_rejected_total{reason=engine_dead}"] == 5
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10                                  # the server still shuts down


# ----------------------------------------------------------------------------- graceful shutdown

@contextlib.contextmanager
def _server(tiny_dir, *extra):
    """A `realexec serve` process of our own (core.procs), yielded as (process, base URL,
    log file) once healthy; stopped on the way out if it is still running (also when it
    never became healthy)."""
    args = ["--model", tiny_dir, "--num-gpu-blocks", "1024", "--swap-space", "0.01", "--log-level", "warning", *extra]
    with tempfile.TemporaryDirectory() as tmp, \
            realexec_server(args, Path(tmp) / "server.log", ready_timeout=120, stop_timeouts=(10, 5), cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}) as server:
        yield server.proc, server.url, server.log


def _assert_stopped_with_every_block_free(log: Path) -> None:
    out = log.read_text()
    assert "twinserve: stopped; 0 KV blocks in use" in out, out


def test_sigterm_drains_then_exits_clean(tiny_dir):
    with _server(tiny_dir, "--shutdown-timeout", "3") as (proc, base, log):
        results: dict[str, list[str]] = {}
        started = {name: threading.Event() for name in ("short", "long")}

        def stream(name, max_tokens):
            with httpx.Client(base_url=base, timeout=60) as c, c.stream(
                    "POST", "/v1/completions",
                    json={"prompt": "Once", "max_tokens": max_tokens, "stream": True, **IGNORE_EOS}) as resp:
                out = results[name] = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        out.append(line[6:])
                        started[name].set()

        threads = [threading.Thread(target=stream, args=("short", 60)),
                   threading.Thread(target=stream, args=("long", 100_000 // 50))]
        for t in threads:
            t.start()
        for ev in started.values():
            assert ev.wait(60)
        proc.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=base, timeout=10) as c:   # still listening, refusing
            e = wait_for(lambda: (r := c.post("/v1/completions", json={"prompt": "hi"})).status_code == 503 and r,
                         what="503 while draining")
            assert e.json()["error"]["code"] == "shutting_down" and e.headers["retry-after"]
            assert c.get("/health").status_code == 503
        for t in threads:
            t.join(30)
        assert results["short"][-1] == "[DONE]" and "error" not in results["short"][-2]   # finished in time
        assert json.loads(results["short"][-2])["choices"][0]["finish_reason"] == "length"
        assert results["long"][-1] == "[DONE]"                                            # cut at the timeout
        assert json.loads(results["long"][-2])["error"]["code"] == "shutting_down"
        assert proc.wait(30) == 0
        _assert_stopped_with_every_block_free(log)


def test_async_scheduling_server_streams_aborts_and_stops_clean(tiny_dir):
    """`realexec serve --async-scheduling`: the OpenAI client gets the same greedy text as
    the engine run without it, streamed chunks add up, a client that disconnects mid-stream
    (its request in flight) is aborted, and the server stops with every KV block free."""
    from core import SamplingParams
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine

    prompt = "Once upon a time"
    engine = LLMEngine(EngineArgs(model=tiny_dir, num_gpu_blocks=1024, swap_space=0.01))
    try:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        want = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    want = out.outputs[0].text
    finally:
        engine.shutdown()
    with _server(tiny_dir, "--async-scheduling", "--shutdown-timeout", "3") as (proc, base, log):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model=TINY, prompt=prompt, max_tokens=24, temperature=0.0, extra_body=IGNORE_EOS)
        assert client.completions.create(**kw).choices[0].text == want
        chunks = list(client.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        with httpx.Client(base_url=base, timeout=60) as c, c.stream(
                "POST", "/v1/completions",
                json={"prompt": prompt, "max_tokens": 2000, "stream": True, **IGNORE_EOS}) as resp:
            for n, _ in enumerate(resp.iter_lines()):
                if n >= 6:
                    break                  # hang up while the engine has the request in flight
        deadline = time.monotonic() + 30
        while metrics_of(base).get("twinserve:request_success_total{finished_reason=abort}", 0) < 1:
            assert time.monotonic() < deadline, "the disconnected stream was never aborted"
            time.sleep(0.1)
        assert client.completions.create(**kw).choices[0].text == want     # still serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        _assert_stopped_with_every_block_free(log)


def metrics_of(base: str) -> dict[str, float]:
    with httpx.Client(base_url=base, timeout=30) as c:
        return metrics(c)


def test_second_signal_exits_at_once(tiny_dir):
    with _server(tiny_dir, "--shutdown-timeout", "60") as (proc, base, log):
        started = threading.Event()

        def stream():
            try:
                with httpx.Client(base_url=base, timeout=60) as c, c.stream(
                        "POST", "/v1/completions",
                        json={"prompt": "Once", "max_tokens": 2000, "stream": True, **IGNORE_EOS}) as resp:
                    for _line in resp.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None                     # draining: would wait up to 60 s
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 1 and time.monotonic() - t0 < 5


def test_stalled_upload_does_not_hold_the_drain(tiny_dir):
    """Issue 26, defect 6: a client stalled mid-body (Content-Length 1000, 13 bytes sent)
    held the exit after SIGTERM for the whole --shutdown-timeout plus 10 s and got a
    text/plain 500. A request that never reached the engine is not waited for: it gets a
    JSON 503 at once and the server exits promptly (default --body-read-timeout 30 s)."""
    with _server(tiny_dir, "--shutdown-timeout", "30") as (proc, base, log):
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(post_head(1000, auth=False) + b'{"prompt": "h')
            time.sleep(1.0)                              # the handler is waiting for the body now
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            buf = b""
            while chunk := s.recv(65536):                # answered, then the connection closes
                buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503 ") and b"content-type: application/json" in head.lower(), buf
        assert json.loads(body)["error"]["code"] == "shutting_down"
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 10, "the exit waited for the stalled upload"
        _assert_stopped_with_every_block_free(log)


def test_serve_exits_nonzero_when_kv_blocks_leak(tiny_dir, monkeypatch, capsys):
    """`serve` checks the KV cache at exit: with every request ended, a block still in use
    is a leak, reported with its count and a non-zero exit code (not a quiet 0)."""
    import realexec.engine.llm_engine
    from core import SamplingParams
    from realexec.cli import build_parser
    from realexec.server import cli, lifecycle

    def leaky_run(server):                              # instead of serving: one request left allocated
        engine = server.config.app.state.server.llm_engine
        engine.add_request([1] * 40, SamplingParams(max_tokens=5), request_id="leak")
        engine.step()
        leaky_run.used = engine.scheduler.kv.stats().num_used_gpu_blocks

    monkeypatch.setattr(lifecycle.DrainingServer, "run", leaky_run)
    monkeypatch.setattr(realexec.engine.llm_engine, "freeze_startup_heap", lambda: 0)   # no gc.freeze of pytest's heap
    monkeypatch.setattr(realexec.engine.llm_engine, "keep_freed_memory", lambda: False)
    argv = ["serve", "--model", tiny_dir, "--block-size", "16", "--num-gpu-blocks", "64", "--swap-space", "0.01",
            "--port", "0"]
    assert cli.run_serve(build_parser(argv).parse_args(argv)) == 1
    assert leaky_run.used == 3                          # 40 prompt tokens + 1 in blocks of 16
    err = capsys.readouterr().err
    assert "twinserve: stopped; 3 KV blocks still in use at exit (leaked" in err, err


# ----------------------------------------------------------------------------- bench chaos

def test_bench_chaos_smoke(tiny_dir, tmp_path):
    import argparse

    from realexec.bench import chaos as bench_chaos

    out = tmp_path / "chaos.json"
    args = bench_chaos.add_arguments(argparse.ArgumentParser()).parse_args([
        "--model", tiny_dir, "--good", "6", "--bad", "12", "--disconnect", "2", "--slow", "2",
        "--max-tokens", "4", "--request-timeout", "4", "--save-result", str(out),
        "--server-args", "--num-gpu-blocks 512 --swap-space 0.01 --max-num-seqs 16"])
    assert bench_chaos.run(args) == 0
    r = json.loads(out.read_text())
    b, c = r["baseline"], r["chaos"]
    assert b["good_completed"] == b["good_equal_offline"] == c["good_completed"] == c["good_equal_offline"] == 6
    assert c["bad_4xx"] == 12 and c["slow_timed_out"] == 2 and c["http_5xx"] == b["http_5xx"] == 0
    assert c["kv_blocks_in_use_after"] == 0 and r["server_exit_code"] == 0 and r["server_peak_rss_mib"] > 0
    assert c["rejected_by_reason"]["request_timeout"] == 2 and c["aborted"] == 4      # 2 slow + 2 gone
