"""The OpenAI-compatible server end to end, over loopback HTTP: the real `openai` client
and raw httpx against uvicorn running our FastAPI app in a background thread.

One server per model for the whole module: a tiny random Llama (with SmolLM2's tokenizer
and chat template, so text, chat and stop strings are real) for almost everything, a
second tiny one with a queue limit for the 503 test, and the embedded SmolLM2 for one
chat answer that has to make sense.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from realexec.config import EngineArgs
from tests.tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
TINY = "tiny-llama"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- servers

@contextmanager
def serve(app):
    """Run `app` under uvicorn on a free loopback port in a background thread; yield its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's tokenizer (vocab 49152, chat template)."""
    from transformers import AutoTokenizer

    from realexec.bench.throughput import model_dir

    path = tmp_path_factory.mktemp("models") / TINY
    save_tiny_llama(path, tokenizer=AutoTokenizer.from_pretrained(model_dir(None)), max_position_embeddings=4096,
                    initializer_range=0.15, tie_word_embeddings=True)
    return str(path)


def tiny_engine(path: str, **kwargs):
    from realexec.engine.llm_engine import LLMEngine

    kwargs.setdefault("block_size", 16)
    kwargs.setdefault("num_gpu_blocks", 1024)
    kwargs.setdefault("swap_space", 0.01)
    return LLMEngine(EngineArgs(model=path, **kwargs))


@pytest.fixture(scope="module")
def url(tiny_dir) -> str:
    from realexec.server.app import create_app

    with serve(create_app(tiny_engine(tiny_dir))) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(http) -> dict[str, float]:
    """Every sample of /metrics as {"name{label=value,...}": value} (labels sorted, model_name dropped)."""
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def idle(http) -> dict[str, float]:
    """Metrics once nothing runs or waits and the KV cache is empty."""
    def check():
        m = metrics(http)
        ok = (m["twinserve:num_requests_running"] == 0 and m["twinserve:num_requests_waiting"] == 0
              and m["twinserve:kv_cache_usage_perc"] == 0)
        return m if ok else None
    return wait_for(check, what="the engine to drain")


GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}


# ----------------------------------------------------------------------------- basics

def test_health_and_models(http, oai):
    assert http.get("/health").json() == {"status": "ok"}
    models = oai.models.list().data
    assert [m.id for m in models] == [TINY]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 2048


def test_completion(oai, tiny_dir):
    from transformers import AutoTokenizer

    r = oai.completions.create(model=TINY, prompt="The capital of France is", max_tokens=8, extra_body=IGNORE_EOS,
                               **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == TINY
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    n_prompt = len(AutoTokenizer.from_pretrained(tiny_dir)("The capital of France is").input_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)


def test_completion_stream_matches_non_stream(oai, http):
    kwargs = dict(model=TINY, prompt="Once upon a time", max_tokens=12, extra_body=IGNORE_EOS, **GREEDY)
    full = oai.completions.create(**kwargs).choices[0].text
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # The raw wire format: SSE "data: {...}" events ending in "data: [DONE]".
    body = dict(kwargs, stream=True)
    body.pop("extra_body")
    with http.stream("POST", "/v1/completions", json={**body, **IGNORE_EOS}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == full


def test_chat(oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    r = oai.chat.completions.create(model=TINY, messages=messages, max_completion_tokens=10, extra_body=IGNORE_EOS,
                                    **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens > 10                            # the template's tokens are counted
    chunks = list(oai.chat.completions.create(model=TINY, messages=messages, max_tokens=10, stream=True,
                                              stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
                                              **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == r.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n_and_batched_prompts(oai):
    r = oai.completions.create(model=TINY, prompt="Hello", n=2, max_tokens=6, seed=7, temperature=1.0,
                               extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 12
    r = oai.completions.create(model=TINY, prompt=["Hello", "Goodbye, my friend"], n=2, max_tokens=5,
                               extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens == 20
    one = oai.completions.create(model=TINY, prompt="Hello", max_tokens=1).usage.prompt_tokens
    two = oai.completions.create(model=TINY, prompt="Goodbye, my friend", max_tokens=1).usage.prompt_tokens
    assert r.usage.prompt_tokens == one + two
    # token-id prompts: one list, and a batch of lists
    r = oai.completions.create(model=TINY, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, extra_body=IGNORE_EOS)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6
    # n=2 streamed: both choices arrive and finish
    chunks = list(oai.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=4, stream=True, extra_body=IGNORE_EOS))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_strings(oai):
    kwargs = dict(model=TINY, prompt="A list of words:", max_tokens=24, extra_body=IGNORE_EOS, **GREEDY)
    full = oai.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    expected = full[:full.find(stop)]
    r = oai.completions.create(stop=stop, **kwargs)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(oai.completions.create(stop=["\x00never", stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(oai):
    def sample(seed):
        return oai.completions.create(model=TINY, prompt="Random:", max_tokens=16, temperature=1.0, seed=seed,
                                      extra_body=IGNORE_EOS).choices[0].text
    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b and a != c
    chat = [oai.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                        temperature=1.0, seed=5, extra_body=IGNORE_EOS).choices[0].message.content
            for _ in range(2)]
    assert chat[0] == chat[1]


def test_logprobs(oai):
    r = oai.completions.create(model=TINY, prompt="Hello", max_tokens=5, logprobs=3, extra_body=IGNORE_EOS,
                               **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) >= 3
        assert value == pytest.approx(max(top.values()))        # greedy: the chosen token is the best
    r = oai.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    # streamed: logprobs ride along with each delta
    chunks = list(oai.completions.create(model=TINY, prompt="Hello", max_tokens=5, logprobs=1, stream=True,
                                         extra_body=IGNORE_EOS, **GREEDY))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 5


def test_100_concurrent_streams(url, http):
    before = metrics(http)

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            max_tokens = 2 + i % 5
            stream = await client.completions.create(
                model=TINY, prompt=f"Request number {i} says", max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body=IGNORE_EOS, temperature=0.8, seed=i)
            text, usage, reason = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    usage = chunk.usage
            return max_tokens, usage, reason, text

        try:
            return await asyncio.gather(*(one(i) for i in range(100)))
        finally:
            await client.close()

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert len(results) == 100
    for max_tokens, usage, reason, text in results:
        assert usage.completion_tokens == max_tokens and reason == "length" and text
    after = idle(http)
    assert after["twinserve:generation_tokens_total"] - before["twinserve:generation_tokens_total"] == \
        sum(r[0] for r in results)
    assert after["twinserve:request_success_total{finished_reason=length}"] - \
        before["twinserve:request_success_total{finished_reason=length}"] == 100
    assert elapsed < 60


# ----------------------------------------------------------------------------- errors

def _error(resp, status: int, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_requests(http, path):
    chat = path.endswith("chat/completions")
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    post = lambda body: http.post(path, json=body)  # noqa: E731
    e = _error(http.post(path, content=b'{"prompt": "hi", ', headers={"content-type": "application/json"}), 400)
    assert "JSON" in e["message"]
    _error(post({**base, "max_tokens": -3}), 400, "max_tokens")
    _error(post({**base, "temperature": -0.5}), 400, "temperature")
    _error(post({**base, "top_p": 0}), 400, "top_p")
    _error(post({**base, "n": 0}), 400, "n")
    _error(post({**base, "max_tokens": "many"}), 400, "max_tokens")
    _error(post({**base, "model": "gpt-4"}), 404, "model")
    _error(post({"model": TINY}), 400, "messages" if chat else "prompt")
    long_text = "hello " * 3000                                  # > max_model_len 2048 tokens
    long = {"messages": [{"role": "user", "content": long_text}]} if chat else {"prompt": long_text}
    e = _error(post(long), 400, "messages" if chat else "prompt")
    assert "maximum context length is 2048 tokens" in e["message"] and e["code"] == "context_length_exceeded"
    if not chat:
        _error(post({"prompt": list(range(3000))}), 400, "prompt")
        _error(post({"prompt": [[1, 2], []]}), 400, "prompt")
        _error(post({"prompt": [10**9]}), 400, "prompt")
        _error(post({"prompt": ""}), 400, "prompt")
    assert http.get("/health").json() == {"status": "ok"}
    _error(http.get("/v1/nothing-here"), 404)


def test_validation_contract(http, caplog):
    """The OpenAI/vLLM error contract: the param named is the one at fault, no internal ids
    leak, bad bytes and content types get their own codes; a missing model means the
    served one, unknown fields are accepted and logged once."""
    e = _error(http.post("/v1/completions", json={"prompt": "hi", "n": 600}), 400, "n")
    assert "cmpl-" not in e["message"] and "req-" not in e["message"]
    e = _error(http.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                         headers={"content-type": "application/json"}), 400)
    assert e["code"] == "invalid_encoding" and "UTF-8" in e["message"]
    e = _error(http.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": ""}), 415)
    assert e["code"] == "unsupported_media_type" and "application/json" in e["message"]
    e = _error(http.post("/v1/completions", content=b'prompt=hi',
                         headers={"content-type": "application/x-www-form-urlencoded"}), 415)
    e = _error(http.post("/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}',
                         headers={"content-type": "application/json"}), 400)
    assert e["code"] == "invalid_json"
    e = _error(http.post("/v1/completions", json=["prompt"]), 400)
    assert e["code"] == "invalid_json"
    e = _error(http.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": [10**6]}), 400,
               "stop_token_ids")
    _error(http.post("/v1/completions", json={"prompt": "hi", "best_of": 3}), 400, "best_of")
    e = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 100_000_000}), 400, "max_tokens")
    assert "maximum context length is 2048 tokens" in e["message"] and "100000000 in the completion" in e["message"]
    # no model: the served one answers; unknown fields: accepted, ignored, logged once per name
    with caplog.at_level("WARNING", logger="twinserve.server"):
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "frobnicate": 1, **GREEDY})
            assert r.status_code == 200 and r.json()["model"] == TINY
    assert sum("frobnicate" in rec.getMessage() for rec in caplog.records) == 1


def test_large_body_does_not_delay_other_requests(url, http):
    """A 3.5 MB prompt is read, parsed and tokenized in a worker thread (then refused as too
    long): small requests meanwhile are served as if it were not there."""
    big = json.dumps({"prompt": "lorem ipsum dolor sit amet " * 130_000, "max_tokens": 2}).encode()
    done = {}

    def send_big():
        with httpx.Client(base_url=url, timeout=120) as c:
            done["resp"] = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            done["t"] = time.monotonic()
    t = threading.Thread(target=send_big)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)                                    # the big one is being parsed / tokenized now
    latencies = []
    for _ in range(3):
        s0 = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **IGNORE_EOS})
        assert r.status_code == 200
        latencies.append(time.monotonic() - s0)
    small_done = time.monotonic()
    t.join(120)
    e = _error(done["resp"], 400, "prompt")
    assert e["code"] == "context_length_exceeded"
    assert done["t"] > small_done, "the big request finished first: the test proved nothing"
    assert max(latencies) < 0.5 * (done["t"] - t0), (latencies, done["t"] - t0)


def test_bad_requests_through_openai_client(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=TINY, prompt="hi", max_tokens=-1)
    assert err.value.status_code == 400 and "max_tokens" in err.value.message
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=TINY, prompt="x " * 5000, stream=True)   # refused before the 200
    r = oai.completions.create(model=TINY, prompt="still fine", max_tokens=2, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 2


def test_prompts_times_n_capped_up_front(oai, http):
    """Issue 26, defect 2: 20,000 one-token prompts in one 100 KB request ran for minutes
    and starved everyone else. prompts x n over --max-choices-per-request (256 by
    default) is a 400 naming the limit and the flag, answered before tokenizing."""
    before = metrics(http)["twinserve:request_rejected_total{reason=invalid_value}"]
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=TINY, prompt=[[1]] * 20_000, max_tokens=1)
    assert time.monotonic() - t0 < 10                                  # refused, not run
    assert err.value.status_code == 400 and err.value.code == "invalid_value"
    assert err.value.param == "prompt" and "--max-choices-per-request 256" in err.value.message
    assert "20000 choices" in err.value.message
    e = _error(http.post("/v1/completions", json={"prompt": [[1]] * 17, "n": 16, "max_tokens": 1}), 400, "prompt")
    assert "17 prompt(s) x n=16 = 272 choices" in e["message"]
    assert metrics(http)["twinserve:request_rejected_total{reason=invalid_value}"] == before + 2
    r = oai.completions.create(model=TINY, prompt=[[1]] * 16, n=16, max_tokens=1)    # exactly 256: served
    assert len(r.choices) == 256 and sorted(c.index for c in r.choices) == list(range(256))
    idle(http)


def test_deeply_nested_json_is_a_400(http, caplog):
    """Issue 26, defect 3: 200 KB of '[' was a 500 (RecursionError) with two tracebacks
    logged; it is malformed JSON like any other (400 invalid_json), and nothing is logged."""
    before = metrics(http)["twinserve:request_rejected_total{reason=invalid_json}"]
    with caplog.at_level("WARNING"):
        for body in (b"[" * 200_000, b'{"prompt": ' + b"[" * 100_000 + b"1" + b"]" * 100_000 + b"}"):
            for path in ("/v1/completions", "/v1/chat/completions"):
                e = _error(http.post(path, content=body, headers={"content-type": "application/json"}), 400)
                assert e["code"] == "invalid_json" and "nested too deeply" in e["message"], e
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]
    assert metrics(http)["twinserve:request_rejected_total{reason=invalid_json}"] == before + 4
    assert http.get("/health").json() == {"status": "ok"}


# ----------------------------------------------------------------------------- aborts, metrics

def test_disconnect_mid_stream_aborts_and_frees_kv(url, http):
    before = idle(http)
    aborted = "twinserve:request_success_total{finished_reason=abort}"
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "Long story:", "max_tokens": 1900,
                                                            "stream": True, **IGNORE_EOS}) as resp:
            lines = resp.iter_lines()
            got = [line for line, _ in zip((ln for ln in lines if ln.startswith("data: ")), range(3))]
            assert len(got) == 3
            mid = metrics(http)
            assert mid["twinserve:num_requests_running"] == 1 and mid["twinserve:kv_cache_usage_perc"] > 0
        # leaving the blocks closes the connection mid-stream
    after = wait_for(lambda: (m := metrics(http))[aborted] > before[aborted] and m, what="the abort")
    assert after[aborted] == before[aborted] + 1
    after = idle(http)
    # far fewer than the 1900 tokens asked for were generated
    assert after["twinserve:generation_tokens_total"] - before["twinserve:generation_tokens_total"] < 1000


def test_disconnect_non_stream_aborts(url, http):
    before = idle(http)
    aborted = "twinserve:request_success_total{finished_reason=abort}"
    with httpx.Client(base_url=url, timeout=httpx.Timeout(0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "go"}],
                                                      "max_tokens": 1900, **IGNORE_EOS})
    wait_for(lambda: metrics(http)[aborted] > before[aborted], what="the abort")
    idle(http)


def test_metrics_parse_and_move(http, oai):
    before = idle(http)
    names = {f.name for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                 "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                 "generation_tokens", "request_success", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds", "request_queue_time_seconds"):
        assert f"twinserve:{name}" in names, name
    r = oai.completions.create(model=TINY, prompt="Counting tokens", max_tokens=7, extra_body=IGNORE_EOS)
    after = idle(http)

    def moved(key):
        return after[key] - before[key]
    assert moved("twinserve:prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("twinserve:generation_tokens_total") == 7
    assert moved("twinserve:request_success_total{finished_reason=length}") == 1
    assert moved("twinserve:time_to_first_token_seconds_count") == 1
    assert moved("twinserve:e2e_request_latency_seconds_count") == 1
    assert moved("twinserve:inter_token_latency_seconds_count") == 6
    assert moved("twinserve:e2e_request_latency_seconds_sum") > 0
    # every prompt token is looked up, none is found (prefix caching is off); 1024 blocks never
    # run out, so nobody was ever preempted
    assert moved("twinserve:prefix_cache_queries_total") == r.usage.prompt_tokens
    assert after["twinserve:prefix_cache_hits_total"] == 0 and after["twinserve:num_preemptions_total"] == 0
    rejected = "twinserve:request_rejected_total{reason=invalid_value}"
    _error(http.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 2}), 400, "prompt")
    assert metrics(http)[rejected] == after[rejected] + 1


def test_queue_limit_answers_503(tiny_dir):
    from realexec.server.app import create_app

    from realexec.server.config import ServerConfig

    app = create_app(tiny_engine(tiny_dir, max_num_seqs=1), served_model_name="limited",
                     config=ServerConfig(max_waiting_requests=1))
    body = {"prompt": "Keep going", "max_tokens": 1900, "stream": True, **IGNORE_EOS}
    with serve(app) as base, httpx.Client(base_url=base, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()        # keep a reference: a dropped iterator closes the stream
            next(line for line in lines if line.startswith("data: "))                   # admitted, running
            with client.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200                                       # queued (1 waiting)
                resp = client.post("/v1/completions", json={**body, "stream": False})
                e = _error(resp, 503)
                assert e["code"] == "queue_full" and resp.headers["retry-after"] == "1"
                e = _error(client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "stream": True}), 503)
                m = {s.name + str(s.labels.get("reason", "")): s.value
                     for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
                assert m["twinserve:num_requests_waiting"] == 1 and m["twinserve:num_requests_running"] == 1
                assert m["twinserve:request_rejected_totalqueue_full"] == 2
                # more prompts than may ever wait can never be queued: 400 (not "retry later")
                e = _error(client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1}), 400,
                           "prompt")
                assert e["code"] == "invalid_value" and "--max-waiting-requests 1" in e["message"]
        assert client.get("/health").json() == {"status": "ok"}
        # both streams were closed by the client: the engine aborts both (on the engine thread,
        # after the server noticed the disconnects: not before this client's next request can
        # arrive, so wait for it) and serves again
        wait_for(lambda: metrics(client)["twinserve:num_requests_waiting"] == 0
                 and metrics(client)["twinserve:num_requests_running"] == 0, what="both streams aborted")
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, **IGNORE_EOS})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ----------------------------------------------------------------------------- bench serve, CLI

def test_bench_serve_against_server(url, tmp_path, capsys):

    from realexec.bench import serve as bench_serve
    from realexec.cli import build_parser

    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--url", url, "--trace", str(ROOT / "traces/sharegpt.json"),
                              "--num-requests", "8", "--rate", "20", "--max-tokens-cap", "6", "--seed", "1",
                              "--goodput", "ttft:60000", "e2el:60000", "--save-result", str(out)]
    args = build_parser(argv).parse_args(argv)
    assert args._run == "realexec.bench.serve:run"
    assert bench_serve.run(args) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    result = json.loads(out.read_text())
    from traces import load_trace
    trace = load_trace(ROOT / "traces/sharegpt.json", limit=8)
    assert result["completed"] == 8 and result["failed"] == 0 and result["model_id"] == TINY
    assert result["output_lens"] == [min(r.output_len, 6) for r in trace]
    assert result["total_output_tokens"] == sum(result["output_lens"]) and result["output_tokens_source"] == "usage"
    assert all(n > 0 for n in result["input_lens"]) and result["total_input_tokens"] == sum(result["input_lens"])
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration"):
        assert result[key] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in result
    assert result["mean_ttft_ms"] > 0 and result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert len(result["itls"]) == len(result["ttfts"]) == len(result["generated_texts"]) == 8
    assert result["errors"] == [""] * 8


def test_bench_serve_progress_bar_counts_requests(url, capsys):
    import argparse
    import asyncio
    import re

    from realexec.bench import serve as bench_serve

    args = bench_serve.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--url", url, "--trace", str(ROOT / "traces/sharegpt.json"), "--num-requests", "4", "--rate", "inf",
         "--max-tokens-cap", "3"])
    summary, _ = asyncio.run(bench_serve.benchmark(args, bench_serve.build_requests(args), progress=True))
    err = capsys.readouterr().err
    counts = [(int(a), int(b)) for a, b in re.findall(r"bench serve:[^\r\n]*?(\d+)/(\d+) \[", err)]
    assert summary["completed"] == 4 and counts[-1] == (4, 4)
    assert re.search(r"4/4 \[[^\]]*out tok/s, 0 in flight\]", err)


def test_bench_serve_chat_endpoint_and_bad_args(url, tmp_path):
    import argparse

    from realexec.bench import serve as bench_serve

    parser = bench_serve.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--url", url, "--trace", str(ROOT / "traces/sharegpt.json"), "--num-requests", "3",
                              "--max-tokens-cap", "3", "--endpoint", "/v1/chat/completions",
                              "--max-concurrency", "1", "--save-result", str(tmp_path / "r.json")])
    assert bench_serve.run(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 3 and result["max_concurrent_requests"] == 1 and result["backend"] == "openai-chat"
    for bad in (["--rate", "0"], ["--goodput", "ttft"], ["--goodput", "speed:3"], ["--num-requests", "0"],
                ["--endpoint", "/v1/embeddings"]):
        with pytest.raises(ValueError):
            bench_serve.run(parser.parse_args(["--url", url, *bad]))


def test_server_modules_import_one_way():
    """errors <- metrics <- async_engine <- app: no module imports one above it."""
    import subprocess
    import sys

    code = ("import sys; import realexec.server.metrics; "
            "assert 'realexec.server.async_engine' not in sys.modules and 'realexec.server.app' not in sys.modules; "
            "import realexec.server.errors as e; import realexec.server.async_engine; "
            "assert 'realexec.server.app' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_serve_parser():

    from realexec.cli import build_parser

    argv = ["serve", "--port", "0", "--max-num-seqs", "8", "--enable-prefix-caching",
            "--preemption-mode", "swap", "--max-waiting-requests", "4"]
    args = build_parser(argv).parse_args(argv)
    assert (args.host, args.port, args.max_num_seqs, args.enable_prefix_caching, args.preemption_mode,
            args.max_waiting_requests, args.served_model_name) == ("127.0.0.1", 0, 8, True, "swap", 4, None)
    assert args._run == "realexec.server.cli:run_serve"
    from realexec.server.cli import run_serve
    for bad, message in ((["--queue-policy", "nope"], "unknown queue policy 'nope'"),
                         (["--victim-policy", "oldest"], "unknown victim policy"),
                         (["--max-n", "0"], "--max-n must be >= 1"),
                         (["--max-choices-per-request", "0"], "--max-choices-per-request must be >= 1"),
                         (["--max-waiting-requests", "0"], "--max-waiting-requests must be >= 1"),
                         (["--body-read-timeout", "nan"], "--body-read-timeout must be > 0 seconds")):
        argv = ["serve", *bad]
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=message):
            run_serve(build_parser(argv).parse_args(argv))
        assert time.monotonic() - t0 < 1.0            # refused before the model loads
    from realexec.server.app import default_served_model_name
    assert default_served_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_served_model_name("/models/Llama-3.2-1B/") == "Llama-3.2-1B"
    assert default_served_model_name("x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"


# ----------------------------------------------------------------------------- the real model

def test_smollm2_chat_answers_paris():
    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.app import create_app

    app = create_app(LLMEngine(EngineArgs(block_size=16, kv_cache_memory=0.25, swap_space=0.01)))
    with serve(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=32, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")
        # min_tokens: the model wants to stop after a few tokens; it must not emit EOS (or the
        # <|im_start|> of a new turn after it) before 28 tokens exist.
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=30, temperature=0,
                                           logprobs=True, extra_body={"min_tokens": 28},
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        tokens = [t.token for t in r.choices[0].logprobs.content]
        assert len(tokens) >= 28 and r.usage.completion_tokens == len(tokens)
        assert not {"<|im_end|>", "<|im_start|>"} & set(tokens[:28]), tokens


def test_engine_crash_is_reported(tiny_dir):
    from realexec.server.app import create_app

    engine = tiny_engine(tiny_dir, num_gpu_blocks=64)
    real_step, calls = engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("simulated executor failure")
        return real_step()

    engine.step = step
    with serve(create_app(engine)) as base, httpx.Client(base_url=base, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": True,
                                                            **IGNORE_EOS}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
        _error(client.get("/health"), 503)
        _error(client.post("/v1/completions", json={"prompt": "hi"}), 503)
