"""`bench simulate-vs-real`'s pieces that need no server: the --loads flag and the table."""
from __future__ import annotations

import pytest

from realexec.bench.simulated import ROWS, _parse_loads, comparison_table


def test_bad_run_counts_are_refused_before_any_server_starts(tmp_path):
    import argparse

    from realexec.bench.simulated import add_vs_real_arguments, run_vs_real

    for flag, match in (("--real-runs", "--real-runs must be >= 1, got 0"),
                        ("--num-requests", "--num-requests must be >= 1, got 0")):
        args = add_vs_real_arguments(argparse.ArgumentParser()).parse_args([flag, "0", "--out", str(tmp_path)])
        with pytest.raises(ValueError, match=match):
            run_vs_real(args)


def test_loads_parse_and_bad_ones_name_the_item():
    assert _parse_loads("light=0.3, queueing=2") == [("light", 0.3), ("queueing", 2.0)]
    for bad in ("light", "light=0", "=2", "light=fast", "light=-1"):
        with pytest.raises(ValueError, match=r"--loads: expected name=rate pairs"):
            _parse_loads(bad)


def test_table_gives_each_rows_error_against_the_real_run_and_its_target():
    real = {key: 100.0 for _, key, _ in ROWS}
    sim = dict(real, median_ttft_ms=104.0, median_tpot_ms=94.0, p90_ttft_ms=109.0, p90_tpot_ms=111.0,
               output_throughput=100.0, request_throughput=0.0)
    real["request_throughput"] = 0.0                      # nothing to compare against: n/a, not a division
    lines = comparison_table({"light": {"real": real, "simulated": sim}}).splitlines()
    rows = {line.split(" | ")[1]: line for line in lines[2:]}
    assert len(rows) == len(ROWS)
    assert rows["median TTFT (ms)"].endswith("| +4.0% | ±5% ok |")
    assert rows["median TPOT (ms)"].endswith("| -6.0% | ±5% missed |")
    assert rows["p90 TTFT (ms)"].endswith("| +9.0% | ±10% ok |")
    assert rows["p90 TPOT (ms)"].endswith("| +11.0% | ±10% missed |")
    assert rows["request throughput (req/s)"].endswith("| n/a | ±5%  |")


def test_simulate_cpu_measures_the_simulated_server_and_the_floor_in_one_run(tmp_path):
    """`bench simulate-cpu --floor`: every request of both servers is answered (bench serve
    parses the floor's stream as it does a real server's), and the CPU of each is measured."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "realexec", "bench", "simulate-cpu", "--rate", "20", "--num-requests",
                        "30", "--max-tokens", "4", "--floor", "--out", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("the simulated server costs") == 2 and "sse_floor.py --fastapi" in r.stdout
    result = json.loads(out.read_text())
    assert result["achieved_request_throughput"] > 0 and result["server_cpu_s"] > 0
    for name in ("floor", "framework_floor"):
        floor = result[name]
        assert floor["cpu_s"] > 0 and floor["achieved_request_throughput"] == pytest.approx(20, rel=0.3)
        assert floor["step_s"] == pytest.approx(max(result["median_tpot_ms"] / 1e3, 0.001), rel=1e-3)
        assert result[f"vs_{name}"] == pytest.approx(result["server_cpu_s"] / floor["cpu_s"])


def test_simulate_cpu_spreads_the_load_over_replicas_of_one_process(tmp_path):
    """`simulate-cpu --replicas 3`: one `serve --replicas 3` process, each replica a third
    of the requests and of the rate; the throughput is theirs together."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "realexec", "bench", "simulate-cpu", "--rate", "30", "--num-requests",
                        "45", "--max-tokens", "3", "--replicas", "3", "--out", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "req/s served over 3 replicas" in r.stdout
    result = json.loads(out.read_text())
    flags = result["server_flags"]
    assert result["replicas"] == 3 and flags[flags.index("--replicas") + 1] == "3"
    assert result["achieved_request_throughput"] == pytest.approx(30, rel=0.35) and result["server_cpu_s"] > 0
    bad = subprocess.run([sys.executable, "-m", "realexec", "bench", "simulate-cpu", "--num-requests", "2",
                          "--replicas", "3"], cwd=root, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--replicas must be from 1 to --num-requests (2), got 3" in bad.stderr


@pytest.mark.parametrize("extra", [[], ["--fastapi"]], ids=["raw", "fastapi"])
def test_the_floor_server_streams_openai_chunks_and_refuses_a_bad_body(tmp_path, extra):
    """Both floors speak just enough of the API for the load generator: a stream of
    completion chunks of max_tokens tokens, [DONE], keep-alive; 400 for a body that is not
    a JSON object."""
    import json
    import sys
    import urllib.error
    import urllib.request
    from pathlib import Path

    from core.procs import free_port, serve_process

    port = free_port()
    script = Path(__file__).resolve().parents[3] / "realexec" / "bench" / "sse_floor.py"
    with serve_process([sys.executable, str(script), str(port), "0.001", *extra], port,
                       tmp_path / "floor.log", ready_timeout=60) as s:
        body = json.dumps({"model": "floor", "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
        with urllib.request.urlopen(urllib.request.Request(s.url + "/v1/completions", body), timeout=10) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) == 4
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
        with urllib.request.urlopen(s.url + "/v1/models", timeout=10) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "floor"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(s.url + "/v1/completions", b"[1"), timeout=10)
        assert e.value.code == 400


def _prompt_trace(path, prompts: list[str], output_len: int = 3):
    """A trace of `prompts`, all arriving at once, asking for `output_len` tokens each."""
    from traces import Trace, TraceRequest, save_trace

    save_trace(Trace([TraceRequest(f"r{i}", 0.0, 12, output_len, p) for i, p in enumerate(prompts)], "test"), path)
    return path


def test_table_counts_the_requests_whose_first_token_has_no_text_on_each_side():
    real = {key: 100.0 for _, key, _ in ROWS}
    pair = {"real": dict(real, first_token_silent=[1, 4, 7]), "simulated": dict(real, first_token_silent=[4, 9])}
    row = comparison_table({"light": pair}).splitlines()[-1]
    assert row == "| light | requests whose first token has no text | 3 | | 2 | 1 in both | |"


def test_several_real_runs_are_compared_by_their_mean_with_their_spread():
    from realexec.bench.simulated import mean_summary

    runs = [{key: 100.0 for _, key, _ in ROWS} for _ in range(3)]
    runs[0]["median_ttft_ms"], runs[2]["median_ttft_ms"] = 90.0, 120.0      # mean 103.33
    real = mean_summary(runs)
    assert real["median_ttft_ms"] == pytest.approx(310 / 3) and real["runs"] == runs
    assert real["noise"]["median_ttft_ms"] == pytest.approx((120 - 310 / 3) / (310 / 3))
    assert real["noise"]["median_tpot_ms"] == 0.0
    sim = dict(runs[1], median_ttft_ms=310 / 3 * 1.02)
    rows = {line.split(" | ")[1]: line for line in comparison_table({"q": {"real": real, "simulated": sim}})
            .splitlines()[2:]}
    assert rows["median TTFT (ms)"] == "| q | median TTFT (ms) | 103.33 | 16.1% | 105.40 | +2.0% | ±5% ok |"
    assert mean_summary(runs[:1]) == runs[0] and "noise" not in mean_summary(runs[:1])
    one = comparison_table({"q": {"real": runs[0], "simulated": sim}})
    assert "| q | median TTFT (ms) | 90.00 | one run | 105.40 | +17.1% | ±5% missed |" in one


def test_first_token_silent_names_the_requests_a_client_sees_text_from_a_step_later(tmp_path):
    """The probe of `bench simulate-vs-real`: against a simulated server that starts about
    half its requests with a text-less token, it names exactly the requests whose stream's
    first text comes with their second token."""
    import json

    import httpx

    from realexec.bench.simulated import first_token_silent, slice_prompts
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.app import create_app
    from tests.realexec.server.test_server import serve

    prompts = [f"question {i}: what is {i} times {i + 3}" for i in range(12)]
    trace = _prompt_trace(tmp_path / "t.json", prompts)
    engine = LLMEngine(EngineArgs(simulate="roofline", sim_model="Llama-3-8B", sim_hardware="H100", block_size=16,
                                  num_gpu_blocks=256, swap_space=0.01, sim_first_token_no_text=0.5))
    with serve(create_app(engine, served_model_name="sim")) as url:
        assert slice_prompts(str(trace), len(prompts)) == prompts
        silent = first_token_silent(url, prompts)
        late = []
        with httpx.Client(base_url=url, timeout=60) as client:
            for p in prompts:
                body = {"model": "sim", "prompt": p, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                        "stream": True, "logprobs": 1}
                with client.stream("POST", "/v1/completions", json=body) as resp:
                    chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                              if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")]
                tokens = [c["choices"][0]["text"] for c in chunks if c["choices"]]
                late.append(bool(tokens) and tokens[0] == "")
    assert 0 < len(silent) < len(prompts)
    assert silent == [i for i, x in enumerate(late) if x]


def test_simulate_vs_real_end_to_end_with_the_real_runs_silent_starts(tmp_path):
    """`bench simulate-vs-real --match-first-token --real-runs 2` through the CLI on a tiny
    slice: both servers serve it (the real one twice), the table has every row, and the
    simulated server starts without text exactly the requests SmolLM2 does (one prompt that
    SmolLM2 answers with its end-of-turn token first, two it does not)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    prompts = ["What are the best mods for ARK: Survival Evolved?", "What is a device graph",
               "Write a motivational letter for a phd position"]
    trace = _prompt_trace(tmp_path / "t.json", prompts)
    from tests.realexec.executor.test_simulated import linear_cost_model

    cost_model = tmp_path / "profile.json"             # a made-up fitted model: its engine gives both servers' flags
    cost_model.write_text(json.dumps(linear_cost_model(
        {"num_gpu_blocks": 64, "block_size": 16, "max_model_len": 512, "max_num_seqs": 4}, 0.0005, 0.001)))
    out = tmp_path / "cmp"
    r = subprocess.run([sys.executable, "-m", "realexec", "bench", "simulate-vs-real", "--cost-model", str(cost_model),
                        "--trace", str(trace), "--num-requests", "3", "--loads", "light=20", "--max-tokens-cap",
                        "3", "--match-first-token", "--real-runs", "2", "--out", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "comparison.json").read_text())
    light = result["runs"]["light"]
    assert light["real"]["first_token_silent"] == [0] == light["simulated"]["first_token_silent"]
    assert json.loads((out / "light-silent-prompts.json").read_text()) == prompts[:1]
    table = (out / "comparison.md").read_text()
    assert "| light | requests whose first token has no text | 1 | | 1 | 1 in both | |" in table
    assert table.count("| light |") == len(ROWS) + 1
    assert len(light["real"]["runs"]) == 2 and set(light["real"]["noise"]) == {key for _, key, _ in ROWS}
    for name in ("light-simulated", "light-real", "light-real-2"):
        assert len(json.loads((out / f"{name}.requests.json").read_text())["ttfts"]) == 3
