"""`serve --simulate`: the OpenAI server in front of the simulated executor.

The OpenAI-client and HTTP checks of test_server.py run here unchanged against a
simulated Llama-3-8B on an H100 (roofline-priced, served under test_server's model name,
with the embedded SmolLM2 tokenizer): they are imported into this module, so pytest runs
them with this module's `url` / `http` / `oai` / `tiny_dir` fixtures, and the real-server
module is not slowed down. Then what only the simulated server has: the same Prometheus
names as the real server, and several replicas from one process.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from realexec.config import EngineArgs
from tests.realexec.server.test_server import (  # noqa: F401  (the imported tests run here, on this module's fixtures)
    IGNORE_EOS, ROOT, TINY, metrics, serve, test_100_concurrent_streams, test_bad_requests,
    test_bad_requests_through_openai_client, test_bench_serve_against_server, test_chat, test_completion,
    test_completion_stream_matches_non_stream, test_deeply_nested_json_is_a_400,
    test_disconnect_mid_stream_aborts_and_frees_kv, test_disconnect_non_stream_aborts, test_health_and_models,
    test_large_body_does_not_delay_other_requests, test_logprobs, test_metrics_parse_and_move,
    test_n_and_batched_prompts, test_prompts_times_n_capped_up_front, test_seed_reproducible, test_stop_strings,
    test_validation_contract)

SIM_ARGS = dict(simulate="roofline", sim_model="Llama-3-8B", sim_hardware="H100", block_size=16,
                num_gpu_blocks=1024, swap_space=0.01)


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    """The tokenizer the simulated server answers with (the embedded SmolLM2's)."""
    from realexec.bench.throughput import model_dir

    return str(model_dir(None))


@pytest.fixture(scope="module")
def sim_engine():
    from realexec.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(**SIM_ARGS))


@pytest.fixture(scope="module")
def url(sim_engine) -> str:
    from realexec.server.app import create_app

    with serve(create_app(sim_engine, served_model_name=TINY)) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_it_is_simulated(sim_engine, http):
    """The fixture really is the simulated engine, pricing every step it ran."""
    from realexec.executor.simulated import SimulatedExecutor

    r = http.post("/v1/completions", json={"prompt": "count", "max_tokens": 3, **IGNORE_EOS})
    assert r.status_code == 200
    worker = sim_engine.executor.driver
    assert isinstance(sim_engine.executor, SimulatedExecutor) and worker.num_steps >= 3 and worker.priced_s > 0


def _metric_names(base: str) -> tuple[set[str], set[tuple[str, tuple[str, ...]]]]:
    """Every metric family's name, and every sample's name with its label names, once a
    request has gone through."""
    with httpx.Client(base_url=base, timeout=120) as c:
        assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, **IGNORE_EOS}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 2}).status_code == 400
        families = list(text_string_to_metric_families(c.get("/metrics").text))
    return ({f.name for f in families},
            {(s.name, tuple(sorted(s.labels))) for f in families for s in f.samples})


def test_metric_names_equal_the_real_servers(url, tmp_path):
    from transformers import AutoTokenizer

    from realexec.bench.throughput import model_dir
    from realexec.server.app import create_app
    from tests.realexec.server.test_server import tiny_engine
    from tests.tiny_models import save_tiny_llama

    path = tmp_path / TINY
    save_tiny_llama(path, tokenizer=AutoTokenizer.from_pretrained(model_dir(None)), tie_word_embeddings=True)
    with serve(create_app(tiny_engine(str(path)))) as real:
        real_names = _metric_names(real)
    sim_names = _metric_names(url)
    assert sim_names == real_names
    assert "twinserve:time_to_first_token_seconds" in sim_names[0]


def test_a_queued_stream_whose_client_leaves_is_aborted_at_once():
    """max_num_seqs=1: one stream runs, a second waits in the queue (its 200 and headers
    are out, no token is due). Its client disconnects: the server notices from the
    connection alone (no write fails, none is made), aborts it and frees its place in the
    queue while the first stream keeps running."""
    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.app import create_app
    from tests.realexec.server.test_server import wait_for

    aborted = "twinserve:request_success_total{finished_reason=abort}"
    body = {"prompt": "Long story:", "max_tokens": 1900, "stream": True, **IGNORE_EOS}
    app = create_app(LLMEngine(EngineArgs(**{**SIM_ARGS, "max_num_seqs": 1})), served_model_name=TINY)
    with serve(app) as base, httpx.Client(base_url=base, timeout=30) as http, \
            httpx.Client(base_url=base, timeout=30) as first_client, \
            first_client.stream("POST", "/v1/completions", json=body) as first:
        first_lines = (ln for ln in first.iter_lines() if ln.startswith("data: "))
        next(first_lines)
        with httpx.Client(base_url=base, timeout=30) as second_client, \
                second_client.stream("POST", "/v1/completions", json=body) as second:
            assert second.status_code == 200
            m = metrics(http)
            assert m["twinserve:num_requests_running"] == 1 and m["twinserve:num_requests_waiting"] == 1
        # the second connection is closed, unread
        m = wait_for(lambda: (m := metrics(http))["twinserve:num_requests_waiting"] == 0 and m, timeout=5,
                     what="the queued request's abort")
        assert m[aborted] == 1 and m["twinserve:num_requests_running"] == 1
        # ... and its handler ended (a drain would wait for one that did not)
        wait_for(lambda: app.state.server.in_flight == 1, timeout=5, what="the second handler to end")
        next(first_lines)                        # the first stream goes on


# ----------------------------------------------------------------------------- the CLI

def test_replicas_serve_from_one_process_and_drain_together(tmp_path):
    """`--replicas 2`: two engines on ports P and P+1 of one process, each with its own
    metrics; one SIGINT drains both and the process exits 0 with every block free."""
    from core.procs import free_ports, serve_process, stop, wait_healthy

    port = free_ports(2)
    cmd = [sys.executable, "-m", "realexec", "serve", "--port", str(port), "--replicas", "2", "--simulate",
           "roofline", "--sim-model", "Llama-3-8B", "--sim-hardware", "H100", "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with serve_process(cmd, port, log, ready_timeout=180, stop_timeouts=(20, 5), cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}) as server:
        other = f"http://127.0.0.1:{port + 1}"
        wait_healthy(other, server.proc, log, timeout=30)
        clients = [httpx.Client(base_url=base, timeout=60) for base in (server.url, other)]
        try:
            assert [c.get("/v1/models").json()["data"][0]["id"] for c in clients] == ["Llama-3-8B"] * 2
            r = clients[1].post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, **IGNORE_EOS})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            gen = [metrics(c)["twinserve:generation_tokens_total"] for c in clients]
            assert gen == [0, 5]
        finally:
            for c in clients:
                c.close()
        assert stop(server.proc, (20, 5)) == 0
    out = log.read_text()
    assert out.count("twinserve: serving simulated (roofline: Llama-3-8B on H100) 'Llama-3-8B'") == 2, out
    assert f":{port}/v1" in out and f":{port + 1}/v1" in out
    assert "twinserve: stopped; 0 KV blocks in use" in out


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2"], "--replicas N serves simulated engines: add --simulate COST_MODEL"),
    (["--replicas", "0", "--simulate", "roofline"], "--replicas must be >= 1, got 0"),
    (["--replicas", "3", "--simulate", "roofline", "--port", "65534"], "needs ports 65534..65536"),
    (["--simulate", "nope.json"], "--simulate 'nope.json': no such file"),
    (["--simulate", "roofline", "--sim-model", "Llama-9"], "unknown model 'Llama-9'; choose one of"),
    (["--sim-hardware", "H100"], "--sim-hardware only applies with --simulate roofline"),
])
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    """Refused before anything loads: exit code 2 and one `error:` line naming the flag."""
    from realexec.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_simulate_output_choices_in_help():
    proc = subprocess.run([sys.executable, "-m", "realexec", "serve", "--help"], cwd=Path(ROOT), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--simulate COST_MODEL", "--sim-model", "--sim-hardware", "--simulate-output {random,echo}",
                 "--replicas"):
        assert flag in proc.stdout, flag
    assert "embedded SmolLM2 one is fine" in " ".join(proc.stdout.split())
