"""Calibrating the twin: profile the real engine, fit the step cost, price the simulator
with it, and replay the real engine's decisions through the simulator's core."""
from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from core.cost.fit import (StepCostEvaluator, check_model, choose_family, feature_values, fit_nonneg,
                           fit_step_cost, shape_of)
from sim.config import SimConfig
from core.cost.model import BatchShape, RooflineCostModel
from sim.run import simulate
from core.cost.fitted import FittedCostModel
from core.cost.specs import get_hardware, get_model
from traces.model import Trace, TraceRequest
from tests.tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
PY = sys.executable


def synthetic_samples(execute: dict, overhead: dict, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Steps over a prefill/decode/mixed grid, timed by known linear models per part."""
    import random

    rng = random.Random(seed)
    batches = [[(p, c)] for p in (8, 32, 128, 512) for c in (0, 256, 1024)]
    batches += [[(1, c)] * b for b in (1, 2, 4, 8, 16, 32) for c in (16, 200, 800)]
    batches += [[(1, 100)] * b + [(p, 0)] for b in (2, 8) for p in (16, 256)]
    out = []
    for batch in batches:
        seqs, tokens, context, pairs = shape_of([c for _, c in batch], [n for n, _ in batch])
        v = feature_values(seqs, tokens, context, pairs)
        phase = "prefill" if tokens > seqs else "decode"
        t = {part: sum(c * v[f] for f, c in coefs[phase].items()) * (1 + rng.uniform(-noise, noise))
             for part, coefs in (("execute", execute), ("overhead", overhead))}
        out.append({"seqs": seqs, "tokens": tokens, "context": context, "pairs": pairs,
                    "execute_s": t["execute"], "overhead_s": t["overhead"]})
    return out


TRUE_EXECUTE = {"prefill": {"one": 2e-3, "tokens": 1e-4, "pairs": 2e-8},
                "decode": {"one": 3e-3, "seqs": 2e-4, "context": 1e-7}}
TRUE_OVERHEAD = {"prefill": {"one": 5e-4, "seqs": 5e-5}, "decode": {"one": 4e-4, "seqs": 3e-5}}


# ----------------------------------------------------------------------------- the fit

def test_fit_recovers_known_step_costs_and_picks_the_terms_that_predict():
    model = fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))
    check_model(model)
    ev = StepCostEvaluator(model)
    for phase, truth in TRUE_EXECUTE.items():
        entry = model["parts"]["execute"][phase]
        got = dict(zip(entry["features"], entry["coef"]))
        if phase == "decode":              # one token per sequence: tokens and seqs are the same column
            got["seqs"] = got.get("seqs", 0.0) + got.pop("tokens", 0.0)
        assert set(truth) <= {f for f, c in got.items() if c}, (phase, entry["family"])
        for f, c in truth.items():
            assert got[f] == pytest.approx(c, rel=1e-6)
    # the evaluator sums both parts
    shape = (4, 4, 400, 404)
    v = feature_values(*shape)
    want = sum(c * v[f] for part in (TRUE_EXECUTE, TRUE_OVERHEAD) for f, c in part["decode"].items())
    assert ev.step_time(*shape) == pytest.approx(want, rel=1e-6)
    for e in model["held_out_step"].values():
        assert e["p90"] < 1e-6


def test_held_out_error_prefers_the_simpler_family_on_noisy_data():
    """A cost with no context dependence: the extra terms only fit noise, and must not win."""
    flat = {"prefill": {"one": 1e-3, "tokens": 1e-4}, "decode": {"one": 2e-3, "seqs": 1e-4}}
    samples = synthetic_samples(flat, flat, noise=0.05, seed=3)
    rows = [feature_values(s["seqs"], s["tokens"], s["context"], s["pairs"]) for s in samples
            if s["tokens"] > s["seqs"]]
    y = [s["execute_s"] for s in samples if s["tokens"] > s["seqs"]]
    family, report = choose_family(rows, y)
    assert family == "tokens", report
    assert report["const"]["mean"] > report["tokens"]["mean"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 500), st.integers(0, 3000)), min_size=3, max_size=30),
       st.lists(st.floats(0, 1e-3), min_size=4, max_size=4))
def test_fitted_coefficients_are_never_negative_and_predictions_positive(shapes, coef):
    rows = [[1.0, float(n), float(c), float(n * c)] for n, c in shapes]
    y = [1e-4 + sum(a * b for a, b in zip(coef, r)) - 1e-7 * r[2] for r in rows]   # a falling term
    y = [max(t, 1e-6) for t in y]
    got = fit_nonneg(rows, y)
    assert all(c >= 0 for c in got)
    assert all(sum(a * b for a, b in zip(got, r)) >= 0 for r in rows)


def test_a_malformed_model_file_is_refused_with_the_reason(tmp_path):
    model = fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))
    bad = json.loads(json.dumps(model))
    bad["parts"]["execute"]["decode"]["coef"][0] = -1.0
    with pytest.raises(ValueError, match=r"coef\[0\] \(one\) must be >= 0, got -1.0 .* - at `\$\.parts\.execute\.decode`"):
        check_model(bad)
    bad = json.loads(json.dumps(model))
    del bad["parts"]["overhead"]["prefill"]
    with pytest.raises(ValueError, match=r"missing required field `prefill` - at `\$\.parts\.overhead`"):
        check_model(bad)
    bad = json.loads(json.dumps(model))
    bad["swap"] = {"coef": [1e-3, -1e-4], "block_bytes": 4096}
    with pytest.raises(ValueError, match=r">= 0.0 - at `\$\.swap\.coef\[1\]`"):
        check_model(bad)
    bad["swap"] = {"coef": [1e-3, 1e-4], "block_bytes": 0}
    with pytest.raises(ValueError, match=r">= 1 - at `\$\.swap\.block_bytes`"):
        check_model(bad)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        FittedCostModel.from_file(str(tmp_path / "x.json"), None)


# ----------------------------------------------------------------------------- the simulator side

def _fitted(model: dict) -> FittedCostModel:
    return FittedCostModel(model, RooflineCostModel(get_model("SmolLM2-135M"), get_hardware("cpu-2core")))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 40), st.integers(0, 5000), st.integers(0, 50))
def test_decode_step_times_equal_step_time_bit_for_bit(n, ctx, k):
    cm = _fitted(fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD)))
    want = [cm.step_time(BatchShape.decode(n, ctx + j * n)) for j in range(k)]
    assert cm.decode_step_times(n, ctx, k) == want


def test_the_simulator_charges_the_fitted_step_times(tmp_path):
    """One request alone: its latency is exactly the fitted prefill step plus its decode steps."""
    model = fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(model))
    prompt, out = 40, 12
    trace = Trace([TraceRequest("a", 0.0, prompt, out)])
    ev = StepCostEvaluator(model)
    want = ev.step_time(1, prompt, 0, prompt * (prompt + 1) // 2)
    want += sum(ev.step_time(1, 1, prompt + j, prompt + j + 1) for j in range(out - 1))
    for skipping in (True, False):
        cfg = SimConfig(model="SmolLM2-135M", hardware="cpu-2core", cost_model=str(path), num_gpu_blocks=64,
                        event_skipping=skipping)
        (rec,) = simulate(cfg, trace).records
        assert rec.finished_time - rec.arrival_time == pytest.approx(want, rel=1e-9)
    roof = simulate(SimConfig(model="SmolLM2-135M", hardware="cpu-2core", num_gpu_blocks=64), trace).records[0]
    assert roof.finished_time != pytest.approx(want, rel=1e-3)


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's tokenizer (so the server can take text prompts)."""
    from transformers import AutoTokenizer

    from realexec.bench.throughput import model_dir

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, tokenizer=AutoTokenizer.from_pretrained(model_dir(None)), max_position_embeddings=1024,
                    tie_word_embeddings=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny_profile(tiny, tmp_path_factory) -> tuple[Path, str]:
    prof = tmp_path_factory.mktemp("profile") / "profile.json"
    r = subprocess.run([PY, "-m", "realexec", "profile", "--model", tiny, "--quick", "--repeats", "2",
                        "--block-size", "4", "--num-gpu-blocks", "256", "--swap-space", "0.01", "--out", str(prof)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return prof, r.stdout


def test_profile_fit_simulate_end_to_end(tiny_profile, tmp_path):
    prof, stdout = tiny_profile
    assert "held-out error of the whole step time" in stdout
    model = json.loads(prof.read_text())
    check_model(model)
    samples = model["samples"]
    kinds = {("prefill" if s["tokens"] > s["seqs"] else "decode", s["seqs"] > 1) for s in samples}
    assert kinds == {("prefill", False), ("prefill", True), ("decode", False), ("decode", True)}  # mixed too
    assert {s["context"] > 0 for s in samples if s["tokens"] > s["seqs"]} == {True, False}   # chunked prefill
    assert model["profile"]["time_basis"] == "cpu"          # uni executor on CPU, one torch thread
    share = model["profile"]["cpu_share"]
    assert 0 < share["cpu"] <= 1 and 0 <= share["runq"] < 1 and share["cpu"] + share["runq"] <= 1 + 1e-6
    for s in samples:      # where the time went adds up
        assert s["step_s"] >= s["wall_execute_s"] > 0
        assert s["forward_s"] + s["prepare_s"] <= s["wall_execute_s"] + 1e-4
        # the fitted parts are the stepping thread's CPU seconds, within the wall time
        assert s["execute_s"] == pytest.approx(s["execute_cpu_s"]) and s["execute_s"] <= s["wall_execute_s"] + 1e-3
        assert s["execute_s"] + s["overhead_s"] == pytest.approx(s["cpu_s"], abs=1e-6)
        assert s["cpu_s"] + s["runq_s"] <= s["step_s"] + 1e-6        # disjoint parts of the step's wall time
    assert set(model["held_out_step"]) == {"prefill", "decode"}
    assert model["profile"]["overhead_mean_s"]["scheduler_s"] > 0
    swap = model["swap"]                    # swap copies: timed each way, 2 repeats of (1, 4, 16) blocks
    assert sorted((x["blocks"], x["direction"]) for x in swap["samples"]) == sorted(
        (n, d) for n in (1, 4, 16) for d in ("in", "out") for _ in range(2))
    assert all(x["seconds"] > 0 for x in swap["samples"]) and min(swap["coef"]) >= 0 and max(swap["coef"]) > 0
    assert "swap copy (each way)" in stdout
    cm = _fitted(model)
    a, b = swap["coef"]
    assert cm.swap_time(10, swap["block_bytes"]) == pytest.approx(a + 10 * b)
    assert cm.swap_time(10, 2 * swap["block_bytes"]) == pytest.approx(a + 20 * b)
    assert cm.swap_time(0, swap["block_bytes"]) == 0.0
    # the fitted parts add up to the measured step (loose: a shared CI box is noisy)
    ev = StepCostEvaluator(model)
    errs = sorted(abs(ev.step_time(s["seqs"], s["tokens"], s["context"], s["pairs"]) - s["cpu_s"]) / s["cpu_s"]
                  for s in samples)
    assert errs[len(errs) // 2] < 0.6

    run = subprocess.run([PY, "-m", "sim", "run", "traces/sharegpt.json", "--num-requests", "8", "--rate", "4",
                          "--model", "SmolLM2-135M", "--hardware", "cpu-2core", "--cost-model", str(prof),
                          "--out", str(tmp_path / "run"), "--quiet"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["cost_model"] == str(prof)


def test_validate_reports_errors_and_draws_the_figure(tiny, tiny_profile, tmp_path):
    from sim.twin.validate import workload_from_log

    prof, _ = tiny_profile
    out = tmp_path / "validate"
    r = subprocess.run([PY, "-m", "sim", "validate", "traces/sharegpt.json", "--cost-model", str(prof),
                        "--rate", "8", "--num-requests", "4", "--max-tokens-cap", "4", "--out", str(out),
                        "--engine-args", f"--model {tiny} --block-size 16 --num-gpu-blocks 128 --swap-space 0.01"],
                       cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sim vs mean" in r.stdout and "noise (±)" in r.stdout and "engine thread ran" in r.stdout
    report = json.loads((out / "report.json").read_text())
    metrics = {"output_throughput"} | {f"{q}_{m}" for m in ("ttft", "tpot", "e2el") for q in ("median", "p90")}
    assert set(report["errors"]) == {"sim vs mean", "sim (contended) vs mean", "sim (runs' speed) vs mean",
                                     "sim vs engine1"}
    assert len(report["run_speed"]) == 2 and all(x > 0 for x in report["run_speed"])
    assert "sim (runs' speed): each real run's steps cost" in r.stdout
    for errs in list(report["errors"].values()) + [report["noise"]]:
        assert set(errs) == metrics
        assert all(e == e for e in errs.values())          # no NaN: every metric was measured
    stats = report["stats"]
    for k in metrics:          # the reference is the real runs' mean; noise is their spread around it
        runs = [stats["real1 (client)"][k], stats["real2 (client)"][k]]
        assert stats["real mean"][k] == pytest.approx(sum(runs) / 2)
        assert report["noise"][k] == pytest.approx(abs(runs[0] - runs[1]) / sum(runs))
    assert all(0 < share <= 1.01 for share in report["cpu_share"])
    assert report["contention_scale"] == pytest.approx(2 / sum(report["cpu_share"]))
    assert all(m["server_cpu_s"] > 0 and m["client_cpu_s"] > 0 for m in report["machine"])
    assert (out / "validate.png").stat().st_size > 10_000
    assert "startup objects kept out of the garbage collector" in (out / "real1.server.log").read_text()
    _, trace, _ = workload_from_log(out / "real1.steps.jsonl")     # the simulated workload is the served one
    bench = json.loads((out / "real1.bench.json").read_text())
    assert sorted(r.output_len for r in trace.requests) == sorted(bench["output_lens"])
    assert sorted(r.prompt_len for r in trace.requests) == sorted(bench["input_lens"])
    # each real run began with a warm-up of 4 short requests, trimmed from its step log (kept
    # whole beside it); the trimmed log replays with the engine's decision at every step
    from core.cost.step_log import load_log
    from sim.twin.replay import replay

    _, warm_arrivals, warm_steps, _ = load_log(str(out / "real1.steps.with-warmup.jsonl"))
    _, arrivals, steps, _ = load_log(str(out / "real1.steps.jsonl"))
    assert len(warm_arrivals) == len(arrivals) + 4 == 8 and len(warm_steps) > len(steps)
    assert [s["step"] for s in steps] == list(range(len(steps)))
    report = replay(str(out / "real1.steps.jsonl"))
    assert report.equal and report.num_equal_steps == len(steps), report.first_divergence

    # the same real runs against a model with step jitter: the prediction is the mean of
    # --jitter-draws simulations, and the unjittered one is reported beside it
    jittered = tmp_path / "jittered.json"
    jittered.write_text(json.dumps({**json.loads(prof.read_text()), "jitter": {"sigma": 0.2, "phi": 0.5}}))
    r = subprocess.run([PY, "-m", "sim", "validate", "traces/sharegpt.json", "--cost-model", str(jittered),
                        "--rate", "8", "--num-requests", "4", "--max-tokens-cap", "4", "--out", str(out),
                        "--reuse-real", "--jitter-draws", "5"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the mean of 5 simulations with step jitter" in r.stdout
    again = json.loads((out / "report.json").read_text())
    assert again["jitter_draws"] == 5 and "sim (no jitter) vs mean" in again["errors"]
    assert again["stats"]["sim (no jitter)"] == pytest.approx(stats["sim"])     # the plain model's run
    assert again["stats"]["sim"] != again["stats"]["sim (no jitter)"]
    # how far chance could move either mean: the 2 real runs' spread, the 5 draws' spread
    assert "standard errors (real mean / sim's Monte Carlo): output_throughput" in r.stdout
    assert all(0 < again["sim_se"][k] < 1 and 0 <= again["real_se"][k] < 1 for k in metrics)


# ----------------------------------------------------------------------------- decision replay

@pytest.fixture(scope="module")
def smollm_log(tmp_path_factory) -> Path:
    """A real SmolLM2 run with --step-log: staggered arrivals, chunked prefill, and a KV
    pool small enough that the newest request is preempted (recompute) and resumed."""
    from core import SamplingParams
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine

    path = tmp_path_factory.mktemp("steplog") / "steps.jsonl"
    engine = LLMEngine(EngineArgs(block_size=4, num_gpu_blocks=20, max_num_batched_tokens=24,
                                  swap_space=0.01, step_log=str(path)))
    try:
        prompts = [[100 + 7 * i + j for j in range(18 + 2 * i)] for i in range(4)]
        lens = [12, 14, 12, 10]
        for i in range(2):
            engine.add_request(prompts[i], SamplingParams(max_tokens=lens[i], temperature=0.0, ignore_eos=True),
                               request_id=f"r{i}")
        for _ in range(3):
            engine.step()
        for i in range(2, 4):
            engine.add_request(prompts[i], SamplingParams(max_tokens=lens[i], temperature=0.0, ignore_eos=True),
                               request_id=f"r{i}")
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    return path


def test_replay_of_a_real_smollm2_run_takes_the_same_decisions(smollm_log):
    from core.cost.step_log import read_log
    from sim.twin.replay import replay

    records = list(read_log(str(smollm_log)))
    steps = [r for r in records if r["kind"] == "step"]
    decisions = [s["decision"] for s in steps]
    assert any(d["preempted"] for d in decisions), "the run was meant to preempt"
    assert any(len(d["batch"]) > 1 and any(b[2] > 1 for b in d["batch"]) for d in decisions)  # mixed step
    assert {r["step"] for r in records if r["kind"] == "arrival"} == {0, 3}
    assert all(s["t_end"] >= s["t_start"] and s["step_s"] >= s["execute_s"] > 0 for s in steps)
    report = replay(str(smollm_log))
    assert report.equal, report.first_divergence
    assert report.num_equal_steps == len(steps) > 5


def test_replay_reports_the_first_step_that_differs(smollm_log, tmp_path):
    from core.cost.step_log import read_log

    records = list(read_log(str(smollm_log)))
    steps = [r for r in records if r["kind"] == "step"]
    k = len(steps) // 2
    steps[k]["decision"]["batch"][0][2] += 1          # the real engine "computed" one more token
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = subprocess.run([PY, "-m", "sim", "replay", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"DIVERGE at step {k}" in r.stdout and "batch" in r.stdout
    ok = subprocess.run([PY, "-m", "sim", "replay", str(smollm_log)], cwd=ROOT, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and "identical at every step" in ok.stdout, ok.stdout + ok.stderr


@pytest.mark.parametrize("key, change", [("preempted", lambda v: v + ["r9"]), ("swap_out", lambda v: v + 1),
                                         ("swap_in", lambda v: v + 2), ("copy", lambda v: v + 1),
                                         ("used_gpu_blocks", lambda v: v - 1)],
                         ids=["preempted", "swap_out", "swap_in", "copy", "used_gpu_blocks"])
def test_replay_compares_every_part_of_a_decision_not_just_the_batch(smollm_log, tmp_path, key, change):
    """The same batch with another preemption, block move count or pool use is a different
    decision: replay must stop being equal at that step and name what differs."""
    from core.cost.step_log import read_log
    from sim.twin.replay import format_report, replay

    records = list(read_log(str(smollm_log)))
    steps = [r for r in records if r["kind"] == "step"]
    k = len(steps) - 2
    steps[k]["decision"][key] = change(steps[k]["decision"][key])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = replay(str(bad))
    assert not report.equal and report.first_divergence["step"] == k
    assert report.num_equal_steps == len(steps) - 1
    text = format_report(report)
    assert f"DIVERGE at step {k}" in text and f"  {key}: real" in text and "  batch:" not in text

def test_replay_refuses_logs_it_cannot_reproduce(smollm_log, tmp_path):
    from core.cost.step_log import read_log

    records = list(read_log(str(smollm_log)))
    for rec in records:
        if rec["kind"] == "finish" and rec["req_id"] == "r1":
            rec["status"] = "abort"
    bad = tmp_path / "abort.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = subprocess.run([PY, "-m", "sim", "replay", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "r1 ended abort" in r.stderr
    (tmp_path / "junk.jsonl").write_text("{}\nnot json\n")
    r = subprocess.run([PY, "-m", "sim", "replay", str(tmp_path / "junk.jsonl")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "junk.jsonl:1" in r.stderr


def test_repeat_noise_is_zero_for_exact_repeats_and_grows_with_their_spread():
    from core.cost.fit import repeat_noise

    base = synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD)
    exact = repeat_noise(base + base)
    assert set(exact) == {"prefill", "decode"} and all(e["p90"] < 1e-12 for e in exact.values())
    slower = [dict(s, execute_s=2 * s["execute_s"], overhead_s=2 * s["overhead_s"]) for s in base]
    spread = repeat_noise(base + slower)        # each shape seen at t and 2t: errors 1 and 1/2
    assert all(e["mean"] == pytest.approx(0.75) for e in spread.values())


def test_layering_sim_side_imports_no_realexec_and_the_shared_math_no_numpy():
    code = ("import sys, sim.twin.replay, sim.twin.validate, core.cost.fitted, sim.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('realexec', 'torch')]; "
            "sys.exit(f'imported {bad[:3]}' if bad else 0)")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    code = ("import sys, core.cost.fit, core.cost.step_log; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'simpy', 'sim', 'realexec')]; "
            "sys.exit(f'imported {bad[:3]}' if bad else 0)")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- time on a shared machine

def test_step_records_split_wall_time_into_cpu_and_the_rest(tiny):
    """A step whose executor sleeps (the thread off its core: blocked or waiting) is long in
    wall time but not in CPU time; the CPU basis a profile fits leaves that time out."""
    import time

    from core import SamplingParams
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine
    from realexec.twin.profile import sample_of
    from realexec.twin.step_recorder import StepRecorder

    engine = LLMEngine(EngineArgs(model=tiny, block_size=16, num_gpu_blocks=64, swap_space=0.01))
    execute = engine.executor.execute_model
    engine.executor.execute_model = lambda out: (time.sleep(0.05), execute(out))[1]
    try:
        with StepRecorder(engine) as rec:
            engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.executor.__dict__.pop("execute_model", None)       # (closing the recorder removed it)
        engine.shutdown()
    assert len(rec.steps) == 3
    for step in rec.steps:
        assert step["step_s"] >= step["execute_s"] >= 0.05
        assert 0 < step["execute_cpu_s"] <= step["cpu_s"] < step["step_s"] - 0.04
        assert 0 <= step["runq_s"] <= step["step_s"] - step["cpu_s"]
        assert 0 <= step["gc_s"] <= step["step_s"]
        cpu, wall = sample_of(step, "cpu"), sample_of(step, "wall")
        assert cpu["execute_s"] < 0.04 <= 0.05 <= wall["execute_s"]
        assert cpu["execute_s"] + cpu["overhead_s"] == pytest.approx(step["cpu_s"])


def test_a_request_that_waits_for_the_step_in_flight_arrives_when_it_reached_the_server(tiny, tmp_path):
    """The server hands requests to the engine between steps; the step log (and the
    simulated workload built from it) keeps when each one was handed over."""
    import asyncio
    import threading
    import time

    from core import SamplingParams
    from core.cost.step_log import read_log
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.async_engine import AsyncEngine
    from sim.twin.validate import workload_from_log

    log = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineArgs(model=tiny, block_size=16, num_gpu_blocks=64, swap_space=0.01, step_log=str(log)))
    server = AsyncEngine(engine)
    in_step = threading.Event()

    def slow_first_step():
        if not in_step.is_set():
            in_step.set()
            time.sleep(0.3)
    server.before_step = slow_first_step
    server.start()

    async def clients():
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        first = asyncio.ensure_future(server.generate([[5, 6, 7]], params, request_id="first"))
        await asyncio.to_thread(in_step.wait)          # (its ack comes after that step)
        second = await server.generate([[8, 9, 10]], params, request_id="second")
        for stream in (await first, second):
            async for _ in stream:
                pass
    try:
        asyncio.run(clients())
    finally:
        server.shutdown()
        engine.shutdown()
    arrivals = {r["req_id"]: r for r in read_log(str(log)) if r["kind"] == "arrival"}
    assert arrivals["first"]["t"] - arrivals["first"]["t_arrival"] < 0.1
    assert arrivals["second"]["t"] - arrivals["second"]["t_arrival"] > 0.2     # waited for the slow step
    _, trace, eng = workload_from_log(log)
    by_id = {r.request_id: r.arrival_time for r in trace.requests}
    want = arrivals["second"]["t_arrival"] - arrivals["first"]["t_arrival"]
    assert by_id["second"] == pytest.approx(want, abs=1e-5) and by_id["second"] < 0.25


@given(st.floats(0.05, 20), st.integers(1, 64), st.integers(1, 600), st.integers(0, 4000))
@settings(max_examples=50, deadline=None)
def test_a_scaled_model_prices_every_step_that_many_times_longer(factor, seqs, tokens, context):
    from core.cost.fit import scaled_model

    model = _bumpy_model()
    scaled = scaled_model(model, factor)
    check_model(scaled)
    tokens = max(tokens, seqs)
    shape = (seqs, tokens, context, tokens * context + tokens)
    assert StepCostEvaluator(scaled).step_time(*shape) == pytest.approx(factor * StepCostEvaluator(model).step_time(*shape))
    assert scaled_model(scaled, 1 / factor)["profile"]["time_scale"] == pytest.approx(1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="time scale"):
            scaled_model(model, bad)


def test_contention_scale_from_the_cpu_the_real_engine_got():
    from sim.twin.validate import contention_scale

    assert contention_scale({"profile": {"time_basis": "cpu"}}, 0.5) == pytest.approx(2.0)
    # a wall-seconds profile already holds its own waits: only the difference counts
    wall = {"profile": {"time_basis": "wall", "cpu_share": {"cpu": 0.8, "runq": 0.2}}}
    assert contention_scale(wall, 0.4) == pytest.approx(2.0)
    assert contention_scale(wall, None) is None
    assert contention_scale({"profile": {"time_basis": "wall"}}, 0.5) is None


def test_noise_is_the_real_runs_spread_around_their_mean():
    from sim.twin.validate import mean_stats, run_noise

    runs = [{"ttft": 1.0, "tpot": 2.0}, {"ttft": 3.0, "tpot": 2.0}]
    assert mean_stats(runs) == {"ttft": 2.0, "tpot": 2.0}
    assert run_noise(runs) == {"ttft": 0.5, "tpot": 0.0}
    assert run_noise(runs[:1]) == {"ttft": 0.0, "tpot": 0.0}
    three = [{"ttft": 1.0}, {"ttft": 2.0}, {"ttft": 6.0}]      # mean 3: the farthest run sets it
    assert run_noise(three) == {"ttft": 1.0}


def test_replay_prices_steps_in_the_profiles_time_basis(smollm_log):
    from core.cost.fit import phase_of, summarize_errors
    from core.cost.step_log import load_log
    from sim.twin.replay import replay

    class TenMs:                   # every step 10 ms: the errors are then known from the log
        def __init__(self, basis):
            self.time_basis = basis

        def step_time(self, batch):
            return 0.01

        def swap_time(self, num_blocks, block_bytes):
            return 0.0

    steps = load_log(str(smollm_log))[2]
    for basis, key in (("cpu", "cpu_s"), ("wall", "step_s")):
        report = replay(str(smollm_log), TenMs(basis))
        assert report.equal and report.time_basis == basis
        # every phase the log's steps fall in has its error (an empty dict would pass the loop)
        assert set(report.step_time_error) == {phase_of(len(s["decision"]["batch"]),
                                                        sum(b[2] for b in s["decision"]["batch"]))
                                               for s in steps}
        for phase, got in report.step_time_error.items():
            want = summarize_errors([abs(0.01 - s[key]) / s[key] for s in steps
                                     if phase_of(len(s["decision"]["batch"]),
                                                 sum(b[2] for b in s["decision"]["batch"])) == phase])
            assert got == pytest.approx(want)
        t = report.totals
        assert t["wall"] >= t["cpu"] > 0 and t["runq"] >= 0 and t["predicted"] == pytest.approx(0.01 * len(steps))


# ----------------------------------------------------------------------------- the token-count table

def _bumpy_samples() -> list[dict]:
    """TRUE_EXECUTE/TRUE_OVERHEAD, except that 2- and 3-sequence decode steps cost extra
    (what SmolLM2's fp32 matmuls do on this CPU)."""
    out = synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD)
    out += [dict(s) for s in synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD) if s["tokens"] == s["seqs"]]
    for s in out:
        if s["tokens"] == s["seqs"] and s["seqs"] in (2, 3):
            s["execute_s"] += 4e-3
    extra = []                    # the bumps need their neighbours: a few 3-sequence steps
    for c in (16, 200, 800):
        seqs, tokens, context, pairs = shape_of([c] * 3, [1] * 3)
        v = feature_values(seqs, tokens, context, pairs)
        t = {part: sum(c_ * v[f] for f, c_ in coefs["decode"].items())
             for part, coefs in (("execute", TRUE_EXECUTE), ("overhead", TRUE_OVERHEAD))}
        extra.append({"seqs": 3, "tokens": 3, "context": context, "pairs": pairs,
                      "execute_s": t["execute"] + 4e-3, "overhead_s": t["overhead"]})
    return out + extra + extra


@functools.lru_cache(maxsize=1)
def _bumpy_model() -> dict:
    return fit_step_cost(_bumpy_samples())


def test_a_cost_that_is_not_linear_in_the_batch_gets_the_token_table():
    from core.cost.fit import TABLE_FAMILY

    model = fit_step_cost(_bumpy_samples())
    check_model(model)
    entry = model["parts"]["execute"]["decode"]
    assert entry["family"] == TABLE_FAMILY and entry["knots"][:4] == [1, 2, 3, 4], entry["held_out"]
    assert entry["held_out"][TABLE_FAMILY]["mean"] < 0.5 * entry["held_out"]["full"]["mean"]
    assert model["parts"]["execute"]["prefill"]["family"] != TABLE_FAMILY      # linear there: no table
    ev = StepCostEvaluator(model)
    truth = lambda n, c: sum(coef * feature_values(n, n, n * c, n * c + n)[f]      # noqa: E731
                             for part in (TRUE_EXECUTE, TRUE_OVERHEAD) for f, coef in part["decode"].items())
    for n in (2, 3):
        assert ev.step_time(n, n, n * 200, n * 200 + n) == pytest.approx(truth(n, 200) + 4e-3, rel=1e-3)
    for n in (1, 4, 8, 64):                # off the bumps, and past the grid: the line
        assert ev.step_time(n, n, n * 200, n * 200 + n) == pytest.approx(truth(n, 200), rel=1e-3)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 80), st.integers(0, 3000), st.integers(0, 40))
def test_the_evaluator_adds_up_the_parts_of_a_table_model(n, ctx, k):
    model = _bumpy_model()
    ev, cm = StepCostEvaluator(model), _fitted(model)
    shape = (n, n, ctx, ctx + n)
    assert ev.step_time(*shape) == pytest.approx(ev.part_time("execute", *shape) + ev.part_time("overhead", *shape))
    assert cm.decode_step_times(n, ctx, k) == [cm.step_time(BatchShape.decode(n, ctx + j * n)) for j in range(k)]


def test_a_table_with_bad_knots_is_refused():
    model = fit_step_cost(_bumpy_samples())
    for knots, match in (([1, 3, 2, 4], "knots must be increasing"), ([0, 1, 2], r">= 1 - at `\$\.parts\.execute\.decode\.knots\[0\]`"),
                         ([1, 2, 4, 8], r"features \['k:3'.* - at `\$\.parts\.execute\.decode\.features`")):     # k:3 is no longer a knot
        bad = json.loads(json.dumps(model))
        entry = bad["parts"]["execute"]["decode"]
        entry["knots"] = knots
        with pytest.raises(ValueError, match=match):
            check_model(bad)
    old = json.loads(json.dumps(fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))))
    old["version"] = 1                     # version-1 files (linear families only) still load
    check_model(old)


# ----------------------------------------------------------------------------- served calibration

def _served_rows(factor_of, n: int = 240, noise: float = 0.05, seed: int = 0) -> list[tuple]:
    """Calibration rows (phase, seqs, tokens, predicted, measured): measured = predicted x
    factor_of(phase, seqs, tokens), with multiplicative noise. A prefill step's tokens grow
    with its predicted time (~4 ms a token: 12-500 tokens)."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        phase = "prefill" if i % 3 == 0 else "decode"
        seqs = rng.choice((1, 1, 2, 3, 4, 6, 8, 12))
        predicted = rng.uniform(0.05, 2.0) if phase == "prefill" else rng.uniform(0.07, 0.3)
        tokens = seqs - 1 + round(predicted / 0.004) if phase == "prefill" else seqs
        rows.append((phase, seqs, tokens, predicted,
                     predicted * factor_of(phase, seqs, tokens) * (1 + rng.uniform(-noise, noise))))
    return rows


def test_served_scale_recovers_per_phase_factors_and_leaves_a_matching_profile_alone():
    from core.cost.fit import fit_served_scale

    fit = fit_served_scale(_served_rows(lambda phase, seqs, tokens: 1.4 if phase == "prefill" else 1.15))
    assert fit["family"] == "phase"
    assert fit["factors"]["prefill"] == pytest.approx(1.4, rel=0.02)
    assert fit["factors"]["decode"] == pytest.approx(1.15, rel=0.02)
    assert fit["held_out"]["phase"]["total"]["mean"] < 0.02 < fit["held_out"]["none"]["total"]["mean"]
    same = fit_served_scale(_served_rows(lambda phase, seqs, tokens: 1.0))
    assert same["family"] == "none" and same["factors"] == {}


def test_served_scale_corrects_a_bias_that_noisy_folds_hide():
    """Regression (the lead's quiet run): every served step took ~10% more than predicted,
    but with few steps and noisy long ones single folds' totals erred more with a factor
    than without, and `none` was chosen; the pooled held-out total shows the bias."""
    from core.cost.fit import fit_served_scale

    fit = fit_served_scale(_served_rows(lambda phase, seqs, tokens: 1.1, n=60, noise=0.3))
    held = fit["held_out"]
    assert held["none"]["total"]["mean"] < held["phase"]["total"]["mean"]      # what hid it
    assert held["phase"]["pooled"] < 0.02 < held["none"]["pooled"]
    assert fit["family"] == "phase"
    assert fit["factors"]["decode"] == pytest.approx(1.1, rel=0.05)


def test_served_scale_finds_a_gap_that_depends_on_the_batch_size():
    from core.cost.fit import fit_served_scale, served_factor

    def gap(phase, seqs, tokens):           # small multi-sequence decodes cost more served; single and large ones not
        return 1.5 if phase == "decode" and 2 <= seqs <= 4 else 1.0
    fit = fit_served_scale(_served_rows(gap, n=400))
    assert fit["family"] == "phase+batch"
    for seqs, want in ((1, 1.0), (3, 1.5), (8, 1.0), (12, 1.0)):
        assert served_factor(fit["factors"], "decode", seqs, seqs) == pytest.approx(want, rel=0.03)
    with pytest.raises(ValueError, match="at least 2"):
        fit_served_scale(_served_rows(gap, n=1))


def _by_size(phase, seqs, tokens):
    """Served prefills cost more over the profile the bigger they are, whatever their batch
    size (what served SmolLM2 showed for few-hundred-token prompts); decodes 1.1x."""
    if phase == "decode":
        return 1.1
    return 1.0 if tokens <= 64 else 1.15 if tokens <= 256 else 1.5


def _held_out_error(factors: dict, rows) -> float:
    """Per phase and prefill-size bucket, |predicted - measured| seconds summed, over all
    measured seconds: how far a simulated clock drifts on each kind of step."""
    from core.cost.fit import prefill_size_bucket, served_factor

    diff: dict[str, float] = {}
    for phase, seqs, tokens, predicted, measured in rows:
        key = phase + (prefill_size_bucket(tokens) if phase == "prefill" else "")
        diff[key] = diff.get(key, 0.0) + predicted * served_factor(factors, phase, seqs, tokens) - measured
    return sum(map(abs, diff.values())) / sum(r[4] for r in rows)


def test_served_scale_buckets_prefills_by_size_when_their_cost_grows_with_it():
    """The light load's p90 TTFT is one 438-token prefill with one decode beside it: priced
    by a factor fitted on prefills of its batch size, mostly small ones, it comes out short.
    A served cost that grows with the prefill's tokens picks the size-bucketed family, which
    predicts other runs' rows (another seed) better than the batch-size family does."""
    from core.cost.fit import fit_served_scale, served_factor, served_factors

    rows = _served_rows(_by_size, n=400)
    fit = fit_served_scale(rows)
    held = fit["held_out"]
    assert fit["family"] == "phase+size"
    assert held["phase+size"]["strata"]["mean"] < 0.6 * held["phase+batch"]["strata"]["mean"]
    assert served_factor(fit["factors"], "prefill", 2, 438) == pytest.approx(1.5, rel=0.03)
    assert served_factor(fit["factors"], "prefill", 2, 40) == pytest.approx(1.0, rel=0.03)
    assert served_factor(fit["factors"], "decode", 3, 3) == pytest.approx(1.1, rel=0.03)
    other = _served_rows(_by_size, n=300, seed=7)             # rows of other runs, never fitted on
    by_batch = served_factors(rows, "phase+batch")
    assert _held_out_error(fit["factors"], other) < 0.02 < 0.05 < _held_out_error(by_batch, other)
    assert served_factor(by_batch, "prefill", 2, 40) > 1.25       # small prefills priced like the big ones
    # The per-stratum error sees a mispricing that cancels within a batch bucket: in every
    # batch size half the prefill seconds are small prompts (served 1.0x) and half big ones
    # (1.5x); a factor per batch bucket (1.25x) gets each bucket's total right and every
    # prefill 20% wrong: 7.5 of the rows' 54 seconds.
    balanced = []
    for i in range(300):
        j = i // 3
        if i % 3 == 0:
            balanced.append(("prefill", 1 + j % 3, 40 if j % 2 else 400, 0.3, 0.3 if j % 2 else 0.45))
        else:
            balanced.append(("decode", 1 + i % 4, 1 + i % 4, 0.075, 0.0825))
    held = fit_served_scale(balanced)["held_out"]
    assert held["phase+batch"]["strata"]["mean"] == pytest.approx(7.5 / 54, rel=0.15)
    assert held["phase+size"]["strata"]["mean"] < 0.01


def test_served_scale_keeps_batch_buckets_when_prefill_cost_follows_the_batch_not_the_size():
    """The converse: small multi-sequence steps cost more served (what 2-4-sequence decode
    and prefill steps showed), whatever the prefill's size: the batch-size family wins and
    the size family, which cannot see it, is not chosen."""
    from core.cost.fit import fit_served_scale

    def by_batch(phase, seqs, tokens):
        return 1.45 if 2 <= seqs <= 4 else 1.0
    fit = fit_served_scale(_served_rows(by_batch, n=400))
    held = fit["held_out"]
    assert fit["family"] == "phase+batch"
    assert held["phase+batch"]["strata"]["mean"] < 0.6 * held["phase+size"]["strata"]["mean"]


def test_a_calibrated_model_scales_prefills_by_their_size_bucket():
    from core.cost.fit import PREFILL_TOKEN_BUCKETS

    factors = {"prefill": 1.2, "prefill:tokens<=64": 1.05, "prefill:tokens>256": 1.6, "decode": 1.1,
               "decode:<=1": 1.02}
    model = dict(_bumpy_model(), served={"factors": factors})
    check_model(model)
    ev, grid = StepCostEvaluator(model), StepCostEvaluator(_bumpy_model())
    assert PREFILL_TOKEN_BUCKETS == (64, 256)
    for seqs, tokens, want in ((1, 64, 1.05), (2, 65, 1.2), (2, 256, 1.2), (2, 257, 1.6), (8, 438, 1.6),
                               (1, 1, 1.02), (3, 3, 1.1)):
        shape = (seqs, tokens, 100, 100 * tokens + tokens)
        assert ev.step_time(*shape) == pytest.approx(want * grid.step_time(*shape)), (seqs, tokens)
    for key in ("prefill:tokens<=100", "decode:tokens>256"):
        with pytest.raises(ValueError, match="unknown factor key"):
            check_model(dict(_bumpy_model(), served={"factors": {key: 1.1}}))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(0, 3000), st.integers(0, 20),
       st.floats(0.5, 3.0), st.floats(0.5, 3.0), st.floats(0.5, 3.0))
def test_a_calibrated_model_scales_the_grid_model_by_its_phase_and_bucket_factor(seqs, ctx, extra, fp, fd, fd4):
    model = dict(_bumpy_model(), served={"factors": {"prefill": fp, "decode": fd, "decode:<=4": fd4}})
    check_model(model)
    ev, grid = StepCostEvaluator(model), StepCostEvaluator(_bumpy_model())
    tokens = seqs + extra
    shape = (seqs, tokens, ctx, ctx + tokens)
    want = fp if extra else fd4 if 2 <= seqs <= 4 else fd     # one sequence: bucket "<=1", no factor of its own
    assert ev.step_time(*shape) == pytest.approx(want * grid.step_time(*shape))
    assert ev.grid_step_time(*shape) == grid.step_time(*shape)
    assert _fitted(model).decode_step_times(seqs, ctx, 2)[0] == ev.step_time(seqs, seqs, ctx, ctx + seqs)


def test_a_bad_served_or_client_section_is_refused():
    for bad, match in (({"served": {"factors": {"decode": 0.0}}}, "finite and > 0"),
                       ({"served": {"factors": {"decode:<=3": 1.2}}}, "unknown factor key"),
                       ({"served": {"family": "phase"}}, r"missing required field `factors` - at `\$\.served`"),
                       ({"client": {"first_token_s": 0.01}}, r"missing required field `last_token_s` - at `\$\.client`"),
                       ({"client": {"first_token_s": float("nan"), "last_token_s": 0.0}}, "finite")):
        with pytest.raises(ValueError, match=match):
            check_model(dict(_bumpy_model(), **bad))


def _log_with_tokens(path: Path, first_text_token: int | None) -> None:
    """A step log of one request (arrives at t=1.0, prompt 3 ids): a prefill step ending at
    1.5 and decode steps ending at 1.6, 1.7 (3 output tokens)."""
    from core.cost.step_log import LOG_FORMAT

    recs = [{"kind": "config", "format": LOG_FORMAT},
            {"kind": "arrival", "req_id": "a", "step": 0, "t": 1.0, "t_arrival": 1.0, "prompt_token_ids": [5, 6, 7]}]
    for i, (start, n, end) in enumerate(((0, 3, 1.5), (3, 1, 1.6), (4, 1, 1.7))):
        recs.append({"kind": "step", "step": i, "t_start": end - 0.05, "t_end": end, "step_s": 0.05,
                     "cpu_s": 0.04, "decision": {"batch": [["a", start, n, 1, 1]]}})
    recs.append({"kind": "finish", "req_id": "a", "status": "length", "num_output_tokens": 3,
                 "first_text_token": first_text_token})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_client_delays_count_from_the_first_token_with_text(tmp_path):
    from core.cost.step_log import load_log
    from sim.twin.calibrate import client_delay_samples
    from sim.twin.validate import workload_from_log

    bench = {"ttfts": [0.62], "itls": [[0.1]], "input_lens": [3], "errors": [""]}
    log = tmp_path / "steps.jsonl"
    _log_with_tokens(log, 2)                # the first token had no text: the client's first is the 2nd
    (first, last), = client_delay_samples(load_log(str(log)), bench)
    assert first == pytest.approx(0.62 - 0.6) and last == pytest.approx(0.72 - 0.7)
    _, _, engine = workload_from_log(log)
    assert engine["first_visible"] == {"a": 1} and engine["first"]["a"] == pytest.approx(0.6)
    _log_with_tokens(log, None)             # an older log: the first token
    assert client_delay_samples(load_log(str(log)), bench)[0][0] == pytest.approx(0.62 - 0.5)
    assert client_delay_samples(load_log(str(log)), dict(bench, input_lens=[4])) == []     # not the same request: left out


def test_the_simulated_client_sees_the_first_visible_token_plus_the_client_delay(tmp_path):
    from sim.twin.validate import run_sim

    log = tmp_path / "steps.jsonl"
    _log_with_tokens(log, 1)
    config = {"scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256,
                            "enable_chunked_prefill": True},
              "cache": {"block_size": 16, "num_gpu_blocks": 32, "num_cpu_blocks": 0, "enable_prefix_caching": False,
                        "watermark": 0.01},
              "policies": {"queue": "fcfs", "preemption": "recompute", "victim": "newest", "eviction": "lru"}}
    trace = Trace([TraceRequest("a", 0.0, 12, 5), TraceRequest("b", 0.01, 20, 4)], "test")
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(_bumpy_model()))
    delayed = tmp_path / "delayed.json"
    delayed.write_text(json.dumps(dict(_bumpy_model(), client={"first_token_s": 0.25, "last_token_s": 0.05})))
    base, e2e0, _, result, *_ = run_sim(config, trace, str(plain))
    shifted, e2e1, *_ = run_sim(config, trace, str(delayed))
    assert shifted["median_ttft"] == pytest.approx(base["median_ttft"] + 0.25)
    assert all(e2e1[k] == pytest.approx(e2e0[k] + 0.05) for k in e2e0)
    second = run_sim(config, trace, str(plain), {"a": 1, "b": 1}).stats   # first text on the 2nd token
    rec = {r.request_id: r for r in result.records}
    want = sorted(rec[k].token_times[1] - rec[k].arrival_time for k in ("a", "b"))
    assert second["median_ttft"] == pytest.approx(sum(want) / 2)
    assert second["median_ttft"] > base["median_ttft"]


def test_bench_serve_skip_takes_a_later_slice_of_the_trace():
    import argparse

    from realexec.bench.serve import add_arguments, build_requests
    from traces import load_trace

    parser = add_arguments(argparse.ArgumentParser())
    first = build_requests(parser.parse_args(["--num-requests", "4", "--max-tokens-cap", "8"]))
    later = build_requests(parser.parse_args(["--num-requests", "4", "--max-tokens-cap", "8", "--skip", "100"]))
    trace = load_trace("traces/sharegpt.json", limit=104)
    assert [r.prompt for r in first] == [r.prompt for r in trace.requests[:4]]
    assert [r.prompt for r in later] == [r.prompt for r in trace.requests[100:104]]
    with pytest.raises(Exception, match="none left after --skip"):
        build_requests(parser.parse_args(["--num-requests", "4", "--skip", "100000"]))


def test_twin_tables_refuses_a_calibration_slice_that_overlaps_validation(capsys, tmp_path):
    from sim.twin.tables import main

    with pytest.raises(SystemExit):       # (a missing --profile: nothing real would run either way)
        main(["--calibration-skip", "5", "--profile", str(tmp_path / "missing.json"), "--out", str(tmp_path / "t")])
    assert "overlaps the validation slices" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_twin_tables_slice_sizes_apply_to_both_slices_and_are_checked(capsys, tmp_path):
    from sim.twin.rounds import CALIBRATION, VALIDATION, Slot
    from sim.twin.tables import main, parse_sizes, serve_args

    assert parse_sizes([]) == {"light": 30, "queueing": 20}
    sizes = parse_sizes(["light=12", "queueing=7", "light=25"])          # the last one wins
    assert sizes == {"light": 25, "queueing": 7}
    for role, skip, seed in ((CALIBRATION, 100, 1), (VALIDATION, 0, 0)):
        a = serve_args(Slot(role, "light", 1), "t.json", 100, sizes)
        assert (a.num_requests, a.rate, a.skip, a.seed, a.engine_args) == (25, 0.5, skip, seed, "")
    q = serve_args(Slot(VALIDATION, "queueing", 0), "t.json", 100)
    assert (q.num_requests, q.rate) == (20, 4.0) and "--num-gpu-blocks 40" in q.engine_args
    for bad, match in (("heavy=3", "unknown scenario 'heavy'"), ("light=x", "expected SCENARIO=N"),
                       ("light", "expected SCENARIO=N"), ("light=0", "must be >= 1")):
        with pytest.raises(ValueError, match=match):
            parse_sizes([bad])
    for argv, match in ((["--num-requests", "light=150"], "overlaps the validation slices"),
                        (["--num-requests", "light=-2"], "must be >= 1")):
        with pytest.raises(SystemExit):          # refused before anything is profiled or served
            main(argv + ["--profile", str(tmp_path / "missing.json"), "--out", str(tmp_path / "t")])
        assert match in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def _spread_report(round_errors: list[float], late_error: float = 0.5, n: int = 30) -> dict:
    """A twin_tables report whose real runs are all alike and whose round r predicts each
    of its first 10 requests' latencies (1 + round_errors[r]) x the real ones, and the
    later requests' (1 + late_error) x; one request of each run failed."""
    real = [(0.1 + 0.01 * i, 0.05 + 0.001 * (i % 7), 1.0 + 0.1 * i) for i in range(n)]
    real[3] = None
    from sim.twin.validate import first_requests_stats

    rounds, stats = [], {"real": [], "sim": []}
    for e in round_errors:
        sim = [None if x is None else tuple(v * (1 + (e if i < 10 else late_error)) for v in x)
               for i, x in enumerate(real)]
        rounds.append({"latencies": {"real": real, "sim": sim}})
        for side, lat in (("real", real), ("sim", sim)):
            stats[side].append(dict(first_requests_stats(lat, n), output_throughput=10.0))
    return {"rounds": rounds, **stats}


def test_twin_spread_recomputes_a_sessions_error_over_its_first_requests_and_its_rounds(tmp_path, capsys):
    from sim.twin.spread import METRICS, main, session_errors, spread

    a, b = _spread_report([0.02, -0.12, 0.04]), _spread_report([0.0, 0.03, -0.09])
    for k in (5, 10):
        ones = session_errors(a, k, 1)
        assert [e["p90_ttft"] for e in ones] == pytest.approx([0.02, -0.12, 0.04])
        assert all(e[m] == pytest.approx(ones[i]["median_tpot"]) for i, e in enumerate(ones) for m in METRICS)
        (three,) = session_errors(a, k, 3)
        assert three["median_e2el"] == pytest.approx((0.02 - 0.12 + 0.04) / 3)      # all real runs alike
    assert len(session_errors(a, 10, 2)) == 3
    assert all(e["p90_e2el"] > 0.15 for e in session_errors(a, 30, 1))             # later requests: +50%
    s = spread([a, b], 10, 1)["p90_ttft"]
    errs = [0.02, -0.12, 0.04, 0.0, 0.03, -0.09]
    assert s["n"] == 6 and s["max"] == pytest.approx(0.12)
    assert s["rms"] == pytest.approx((sum(e * e for e in errs) / 6) ** 0.5)
    assert s["met"] == pytest.approx(5 / 6) and spread([a, b], 10, 1)["median_ttft"]["met"] == pytest.approx(4 / 6)
    for name, rep in (("s1", a), ("s2", b)):
        (tmp_path / name / "light").mkdir(parents=True)
        (tmp_path / name / "light" / "report.json").write_text(json.dumps(rep))
    assert main([str(tmp_path / "s1"), str(tmp_path / "s2"), "--scenarios", "light"]) == 0
    out = capsys.readouterr().out
    assert "**light** (2 sessions)" in out and "| 30 | 3 | 2 |" in out and "| 20 | 2 | 6 |" in out
    assert "| metric | s1 | s2 | pooled, 6 rounds |" in out and "| output_throughput | +0.0% (0.0) |" in out
    for name, rep in (("s1", a), ("s2", b)):         # with the host-term oracle: a second error in each cell
        rep["at_run_speed"] = [dict(r, median_ttft=r["median_ttft"] * 1.25) for r in rep["real"]]
        (tmp_path / name / "light" / "report.json").write_text(json.dumps(rep))
    assert main([str(tmp_path / "s1"), str(tmp_path / "s2"), "--scenarios", "light"]) == 0
    out = capsys.readouterr().out
    assert "| output_throughput | +0.0 \\| +0.0% (0.0) |" in out
    assert [line.count("\\| +25.0%") for line in out.splitlines() if line.startswith("| median_ttft")] == [3]
    (tmp_path / "old" / "light").mkdir(parents=True)
    (tmp_path / "old" / "light" / "report.json").write_text(json.dumps({"rounds": [{"errors": {}}]}))
    with pytest.raises(SystemExit):
        main([str(tmp_path / "old"), "--scenarios", "light"])
    assert "no per-request latencies" in capsys.readouterr().err


def test_calibrate_serves_a_disjoint_slice_and_fits_the_served_steps(tiny, tiny_profile, tmp_path):
    prof, _ = tiny_profile
    out = tmp_path / "calibrated.json"
    r = subprocess.run([PY, "-m", "sim", "calibrate", "traces/sharegpt.json", "--cost-model", str(prof),
                        "--out", str(out), "--skip", "30", "--max-tokens-cap", "4",
                        "--load", f"8:5:--model {tiny} --block-size 16 --num-gpu-blocks 128 --swap-space 0.01"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "served calibration on" in r.stdout and "client delay" in r.stdout
    model = json.loads(out.read_text())
    check_model(model)
    served = model["served"]
    assert set(served["held_out"]) == {"none", "phase", "phase+batch", "phase+size"}
    assert served["family"] in served["held_out"]
    from core.cost.step_log import load_log

    _, arrivals, steps, finishes = load_log(str(out) + ".runs/real1.steps.jsonl")
    assert served["n"] == len(steps) and len(served["rows"]) == len(steps)
    shown = [f["first_text_token"] for f in finishes.values()]        # when each one's text first showed
    assert any(k is not None for k in shown) and all(k is None or 1 <= k <= 4 for k in shown)
    from traces import load_trace
    trace = load_trace("traces/sharegpt.json", limit=35)        # the calibration slice: requests 30-34
    assert len(arrivals) == 5
    assert sorted(len(a["prompt_token_ids"]) for a in arrivals) == sorted(q.prompt_len for q in trace.requests[30:])
    assert model["client"]["n"] >= 1 and model["calibration"]["skip"] == 30
    ev, grid = StepCostEvaluator(model), StepCostEvaluator(json.loads(prof.read_text()))
    assert ev.grid_step_time(1, 1, 10, 11) == pytest.approx(grid.step_time(1, 1, 10, 11))


def test_freezing_the_startup_heap_takes_it_out_of_full_collections_but_collects_new_garbage():
    import gc
    import weakref

    from realexec.engine.llm_engine import freeze_startup_heap

    class Node:
        pass
    gc.collect()
    tracked = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        assert frozen >= 0.9 * tracked and len(gc.get_objects()) < 0.1 * tracked
        node = Node()
        node.self = node                     # a cycle made after the freeze: still garbage-collected
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


# ----------------------------------------------------------------------------- A/B rounds

def test_served_scale_prices_a_mix_unlike_the_calibration_runs_by_its_own_batch_size():
    """Regression (quiet run 17:33): 1-sequence served decodes ran at the profile's speed,
    larger batches and prefills ~1.25x slower. One decode factor gets the calibration runs'
    mix right (pooled and per-fold totals equal to phase+batch's) but prices a light load
    of mostly 1-sequence decodes 20% high; the per-stratum held-out error shows it."""
    from core.cost.fit import fit_served_scale, served_factor

    def gap(phase, seqs, tokens):
        return 1.0 if phase == "decode" and seqs == 1 else 1.25
    rows = _served_rows(gap, n=240, noise=0.1)
    fit = fit_served_scale(rows)
    held = fit["held_out"]
    assert held["phase"]["pooled"] <= held["phase+batch"]["pooled"]          # what hid it
    assert held["phase"]["strata"]["mean"] > 1.3 * held["phase+batch"]["strata"]["mean"]
    assert fit["family"] == "phase+batch"
    assert served_factor(fit["factors"], "decode", 1, 1) == pytest.approx(1.0, rel=0.06)
    assert served_factor(fit["factors"], "decode", 3, 3) == pytest.approx(1.25, rel=0.06)
    same = fit_served_scale(_served_rows(lambda phase, seqs, tokens: 1.2, n=240, noise=0.1))
    assert same["family"] == "phase"                  # no gap between batch sizes: the simpler family


def test_rounds_interleave_calibration_and_validation_and_pair_each_with_its_neighbours():
    from sim.twin.rounds import CALIBRATION, VALIDATION, Slot, calibration_for, schedule

    slots = schedule(["a", "b"], 2)
    assert [s.name for s in slots] == ["cal-a-r0", "val-a-r0", "cal-b-r0", "val-b-r0", "cal-a-r1", "val-a-r1",
                                       "cal-b-r1", "val-b-r1", "cal-a-r2", "cal-b-r2"]
    assert calibration_for(slots, Slot(VALIDATION, "b", 1)) == [Slot(CALIBRATION, "b", 1), Slot(CALIBRATION, "b", 2)]
    seq = schedule(["a", "b"], 2, "sequential")
    assert sorted(seq, key=str) == sorted(slots, key=str) and all(s.role == CALIBRATION for s in seq[:6])
    assert calibration_for(seq, Slot(VALIDATION, "a", 0)) == [Slot(CALIBRATION, "a", 2)]
    assert all(s.role == VALIDATION for s in schedule(["a"], 3, calibrate=False))
    for bad, match in (((["a"], 0), "rounds must be"), (([], 1), "no scenario"), ((["a"], 1, "zigzag"), "design")):
        with pytest.raises(ValueError, match=match):
            schedule(*bad)
    # a left-out calibration run is fitted on the others: the pairings' candidates
    assert calibration_for(slots, Slot(CALIBRATION, "a", 1)) == [Slot(CALIBRATION, "a", 0), Slot(CALIBRATION, "a", 2)]
    assert calibration_for(slots, Slot(CALIBRATION, "a", 1), "scenario") == [Slot(CALIBRATION, "a", 0),
                                                                             Slot(CALIBRATION, "a", 2)]
    assert calibration_for(slots, Slot(VALIDATION, "a", 1), "scenario") == [Slot(CALIBRATION, "a", r) for r in range(3)]
    assert len(calibration_for(slots, Slot(VALIDATION, "a", 1), "session")) == 6
    with pytest.raises(ValueError, match="not a run of this schedule"):
        calibration_for(slots, Slot(VALIDATION, "a", 5))
    with pytest.raises(ValueError, match="pairing must be"):
        calibration_for(slots, Slot(VALIDATION, "a", 0), "nearest")


class DriftingHost:
    """A fake served-run source: an engine that serves one request at a time (arrivals 5 s
    apart), each step taking the profile's time x a speed that drifts with every run served
    (run i of the schedule: drift(i)), and writes what `realexec serve --step-log` and
    `bench serve` write (client = engine: no HTTP delay)."""
    CONFIG = {"kind": "config", "format": "twinserve-step-log",
              "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 512,
                            "enable_chunked_prefill": True},
              "cache": {"block_size": 16, "num_gpu_blocks": 64, "num_cpu_blocks": 0, "enable_prefix_caching": False,
                        "watermark": 0.01},
              "policies": {"queue": "fcfs", "preemption": "recompute", "victim": "newest", "eviction": "lru"}}
    REQUESTS = {"calibration": [(24, 6), (60, 5), (9, 8), (40, 6)], "validation": [(30, 7), (12, 6), (50, 5)]}

    def __init__(self, model: dict, slots: list, drift, jitter=None, wake=(), intake=0.0):
        self.grid, self.slots, self.drift = StepCostEvaluator(model), slots, drift
        self.jitter = jitter          # a StepJitter: each step also x its next factor
        self.wake = wake              # the first steps of each request (after idle) also x these
        self.intake = intake          # seconds from the server to the engine

    def _step(self, recs, t, rid, start, n, speed, place=0):
        dt = self.grid.step_time(*shape_of([start], [n])) * speed * (self.jitter.next() if self.jitter else 1.0)
        dt *= self.wake[place] if place < len(self.wake) else 1.0
        recs.append({"kind": "step", "step": len(recs), "t_start": t, "t_end": t + dt, "step_s": dt, "cpu_s": dt,
                     "decision": {"batch": [[rid, start, n, 1, 4]], "preempted": []}})
        return t + dt

    def __call__(self, slot, folder: Path):
        speed = self.drift(self.slots.index(slot))
        recs, t = [dict(self.CONFIG)], 0.0
        bench = {"ttfts": [], "itls": [], "input_lens": [], "output_lens": [], "errors": []}
        for i, (prompt, out) in enumerate(self.REQUESTS[slot.role]):
            rid, arrival = f"{slot.role}{i}", 1.0 + 5.0 * i
            t = max(t, arrival + self.intake)
            recs.append({"kind": "arrival", "req_id": rid, "step": len(recs), "t": t, "t_arrival": arrival,
                         "prompt_token_ids": [7] * prompt})
            t = first = self._step(recs, t, rid, 0, prompt, speed)
            itls = []
            for j in range(1, out):
                end = self._step(recs, t, rid, prompt + j - 1, 1, speed, j)
                itls.append(end - t)
                t = end
            recs.append({"kind": "finish", "req_id": rid, "status": "length", "num_output_tokens": out,
                         "first_text_token": 1})
            for key, v in (("ttfts", first - arrival), ("itls", itls), ("input_lens", prompt), ("output_lens", out),
                           ("errors", "")):
                bench[key].append(v)
        bench["output_throughput"] = sum(bench["output_lens"]) / (t - 1.0)
        log, result = folder / "real1.steps.jsonl", folder / "real1.bench.json"
        log.write_text("".join(json.dumps(r) + "\n" for r in recs))
        result.write_text(json.dumps(bench))
        return log, result, {"loadavg_1m_before": 0.0, "loadavg_1m_after": 0.0}


def _rounds_on_a_drifting_host(tmp_path: Path, design: str, drift, jitter=None, wake=(),
                               intake: float = 0.0, pairing: str | None = None) -> tuple[dict, str, dict]:
    """(light scenario's report, the pairing chosen by the held-out check (or `pairing`
    where given), the check)."""
    from sim.twin.rounds import schedule
    from sim.twin.tables import pick_pairing, scenario_report, serve_all

    profile = _bumpy_model()
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    slots = schedule(["light"], 3, design)
    runs = serve_all(slots, DriftingHost(profile, slots, drift, jitter, wake, intake), tmp_path / "runs")
    chosen, check = pick_pairing(slots, runs, profile)
    pairing = pairing or chosen
    return scenario_report("light", slots, runs, profile, str(path), tmp_path / "light", pairing), pairing, check


def test_interleaved_rounds_track_a_host_that_drifts_and_sequential_ones_do_not(tmp_path):
    """The host gets 8% slower with every run served. Interleaved (C0 V0 C1 V1 ..), each
    validation run is predicted by the calibration runs on either side of it: its own
    speed, whatever the drift. Sequential (every calibration first), the prediction keeps
    the last calibration run's speed and falls further behind every round; so does one
    calibration made before everything (the `calibrated once` column)."""
    drift = lambda i: 1.0 + 0.08 * i                     # noqa: E731
    inter, pairing, check = _rounds_on_a_drifting_host(tmp_path / "interleaved", "interleaved", drift)
    assert pairing == "neighbours"            # held out on calibration runs alone: C(r) from C(r-1), C(r+1)
    assert max(map(abs, check["neighbours"])) < 0.01 < min(map(abs, check["scenario"] + check["session"]))
    for r, entry in enumerate(inter["rounds"]):
        assert entry["fed"] == [f"cal-light-r{r}", f"cal-light-r{r + 1}"]
        assert entry["predicted_ratio"] == pytest.approx(drift(2 * r + 1), rel=0.01)       # V(r) is run 2r+1
        assert entry["validation_ratio"] == pytest.approx(drift(2 * r + 1), rel=1e-6)
        for k in ("median_tpot", "p90_tpot", "median_e2el"):
            assert abs(entry["errors"][k]) < 0.01, (r, k, entry["errors"][k])
    for k in ("median_tpot", "median_ttft", "median_e2el"):        # (throughput: set by the arrivals here)
        assert abs(inter["errors"]["sim vs mean"][k]) < 0.01
        assert abs(inter["errors"]["calibrated once vs mean"][k]) > 0.1
    assert (tmp_path / "interleaved" / "light" / "round2.png").exists()
    assert all(entry["jitter"]["sigma"] < 1e-9 for entry in inter["rounds"])   # every step alike within a run
    from sim.twin.validate import first_requests_stats
    for r, entry in enumerate(inter["rounds"]):          # the stored per-request latencies are the reported ones
        for side, stats in (("real", inter["real"][r]), ("sim", inter["sim"][r])):
            again = first_requests_stats(entry["latencies"][side], inter["num_requests"])
            assert inter["num_requests"] == len(entry["latencies"][side]) == 3
            assert again == pytest.approx({k: v for k, v in stats.items() if k != "output_throughput"})

    seq, _, _ = _rounds_on_a_drifting_host(tmp_path / "sequential", "sequential", drift)
    tpot = [entry["errors"]["median_tpot"] for entry in seq["rounds"]]
    assert all(e < -0.04 for e in tpot) and tpot[0] > tpot[1] > tpot[2]
    assert seq["errors"]["sim vs mean"]["median_tpot"] < -0.08
    steady, _, _ = _rounds_on_a_drifting_host(tmp_path / "steady", "sequential", lambda i: 1.2)
    assert all(abs(e["errors"]["median_tpot"]) < 0.01 for e in steady["rounds"])     # no drift: both designs fit


def test_at_the_validation_runs_own_speed_only_the_models_error_is_left(tmp_path):
    """The host term, measured: calibrated sequentially on a host that gets 8% slower with
    every run, the prediction falls behind the validation runs; the same model scaled to
    each validation run's own speed (its logged steps against their price) predicts it, and
    markdown shows both columns."""
    from sim.twin.tables import markdown

    drift = lambda i: 1.0 + 0.08 * i                     # noqa: E731
    report, _, _ = _rounds_on_a_drifting_host(tmp_path, "sequential", drift)
    assert report["errors"]["sim vs mean"]["median_tpot"] < -0.08
    for k in ("median_tpot", "p90_tpot", "median_ttft", "median_e2el"):
        assert abs(report["errors"]["at the run's speed vs mean"][k]) < 0.01, k
        for entry in report["rounds"]:
            assert abs(entry["errors_at_run_speed"][k]) < 0.01, (entry["round"], k)
    assert len(report["at_run_speed"]) == len(report["rounds"]) == 3
    assert "at the run's speed vs mean" in markdown(report)


def test_run_speed_is_a_runs_logged_steps_against_their_price(tmp_path):
    """Steps that took 1.3x their price on a core they had half the time: a CPU-seconds
    model's run speed is 1.3 x the contention scale 2; a wall-seconds model, which prices
    the waits already, reads the wall seconds."""
    from core.cost.fit import StepCostEvaluator
    from sim.twin.validate import run_speed

    model = _bumpy_model()
    grid = StepCostEvaluator(model)
    recs = [dict(DriftingHost.CONFIG)]
    for i, (start, n) in enumerate([(0, 24), (24, 1), (25, 1), (0, 60), (60, 1)]):
        cpu = 1.3 * grid.step_time(*shape_of([start], [n]))
        recs.append({"kind": "step", "step": i, "t_start": i, "t_end": i + 2 * cpu, "step_s": 2 * cpu, "cpu_s": cpu,
                     "decision": {"batch": [["r", start, n, 1, 4]], "preempted": []}})
    log = tmp_path / "run.steps.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cpu_model = {**model, "profile": {**model.get("profile", {}), "time_basis": "cpu"}}
    assert run_speed(cpu_model, log, 2.0) == pytest.approx(2.6)
    assert run_speed(cpu_model, log) == pytest.approx(1.3)
    wall_model = {**model, "profile": {**model.get("profile", {}), "time_basis": "wall"}}
    assert run_speed(wall_model, log, 2.0) == pytest.approx(2.6)
    empty = tmp_path / "empty.steps.jsonl"
    empty.write_text(json.dumps(DriftingHost.CONFIG) + "\n")
    assert run_speed(cpu_model, empty) is None


def test_a_host_that_only_jitters_is_calibrated_on_the_whole_session(tmp_path):
    """Run-to-run jitter without a trend (what this host showed: 1.07-1.34x between
    consecutive runs): two neighbours average it less well than every calibration run of
    the session, and the held-out check says so."""
    from sim.twin.rounds import choose_pairing

    jitter = [1.3, 1.1, 1.0, 1.2, 1.3, 1.15, 1.0]           # calibration runs (0, 2, 4, 6): up, down, up, down
    report, pairing, check = _rounds_on_a_drifting_host(tmp_path, "interleaved", lambda i: jitter[i])
    assert pairing == "scenario"             # (one scenario: the session's runs are the same ones; a tie: the first)
    assert sum(map(abs, check[pairing])) < sum(map(abs, check["neighbours"]))
    assert all(len(r["fed"]) == 4 for r in report["rounds"])
    assert choose_pairing({"neighbours": [0.01, -0.01], "scenario": [0.01, 0.01], "session": []}) == "neighbours"
    assert choose_pairing({"neighbours": [], "scenario": [], "session": []}) == "neighbours"


def test_a_host_whose_steps_jitter_gets_that_jitter_in_its_calibration_and_predictions(tmp_path):
    """Each step x a log-normal factor (sd 10%, consecutive steps correlated 0.6): the
    calibrated models carry that spread, the prediction is the mean of jittered simulations
    (so it differs from the unjittered one), and the per-draw latencies are stored."""
    from core.cost.fit import StepJitter
    from sim.twin.validate import JITTER_DRAWS

    report, _, _ = _rounds_on_a_drifting_host(tmp_path, "interleaved", lambda i: 1.1, StepJitter(0.1, 0.6, seed=3))
    for entry in report["rounds"]:
        assert entry["jitter"]["sigma"] == pytest.approx(0.1, rel=0.35)
        assert entry["jitter"]["runs"] == len(entry["fed"])
        assert len(entry["latencies"]["sim_draws"]) == JITTER_DRAWS
        assert entry["latencies"]["sim"] == entry["latencies"]["sim_draws"][0]
    assert report["sim"] != report["no_jitter"]
    assert "no jitter vs mean" in report["errors"]
    from sim.twin.tables import markdown
    assert "| step jitter sd / corr. (+ slow part's share / corr.) |" in markdown(report)


def test_rounds_that_share_a_model_average_distinct_jitter_draws_and_report_standard_errors(tmp_path):
    """Every round fitted on the whole session gets the same calibrated model; were the
    rounds to reuse one set of jitter seeds, their mean would average the same few draws
    R times (on vLLM's queueing runs two slow draws of 16, repeated in 12 rounds, put the
    median TTFT +18% off). Each round takes its own seeds, and the report gives the real
    mean's standard error and the simulation's Monte Carlo one."""
    from core.cost.fit import StepJitter
    from sim.twin.tables import markdown
    from sim.twin.validate import JITTER_DRAWS

    report, pairing, _ = _rounds_on_a_drifting_host(tmp_path, "interleaved", lambda i: 1.1,
                                                    StepJitter(0.1, 0.6, seed=3), pairing="session")
    rounds = report["rounds"]
    assert pairing == "session" and len(rounds) == 3
    assert all(r["fed"] == rounds[0]["fed"] for r in rounds)
    models = {(tmp_path / "light" / f"calibrated.r{r['round']}.json").read_text() for r in rounds}
    assert len(models) == 1                                      # one model ...
    draws = [tuple(map(tuple, d)) for r in rounds for d in r["latencies"]["sim_draws"]]
    assert len(draws) == 3 * JITTER_DRAWS and len(set(draws)) == len(draws)      # ... and no draw twice
    real_se, sim_se = report["real_se"], report["sim_se"]
    for k in ("median_ttft", "median_tpot", "p90_e2el"):
        assert 0 < sim_se[k] < 0.05 and 0 <= real_se[k] < 0.2
    table = markdown(report)
    assert "real mean's SE (±) | sim's Monte Carlo SE (±) |" in table


def test_standard_errors_of_a_mean_of_means():
    from sim.twin.validate import standard_error

    runs = [{"x": 1.0}, {"x": 3.0}]                               # real runs: groups of one, spread across
    assert standard_error([[r] for r in runs])["x"] == pytest.approx(math.sqrt(2.0 / 2) / 2.0)
    draws = [[{"x": 1.0}, {"x": 3.0}], [{"x": 5.0}, {"x": 7.0}, {"x": 9.0}]]   # within each round's draws
    var = (2.0 / 2 + 4.0 / 3) / 2 ** 2
    assert standard_error(draws)["x"] == pytest.approx(math.sqrt(var) / 4.5)
    assert math.isnan(standard_error([[{"x": 2.0}]])["x"])


def test_the_full_profile_grid_times_prefills_of_served_prompt_sizes_in_one_step():
    """`serve` prefills a prompt of a few hundred tokens in one step (chunk 2048), and on
    CPU such a step costs more than the line through smaller ones: the full grid must time
    one-step prefills up to 512 tokens (the light slice's 438-token prompt), not
    extrapolate from 256."""
    from realexec.twin.profile import FULL_CHUNK, grid

    work = grid(FULL_CHUNK, quick=False)
    one_step = {p["tokens"] for kind, p in work if kind == "prefill" and p["context"] == 0}
    assert max(one_step) >= 512 and 256 in one_step
    assert max(p["new_prompt"] for kind, p in work if kind == "mixed") >= 512      # beside decodes too


_ALLOCATING_STEPS = """
import resource, sys
if sys.argv[1] == "keep":
    from realexec.engine.llm_engine import keep_freed_memory
    assert keep_freed_memory()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(20):                     # steps allocating and freeing activations of a few MiB
    bufs = []
    for mb in (3, 6, 1, 12, 2, 24):
        n = (mb << 20) + i * 4096
        b = bytearray(n)
        b[::4096] = b"\\x01" * len(range(0, n, 4096))
        bufs.append(b)
    del bufs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and Linux page-fault counts")
def test_keeping_freed_memory_spares_every_step_its_page_faults():
    """Steps that allocate and free activations of a few MiB: with glibc's defaults each
    one faults most of its pages in again; kept, only the first does."""
    faults = {}
    for mode in ("default", "keep"):
        r = subprocess.run([PY, "-c", _ALLOCATING_STEPS, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        faults[mode] = int(r.stdout.split()[-1])
    first_step = sum(mb << 20 for mb in (3, 6, 1, 12, 2, 24)) // 4096
    assert faults["default"] > 5 * first_step          # faulted again step after step
    assert faults["keep"] < 2 * first_step             # the first step's pages, then reused
