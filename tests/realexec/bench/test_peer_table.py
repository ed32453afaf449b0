"""The peer benchmark (`bench throughput --peer ...`) without vLLM or llama.cpp installed:
the vLLM runner runs in a subprocess against a fake `vllm` module put first on
PYTHONPATH, the llama-server client against a fake /completion server on 127.0.0.1."""
from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from realexec.bench.peer_table import VLLM_RUNNER, format_table, ratio_rows, run_vllm, sharegpt_sample, vllm_env
from realexec.bench.peers.llama_server import PeerError, run_llama_server

# ----------------------------------------------------------------------------- the workload


class WordTokenizer:
    """A tokenizer stand-in: one token per word, id = a stable hash of the word."""
    name_or_path = "words"

    def encode(self, text):
        return [sum(map(ord, w)) % 1000 for w in text.split()]


def write_sharegpt(path: Path, n: int = 40) -> Path:
    convs = []
    for i in range(n):
        prompt = " ".join(f"p{i}w{j}" for j in range(5 + i))          # 5 + i words
        reply = " ".join(f"r{i}w{j}" for j in range(4 + 3 * i))       # 4 + 3i words
        convs.append({"id": str(i), "conversations": [{"from": "human", "value": prompt},
                                                      {"from": "gpt", "value": reply}]})
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"},   # under the filter's 4
                                                   {"from": "gpt", "value": "a b c d e"}]})
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_sample_is_deterministic_for_a_seed_and_capped(tmp_path):
    raw = write_sharegpt(tmp_path / "sg.json")
    a = sharegpt_sample(12, seed=3, cap=20, path=raw, tokenizer=WordTokenizer(), cache=False)
    b = sharegpt_sample(12, seed=3, cap=20, path=raw, tokenizer=WordTokenizer(), cache=False)
    c = sharegpt_sample(12, seed=4, cap=20, path=raw, tokenizer=WordTokenizer(), cache=False)
    key = [(r.request_id, list(r.prompt_token_ids), r.output_len) for r in a]
    assert key == [(r.request_id, list(r.prompt_token_ids), r.output_len) for r in b]
    assert [r.request_id for r in c] != [r.request_id for r in a]               # the seed matters
    assert len(a) == 12 and len({r.request_id for r in a}) == 12
    assert all(r.request_id != "sharegpt-00040" for r in a)          # the 'hi' exchange is filtered out
    for r in a:
        i = int(r.request_id.removeprefix("sharegpt-"))
        assert list(r.prompt_token_ids) == WordTokenizer().encode(" ".join(f"p{i}w{j}" for j in range(5 + i)))
        assert r.output_len == min(4 + 3 * i, 20)                    # the real reply length, capped
    assert "seed 3" in a.source and "capped at 20" in a.source


def test_sharegpt_sample_cache_gives_the_same_requests(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINSERVE_CACHE_DIR", str(tmp_path / "cache"))
    raw = write_sharegpt(tmp_path / "sg.json")
    first = sharegpt_sample(8, seed=0, cap=16, path=raw, tokenizer=WordTokenizer())
    assert len(list((tmp_path / "cache").glob("bench-sample-*.json"))) == 1

    class Refuses(WordTokenizer):               # a cache hit never tokenizes
        def encode(self, text):
            raise AssertionError("tokenized despite the cache")

    again = sharegpt_sample(8, seed=0, cap=16, path=raw, tokenizer=Refuses())
    assert [(r.request_id, list(r.prompt_token_ids), r.output_len) for r in again] == \
           [(r.request_id, list(r.prompt_token_ids), r.output_len) for r in first]
    other = sharegpt_sample(8, seed=1, cap=16, path=raw, tokenizer=WordTokenizer())   # another key
    assert [r.request_id for r in other] != [r.request_id for r in first]


def test_sharegpt_sample_bad_sizes(tmp_path):
    raw = write_sharegpt(tmp_path / "sg.json", n=5)
    with pytest.raises(ValueError, match="--num-requests"):
        sharegpt_sample(0, path=raw, tokenizer=WordTokenizer(), cache=False)
    with pytest.raises(ValueError, match="--max-tokens-cap"):
        sharegpt_sample(2, cap=0, path=raw, tokenizer=WordTokenizer(), cache=False)
    with pytest.raises(Exception, match="only 5 requests pass the filter, 9 asked for"):
        sharegpt_sample(9, path=raw, tokenizer=WordTokenizer(), cache=False)


# ----------------------------------------------------------------------------- vLLM, faked

FAKE_VLLM = '''
"""Stand-in for the part of vllm's API that realexec/bench/peers/vllm_runner.py uses."""
import json, os, time
from types import SimpleNamespace

__version__ = "0.0-fake"


def _log(record):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class LLM:
    def __init__(self, model, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise ValueError("Available memory on node 0 is less than desired")
        self.calls = 0
        _log({"init": dict(kwargs, model=model),
              "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}})

    def generate(self, prompts, params, use_tqdm=True):
        self.calls += 1
        time.sleep(0.6 if self.calls == 1 else 0.05)     # the warm-up is slow: it must not be timed
        _log({"generate": [[p["prompt_token_ids"], s.max_tokens, s.temperature, s.ignore_eos]
                           for p, s in zip(prompts, params)]})
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[(sum(p["prompt_token_ids"]) + i) % 97
                                                                    for i in range(s.max_tokens)])])
                for p, s in zip(prompts, params)]
'''

REQUESTS = [([5, 6, 7, 8], 3), ([9, 10], 5), ([11, 12, 13], 1)]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    root = tmp_path / "fakepkgs"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    model = tmp_path / "model"
    model.mkdir()
    return model, log


def read_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_vllm_runner_pipe_with_a_fake_vllm(fake_vllm):
    model, log = fake_vllm
    r = run_vllm(sys.executable, model, REQUESTS, enforce_eager=True, threads_bind="0-1", kv_space_gib=2,
                 max_model_len=512)
    init, warm, timed = read_log(log)
    assert init["init"] == {"model": str(model), "tokenizer": str(model), "dtype": "float32", "enforce_eager": True,
                            "seed": 0, "max_model_len": 512}
    assert init["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    # exactly our requests, greedy, EOS ignored, in one call; the warm-up's prompts are other content
    assert timed["generate"] == [[ids, m, 0.0, True] for ids, m in REQUESTS]
    assert all(p not in [ids for ids, _ in REQUESTS] for p, *_ in warm["generate"])
    assert r["output_tokens"] == 3 + 5 + 1 and r["requests"] == 3
    assert r["warmup_s"] >= 0.6 and 0.05 <= r["seconds"] < r["warmup_s"]    # warm-up excluded from the timing
    assert r["token_ids"][1] == [(19 + i) % 97 for i in range(5)]
    assert r["vllm_version"] == "0.0-fake" and r["enforce_eager"] is True
    assert r["threads_bind"] == "0-1" and r["kv_space_gib"] == "2"


def test_vllm_env_binding_defaults():
    env = vllm_env("all", None, base={"VLLM_CPU_KVCACHE_SPACE": "40", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-") and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env("auto", None, base={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    for bad in (0, 1.5):                                          # vLLM parses it with int()
        with pytest.raises(ValueError, match="--vllm-kv-space must be a whole number of GiB > 0"):
            vllm_env("all", bad, base={})


def test_vllm_peer_bad_paths_are_one_line_errors(tmp_path, fake_vllm, monkeypatch):
    model, _ = fake_vllm
    with pytest.raises(ValueError, match=r"^--peer-python /nonexistent/python: not an executable file$"):
        run_vllm("/nonexistent/python", model, REQUESTS)
    with pytest.raises(ValueError, match="needs --peer-python"):
        run_vllm(None, model, REQUESTS)
    with pytest.raises(PeerError, match=r"^vllm peer: --model /nonexistent/model: not a directory$"):
        run_vllm(sys.executable, "/nonexistent/model", REQUESTS, log=tmp_path / "a.log")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))            # an interpreter without vllm
    with pytest.raises(PeerError, match=r"^vllm peer: cannot import vllm with .*ModuleNotFoundError"):
        run_vllm(sys.executable, model, REQUESTS, log=tmp_path / "b.log")


def test_vllm_peer_crash_names_the_root_cause(tmp_path, fake_vllm, monkeypatch):
    model, _ = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(PeerError, match=r"exited with status 1 .*first error: ValueError: Available memory on node 0"):
        run_vllm(sys.executable, model, REQUESTS, log=tmp_path / "c.log")
    assert "Traceback" in (tmp_path / "c.log").read_text()                  # the log is kept for the user


@pytest.mark.parametrize("content, message", [
    ("{", "not JSON"),
    ('{"requests": []}', "expected"),
    ('{"requests": [{"prompt_token_ids": [1, -2], "max_tokens": 3}]}', "request 0"),
    ('{"requests": [{"prompt_token_ids": [1], "max_tokens": 0}]}', "request 0"),
])
def test_vllm_runner_rejects_bad_request_files(tmp_path, content, message):
    import subprocess
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    p = subprocess.run([sys.executable, str(VLLM_RUNNER), "--model", str(tmp_path), "--requests", str(bad),
                        "--out", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr


# ----------------------------------------------------------------------------- llama-server, faked

class FakeLlamaServer:
    """/health and /completion; a slot context of `slot_ctx` tokens stops long requests early."""

    def __init__(self, slot_ctx: int = 10_000, delay: float = 0.05):
        self.bodies, self.in_flight, self.max_in_flight = [], 0, 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"status": "ok"}) if self.path == "/health" else self._send(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/completion" or not isinstance(body.get("prompt"), list):
                    return self._send(400, {"error": "bad request"})
                with lock:
                    outer.bodies.append(body)
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                time.sleep(delay)
                with lock:
                    outer.in_flight -= 1
                n = max(0, min(body["n_predict"], slot_ctx - len(body["prompt"])))
                self._send(200, {"content": "x" * n, "tokens_predicted": n, "tokens_evaluated": len(body["prompt"])})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_llama_server_client_sends_our_token_ids_concurrently():
    requests = [([i, i + 1, i + 2], 4 + i) for i in range(8)]
    with FakeLlamaServer() as srv:
        r = run_llama_server(srv.url + "/", requests, concurrency=4)
    warm, timed = srv.bodies[0], srv.bodies[1:]
    assert warm["prompt"] == [2, 1, 0] and warm["n_predict"] == 4                 # warm-up: other content
    assert sorted((b["prompt"], b["n_predict"]) for b in timed) == sorted((ids, m) for ids, m in requests)
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 and b["cache_prompt"] is False for b in timed)
    assert 1 < srv.max_in_flight <= 4
    assert r["output_tokens"] == sum(m for _, m in requests) and r["short_requests"] == 0
    assert r["seconds"] >= 2 * 0.05 and r["requests"] == 8


def test_llama_server_short_slots_count_only_what_came_back():
    with FakeLlamaServer(slot_ctx=8) as srv:                      # prompt 3 + at most 5 tokens
        r = run_llama_server(srv.url, [([1, 2, 3], 4), ([4, 5, 6], 9)], concurrency=2)
    assert r["output_tokens"] == 4 + 5 and r["short_requests"] == 1


def test_llama_server_unreachable_or_bad_url():
    import socket
    with socket.socket() as s:                                   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PeerError, match=rf"^--peer-url http://127.0.0.1:{port}: no llama-server answers"):
        run_llama_server(f"http://127.0.0.1:{port}", REQUESTS)
    with pytest.raises(ValueError, match="--peer-url 'localhost:8080': expected http://HOST:PORT"):
        run_llama_server("localhost:8080", REQUESTS)


# ----------------------------------------------------------------------------- the table

def test_ratio_table_uses_useful_tokens_over_wall_time():
    rows = ratio_rows([("twinserve", {"output_tokens": 1000, "seconds": 10.0}),
                       ("vLLM 0.32 compiled", {"output_tokens": 1000, "seconds": 4.0}),
                       ("llama-server", {"output_tokens": 900, "seconds": 9.0})])
    assert [round(r["output_tok_s"], 6) for r in rows] == [100.0, 250.0, 100.0]
    assert [round(r["ratio_vs_twinserve"], 6) for r in rows] == [1.0, 2.5, 1.0]
    text = format_table(rows).splitlines()
    assert text[0].split() == ["engine", "output", "tok/s", "useful", "output", "tokens", "wall", "s",
                               "ratio", "vs", "twinserve"]
    assert text[2].split()[-4:] == ["250.0", "1000", "4.0", "2.50x"]
    assert ratio_rows([("vLLM", {"output_tokens": 1, "seconds": 1.0})])[0]["ratio_vs_twinserve"] is None


# ----------------------------------------------------------------------------- the command

def test_bench_throughput_bad_peer_options_fail_before_loading(capsys):
    from realexec.cli import main

    for argv, message in [
        (["--peer", "vllm", "--peer-python", "/nonexistent/python"], "--peer-python /nonexistent/python: not an"),
        (["--peer", "vllm-eager"], "needs --peer-python"),
        (["--peer", "llama-server"], "needs --peer-url"),
        (["--peer", "llama-server", "--peer-url", "127.0.0.1:80"], "expected http://HOST:PORT"),
    ]:
        assert main(["bench", "throughput", "--model", "/nonexistent/model", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_bench_throughput_runs_every_peer_alone_and_writes_the_table(tmp_path, fake_vllm, capsys):
    from tests.tiny_models import save_tiny_llama
    from traces import Trace, TraceRequest, save_trace
    from realexec.cli import main

    _, log = fake_vllm
    model = tmp_path / "tiny"
    save_tiny_llama(model, vocab_size=128)
    trace = tmp_path / "t.json"
    save_trace(Trace([TraceRequest(f"r{i}", 0.0, 5 + i, 3 + i) for i in range(4)]), trace, "test")
    out = tmp_path / "res.json"
    with FakeLlamaServer() as srv:
        rc = main(["bench", "throughput", "--trace", str(trace), "--model", str(model), "--num-gpu-blocks", "64",
                   "--block-size", "4", "--peer", "vllm", "--peer", "vllm-eager", "--peer", "llama-server", "--peer", "hf",
                   "--peer-python", sys.executable, "--peer-url", srv.url, "--peer-concurrency", "2",
                   "--vllm-threads-bind", "0", "--output-json", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    ours_ids = [b["prompt"] for b in srv.bodies[1:]]
    timed = [rec["generate"] for rec in read_log(log) if "generate" in rec][1::2]      # compiled, eager
    assert [rec["init"]["enforce_eager"] for rec in read_log(log) if "init" in rec] == [False, True]
    for calls in timed:                                          # the very same token ids and max_tokens
        assert sorted(ids for ids, *_ in calls) == sorted(ours_ids)
        assert [m for _, m, *_ in calls] == [3, 4, 5, 6]
    assert [row["engine"] for row in res["table"]] == ["twinserve", "vLLM 0.0-fake compiled", "vLLM 0.0-fake eager",
                                                       "llama-server -np>=2", "HF generate (batch 16)"]
    assert all(row["output_tokens"] == 3 + 4 + 5 + 6 for row in res["table"])
    assert res["table"][0]["ratio_vs_twinserve"] == 1.0
    assert res["ratio"] == pytest.approx(1 / res["table"][-1]["ratio_vs_twinserve"])      # twinserve / HF, as before
    assert res["peers"]["vllm"]["threads_bind"] == "0" and res["workload"]["max_tokens"] == 18
    stdout = capsys.readouterr().out
    assert "ratio vs twinserve" in stdout and "vLLM 0.0-fake eager" in stdout


def test_export_hf_copies_the_loadable_directory(tmp_path):
    from tests.tiny_models import save_tiny_llama
    from realexec.models.export_hf import export_hf

    src = tmp_path / "src"
    save_tiny_llama(src, vocab_size=64)
    out = export_hf(str(src), tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 64
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        export_hf(str(src), out)
