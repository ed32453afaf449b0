"""What a new user of `python -m sim` relies on (issue 29): rejected requests say why and
what to change, a cost model brings the engine it was measured on, results never overwrite
an earlier run silently, `sim run --plot`, one default deployment, truthful summary lines,
and every user error is one `error: ...` line with exit status 2."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.cost.schema import OLD_ENGINE_KEYS
from sim import SimConfig, build_summary, simulate
from sim.cli import main as cli_main
from sim.config import DEFAULT_HARDWARE, DEFAULT_MODEL
from sim.results import reject_kind, reject_lines, sharing_text
from traces import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[2]
SHAREGPT = ROOT / "traces" / "sharegpt.json"
MOONCAKE = ROOT / "traces" / "mooncake_conversation.jsonl.gz"
PY = sys.executable


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- rejections: the scheduler's reason, carried through --------------------------------------

def test_rejected_requests_carry_the_schedulers_reason_to_csv_summary_and_printout(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["run", str(MOONCAKE), "--num-requests", "40", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = _rows(out / "requests.csv")
    summary = json.loads((out / "summary.json").read_text())
    rejected = [r for r in rows if r["status"] == "rejected"]
    assert rejected and summary["rejected"] == len(rejected)
    max_len = summary["config"]["max_model_len"]
    for r in rows:
        if r["status"] == "rejected":       # the core's words, with this request's numbers
            assert r["reject_reason"].startswith(f"prompt has {r['request_num_prefill_tokens']} tokens; "
                                                 f"max_model_len is {max_len}")
        else:
            assert r["reject_reason"] == ""
    reasons = summary["reject_reasons"]
    assert list(reasons) == ["prompt_too_long"] and reasons["prompt_too_long"]["count"] == len(rejected)
    assert reasons["prompt_too_long"]["max_prompt_tokens"] == max(int(r["request_num_prefill_tokens"])
                                                                   for r in rejected)
    # printed: the count, and a model whose context holds the longest prompt
    assert f"rejected     {len(rejected):,} prompt_too_long" in text
    assert "--model Llama-3.1-8B (context 131,072)" in text


@pytest.mark.parametrize("config, prompt, output, kind, advice", [
    (SimConfig(num_gpu_blocks=300, max_model_len=512), 600, 8, "prompt_too_long", "--max-model-len 1,024"),
    (SimConfig(num_gpu_blocks=300, n=4, max_num_seqs=2), 40, 8, "too_many_sequences", "--max-num-seqs"),
    (SimConfig(num_gpu_blocks=10, n=2), 40, 100, "kv_cache_too_small", "more KV cache"),
    (SimConfig(num_gpu_blocks=10, watermark=0.5), 100, 8, "prompt_exceeds_cache", "more KV cache"),
])
def test_every_kind_of_rejection_is_counted_and_gets_its_advice(config, prompt, output, kind, advice):
    """Each of core.sched.scheduler's reasons maps to its kind (a changed message there shows up
    here as an unknown kind) and the printed summary says what to change."""
    result = simulate(config, Trace([TraceRequest("r0", 0.0, prompt, output),
                                     TraceRequest("r1", 0.1, 20, 4)], "two requests"))
    rec = result.records[0]
    assert rec.status == "rejected" and reject_kind(rec.reject_reason) == kind, rec.reject_reason
    if kind != "too_many_sequences":                     # (--n applies to every request)
        assert result.records[1].status != "rejected" and result.records[1].reject_reason is None
    result.records[1:] = []                              # the summary of the first alone
    summary = build_summary(result)
    assert summary["reject_reasons"] == {kind: {"count": 1, "example": rec.reject_reason,
                                                "max_prompt_tokens": prompt}}
    text = "\n".join(reject_lines(summary))
    assert f"rejected     1 {kind}" in text and advice in text


def test_fleet_and_disaggregated_summaries_count_reasons_too(tmp_path, capsys):
    common = ["run", str(MOONCAKE), "--num-requests", "30", "--quiet"]
    assert cli_main(common + ["--replicas", "2", "--out", str(tmp_path / "f")]) == 0
    assert cli_main(common + ["--disaggregate", "1:1", "--out", str(tmp_path / "d")]) == 0
    text = capsys.readouterr().out
    for name in ("f", "d"):
        s = json.loads((tmp_path / name / "summary.json").read_text())
        assert s["rejected"] > 0 and s["reject_reasons"]["prompt_too_long"]["count"] == s["rejected"]
        rows = _rows(tmp_path / name / "requests.csv")
        assert sum(bool(r["reject_reason"]) for r in rows) == s["rejected"]
    assert text.count("prompt_too_long") == 2


# --- summary lines ---------------------------------------------------------------------------

def test_sharing_saving_is_worded_truthfully():
    assert sharing_text(0.115) == "sharing saves 11.5% of the blocks"
    assert sharing_text(0.0) == "no blocks shared"
    negative = sharing_text(-0.007)
    assert "saves" not in negative and "-0" not in negative
    assert negative.startswith("no blocks shared; 0.7% more blocks in use than the block tables hold")


def test_fleet_header_counts_every_gpu(tmp_path, capsys):
    common = ["run", str(SHAREGPT), "--model", "Llama-3-8B", "--hardware", "H100", "--tp", "2",
              "--num-requests", "20", "--rate", "20", "--quiet"]
    assert cli_main(common + ["--replicas", "4", "--out", str(tmp_path / "f")]) == 0
    assert cli_main(common + ["--disaggregate", "1:2", "--out", str(tmp_path / "d")]) == 0
    fleet, disagg = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Llama-3-8B on ")]
    assert fleet.startswith("Llama-3-8B on 8x H100 (4 replicas of 2 GPUs), each: ")
    assert disagg.startswith("Llama-3-8B on 6x H100 (1 prefill + 2 decode replicas of 2 GPUs), each: ")


def test_the_disaggregated_progress_bar_counts_each_request_once(monkeypatch):
    import tqdm

    from sim.cluster.disagg import DisaggConfig, DisaggFleet
    from traces import load_trace, retime
    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, k=1):
            self.n += k

        def set_postfix_str(self, *args, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    trace = retime(load_trace(SHAREGPT), rate=20, num_requests=50)
    trace.requests[3].output_len = 1          # one ends on its prefill replica
    config = SimConfig(model="Llama-3-8B", hardware="H100", num_gpu_blocks=300, max_num_seqs=16)
    DisaggFleet(DisaggConfig(config, 1, 2), trace, progress=True).run()
    assert [(b.total, b.n) for b in bars] == [(50, 50)]


# --- defaults ----------------------------------------------------------------------------------

def test_run_search_and_bench_default_to_one_deployment(capsys):
    from sim.bench import build_parser as bench_parser
    from sim.cli import build_parser
    run = build_parser().parse_args(["run", "t.json"])
    search = build_parser().parse_args(["search", "t.json", "--qps", "1", "--slo-ttft-p90", "1",
                                        "--slo-tpot-p90", "1", "--max-gpus", "1"])
    bench = bench_parser().parse_args([])
    assert {(a.model, a.hardware) for a in (run, search, bench)} == {(DEFAULT_MODEL, DEFAULT_HARDWARE)}
    with pytest.raises(SystemExit):
        cli_main(["search", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--enable-prefix-caching every probed deployment reuses KV blocks" in help_text


# --- one line per user error ---------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["run", "missing.json"], "missing.json"),
    (["sweep", "missing.json", "--rates", "1"], "missing.json"),
    (["compare", "missing.json", "--policies", "paged", "--rates", "1"], "missing.json"),
    (["sharing", "missing.json"], "missing.json"),
    (["search", "missing.json", "--qps", "1", "--slo-ttft-p90", "1", "--slo-tpot-p90", "1", "--max-gpus", "1"],
     "missing.json"),
    (["replay", "missing.jsonl"], "missing.jsonl"),
    (["calibrate", str(SHAREGPT), "--cost-model", "missing.json"], "missing.json"),
    (["calibrate", str(SHAREGPT)], "results/profile.json: no such file"),      # the default profile
    (["validate", str(SHAREGPT), "--cost-model", "missing.json", "--rate", "1"], "missing.json"),
    (["run", str(SHAREGPT), "--model", "GPT-9"], "unknown model 'GPT-9'"),
    (["search", str(SHAREGPT), "--model", "GPT-9", "--qps", "1", "--slo-ttft-p90", "1", "--slo-tpot-p90", "1",
      "--max-gpus", "1"], "unknown model 'GPT-9'"),
    (["run", str(SHAREGPT), "--hardware", "TPU"], "unknown hardware 'TPU'"),
])
def test_every_user_error_is_one_line_and_exit_2(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main([*argv, "--quiet"] if argv[0] in ("run", "sweep", "compare", "sharing", "search")
                    else argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


# --- where results go ----------------------------------------------------------------------------

def test_sim_run_never_overwrites_an_earlier_run_silently(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["run", str(SHAREGPT), "--num-requests", "5", "--quiet"]
    assert cli_main(args) == 0 and cli_main(args + ["--num-requests", "6"]) == 0
    captured = capsys.readouterr()
    assert "results in results/run/" in captured.out and "results in results/run-2/" in captured.out
    assert "writing results/run-2/" in captured.err
    assert len(_rows(tmp_path / "results" / "run" / "requests.csv")) == 5      # the first run kept
    assert len(_rows(tmp_path / "results" / "run-2" / "requests.csv")) == 6
    # a directory the user names: refused while it holds results, unless --overwrite
    named = ["--out", "results/run"]
    assert cli_main(args + ["--num-requests", "7", *named]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert len(_rows(tmp_path / "results" / "run" / "requests.csv")) == 5
    assert cli_main(args + ["--num-requests", "7", *named, "--overwrite"]) == 0
    assert len(_rows(tmp_path / "results" / "run" / "requests.csv")) == 7


def test_outputs_default_under_results(tmp_path):
    from realexec.twin.profile import add_arguments
    from sim.cli import build_parser
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).out == "results/profile.json"
    from sim.twin.calibrate import DEFAULT_PROFILE
    cal = build_parser().parse_args(["calibrate", "t.json"])
    assert (cal.cost_model, DEFAULT_PROFILE, cal.out) == (None, "results/profile.json", "results/calibrated.json")
    assert build_parser().parse_args(["validate", "t.json", "--cost-model", "c", "--rate", "1"]).out == \
        "results/validate"
    assert "results/" in (ROOT / ".gitignore").read_text().split()


# --- sim run --plot ------------------------------------------------------------------------------

@pytest.mark.parametrize("fleet", [[], ["--replicas", "2"]])
def test_plot_writes_the_runs_figures_into_its_directory(fleet, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["run", str(SHAREGPT), "--num-requests", "30", "--rate", "8", "--quiet", "--plot",
                     "--out", str(out), *fleet]) == 0
    text = capsys.readouterr().out
    for name in ("latency_cdfs.png", "batch_size.png", "kv_usage.png"):
        assert (out / name).stat().st_size > 10_000, name
        assert f"wrote {out / name}" in text


def test_the_simulator_does_not_import_plots():
    code = ("import sys, sim.cli, sim.run, sim.engine, sim.cluster.fleet, sim.cluster.disagg, sim.results; "
            "sys.exit(any(m == 'plots' or m.startswith(('plots.', 'matplotlib')) for m in sys.modules))")
    assert subprocess.run([PY, "-c", code], cwd=ROOT).returncode == 0


def test_figure_data_json_is_deterministic(tmp_path):
    from plots.figures import write_json
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_json(a, [{"rate": 2, "load": "x", "nested": {"b": 1, "a": 2}}])
    write_json(b, [{"nested": {"a": 2, "b": 1}, "load": "x", "rate": 2}])
    assert a.read_bytes() == b.read_bytes()
    for name in ("routers_mooncake.json", "disagg_azure.json", "pp_vs_tp.json"):   # committed as written
        path = ROOT / "plots" / "figures" / name
        write_json(tmp_path / name, json.loads(path.read_text()))
        assert (tmp_path / name).read_bytes() == path.read_bytes(), name


# --- the engine a cost model was measured on -------------------------------------------------------

MEASURED = {"num_gpu_blocks": 200, "block_size": 8, "max_model_len": 1024, "max_num_seqs": 7,
            "max_num_batched_tokens": 256, "enable_chunked_prefill": True, "enable_prefix_caching": False,
            "watermark": 0.01, "swap_space_gib": 1.0, "queue": "fcfs", "preemption": "recompute",
            "victim": "newest", "eviction": "lru"}


def _cost_model(tmp_path: Path, engine: dict | None) -> Path:
    from core.cost.fit import fit_step_cost
    from tests.sim.twin.test_calibration import TRUE_EXECUTE, TRUE_OVERHEAD, synthetic_samples
    model = fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))
    if engine is not None:
        model["engine"] = engine
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(model))
    return path


def _run_with(tmp_path: Path, cost_model: Path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    code = cli_main(["run", str(SHAREGPT), "--num-requests", "5", "--model", "SmolLM2-135M", "--hardware",
                     "cpu-2core", "--cost-model", str(cost_model), "--quiet", "--out", str(out), *flags])
    return code, json.loads((out / "summary.json").read_text()) if code == 0 else {}


def test_a_cost_model_brings_the_engine_it_was_measured_on(tmp_path, capsys):
    path = _cost_model(tmp_path, MEASURED)
    code, s = _run_with(tmp_path, path)
    assert code == 0 and capsys.readouterr().err == ""
    c = s["config"]
    # MEASURED spells the engine section as profiles did before the shared names: read as the new ones
    assert {k: c[OLD_ENGINE_KEYS.get(k, k)] for k in MEASURED} == MEASURED
    # a flag equal to the measured value is no difference; one that differs is kept and named
    code, s = _run_with(tmp_path, path, "--max-num-seqs", "7", "--block-size", "16", "--no-enable-chunked-prefill",
                        "--max-num-batched-tokens", "1024")
    err = capsys.readouterr().err
    assert code == 0 and err.count("\n") == 1 and err.startswith("warning: simulating another engine than")
    assert "--block-size 16 (measured: 8)" in err and "--no-enable-chunked-prefill (measured: on)" in err
    assert "--max-num-batched-tokens 1024 (measured: 256)" in err and "--max-num-seqs" not in err
    c = s["config"]
    assert (c["block_size"], c["enable_chunked_prefill"], c["max_num_seqs"], c["num_gpu_blocks"]) == (16, False, 7, 200)
    # sizing the cache from memory instead is said too
    code, s = _run_with(tmp_path, path, "--gpu-memory-utilization", "0.5")
    assert code == 0 and "--gpu-memory-utilization 0.5 sizes the KV cache (measured: 200 blocks)" in \
        capsys.readouterr().err and s["config"]["num_gpu_blocks"] != 200


def test_a_cost_model_without_an_engine_section_keeps_the_flags(tmp_path, capsys):
    code, s = _run_with(tmp_path, _cost_model(tmp_path, None), "--num-gpu-blocks", "64")
    assert code == 0 and capsys.readouterr().err == ""
    assert (s["config"]["num_gpu_blocks"], s["config"]["max_num_seqs"]) == (64, 256)


def test_a_malformed_engine_section_is_one_error_line(tmp_path, capsys):
    code, _ = _run_with(tmp_path, _cost_model(tmp_path, {**MEASURED, "max_num_seqs": "many"}))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "got `str` - at `$.engine.max_num_seqs`" in err


def test_a_rejection_on_the_decode_side_keeps_its_reason():
    """Disaggregated: the decode replica gets the prompt plus the first token, so a prompt
    one token under max_model_len passes the prefill side and is rejected on the decode side."""
    from sim.cluster.disagg import DisaggConfig, DisaggFleet
    config = SimConfig(model="Llama-3-8B", hardware="H100", num_gpu_blocks=300, max_model_len=512)
    trace = Trace([TraceRequest("edge", 0.0, 511, 8), TraceRequest("fine", 0.1, 100, 8)], "two requests")
    edge, fine = DisaggFleet(DisaggConfig(config, 1, 1), trace).run().records
    assert edge.status == "rejected" and edge.reject_reason.startswith("prompt has 512 tokens; max_model_len is 512")
    assert fine.status == "length" and fine.reject_reason is None


def test_profile_writes_the_engine_serve_runs_and_sim_run_simulates_it(tmp_path):
    """A real (tiny) profile: its engine section is the engine `realexec serve` runs with the
    same flags (serve's chunk, not the profile grid's), and `sim run --cost-model` uses it."""
    from transformers import AutoTokenizer

    from realexec.bench.throughput import model_dir
    from tests.tiny_models import save_tiny_llama
    save_tiny_llama(tmp_path / "tiny", tokenizer=AutoTokenizer.from_pretrained(model_dir(None)),
                    max_position_embeddings=1024, tie_word_embeddings=True)
    prof = tmp_path / "out" / "profile.json"                   # a directory that does not exist yet
    r = subprocess.run([PY, "-m", "realexec", "profile", "--model", str(tmp_path / "tiny"), "--quick", "--repeats",
                        "1", "--block-size", "4", "--num-gpu-blocks", "64", "--max-num-seqs", "8", "--swap-space",
                        "0.01", "--out", str(prof)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    engine = json.loads(prof.read_text())["engine"]
    assert {k: engine[k] for k in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len",
                                   "max_num_batched_tokens", "enable_chunked_prefill")} == {
        "num_gpu_blocks": 64, "block_size": 4, "max_num_seqs": 8, "max_model_len": 256,
        "max_num_batched_tokens": 2048, "enable_chunked_prefill": True}
    code, s = _run_with(tmp_path / "out", prof)
    assert code == 0
    assert {k: s["config"][k] for k in engine} == engine
