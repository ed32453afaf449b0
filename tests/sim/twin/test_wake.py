"""The first steps after the engine sat idle, priced apart (a calibrated model's "wake"
section): the step log says where each step stands after idle
(core.cost.step_log.steps_since_idle), `sim calibrate` fits one factor per place on top of
the served factors, which it fits on the other steps (core.cost.fit.fit_wake), and the
simulator charges them after every idle gap (core.cost.fitted.FittedCostModel)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from core.cost.fit import MIN_WAKE_STEPS, WAKE_STEPS, ServedStep, check_model, fit_step_cost, fit_wake
from core.cost.fitted import FittedCostModel
from core.cost.model import BatchShape, RooflineCostModel
from core.cost.specs import get_hardware, get_model
from core.cost.step_log import MAX_LOOP_GAP_S, intake_seconds, steps_since_idle
from sim.cluster.fleet import FleetConfig, simulate_fleet
from sim.config import SimConfig
from sim.run import simulate
from traces import Trace, TraceRequest
from tests.sim.twin.test_calibration import TRUE_EXECUTE, TRUE_OVERHEAD, _rounds_on_a_drifting_host, synthetic_samples


def _step(i, t0, t1, *rids):
    return {"kind": "step", "step": i, "t_start": t0, "t_end": t1, "step_s": t1 - t0,
            "decision": {"batch": [[r, 0, 1, 1, 1] for r in rids], "preempted": []}}


def test_steps_count_from_the_last_time_the_engine_sat_idle():
    """a runs alone (steps 0-2) and finishes; b reaches the server after step 2 ended (idle:
    place 1 again); c enters during b's first step and joins a busy engine (no reset); d
    enters after step 5 ended but e, still running, is in the same step (not idle); f
    reaches the server during step 6, in which d and e finish, and is handed over as it
    ends: the engine never waited."""
    steps = [_step(0, 0.0, 0.1, "a"), _step(1, 0.1, 0.2, "a"), _step(2, 0.2, 0.3, "a"),
             _step(3, 0.5, 0.6, "b"), _step(4, 0.6, 0.7, "b", "c"), _step(5, 0.7, 0.8, "c", "e"),
             _step(6, 0.85, 0.9, "e", "d"), _step(7, 0.9002, 1.0, "f")]
    arrivals = [{"req_id": r, "t": t} for r, t in (("a", 0.0), ("b", 0.45), ("c", 0.55), ("e", 0.65), ("d", 0.82))]
    arrivals.append({"req_id": "f", "t": 0.9001, "t_arrival": 0.87})
    assert steps_since_idle(steps, arrivals) == [1, 2, 3, 1, 2, 3, 4, 5]
    late = arrivals[:-1] + [{"req_id": "f", "t": 0.9001, "t_arrival": 0.9}]   # reached it as step 6 ended
    assert steps_since_idle(steps, late) == [1, 2, 3, 1, 2, 3, 4, 5]
    idle = arrivals[:-1] + [{"req_id": "f", "t": 0.9001, "t_arrival": 0.90005}]
    assert steps_since_idle(steps, idle)[-1] == 1
    # without arrivals: a gap longer than the loop's is idle
    gap = [_step(0, 0.0, 0.1, "a"), _step(1, 0.1, 0.2, "a"), _step(2, 0.2 + MAX_LOOP_GAP_S + 0.1, 1.5, "b")]
    assert steps_since_idle(gap) == [1, 2, 1]
    assert steps_since_idle([]) == []


def _rows(wake: list[float], runs: int = 3, requests: int = 6, steps: int = 9) -> list[ServedStep]:
    """Runs of requests served one at a time after idle: a prefill (served x1.5) and decodes
    (x1.2), the first len(wake) steps of each request x wake on top."""
    rows = []
    for _ in range(runs):
        for _ in range(requests):
            for j in range(steps):
                phase, tokens, pred, served = ("prefill", 80, 0.2, 1.5) if j == 0 else ("decode", 1, 0.05, 1.2)
                extra = wake[j] if j < len(wake) else 1.0
                rows.append(ServedStep(phase, 1, tokens, pred, pred * served * extra, j + 1))
    return rows


def test_the_wake_fit_recovers_what_the_first_steps_after_idle_cost_more():
    rows = _rows([1.09, 1.06, 1.04, 1.03])
    fit = fit_wake(rows, {"prefill": 1.5, "decode": 1.2})
    assert fit["factors"] == pytest.approx([1.09, 1.06, 1.04, 1.03])
    assert fit["n"] == [18] * WAKE_STEPS
    # places past WAKE_STEPS are the busy engine's; a place with too few steps keeps 1
    assert fit_wake(_rows([1.2] * 6), {"prefill": 1.5, "decode": 1.2})["factors"] == pytest.approx([1.2] * 4)
    few = _rows([1.3], runs=1, requests=MIN_WAKE_STEPS - 1)
    assert fit_wake(few, {"prefill": 1.5, "decode": 1.2})["factors"] == [1.0] * WAKE_STEPS
    # rows from before the place was logged (5 fields, place 0) are no wake steps
    assert fit_wake([tuple(r)[:5] for r in rows], {"prefill": 1.5, "decode": 1.2})["n"] == [0] * WAKE_STEPS


def _model(wake: list[float] | None) -> dict:
    model = fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))
    if wake is not None:
        model["wake"] = {"factors": wake, "n": [10] * len(wake)}
    return model


def _roofline():
    return RooflineCostModel(get_model("SmolLM2-135M"), get_hardware("cpu-2core"))


def test_the_fitted_model_charges_the_wake_factors_after_each_idle_gap():
    plain, waking = FittedCostModel(_model(None), _roofline()), FittedCostModel(_model([2.0, 1.5]), _roofline())
    prefill, decode = BatchShape(1, 80, 0, 80 * 81 // 2), BatchShape.decode(1, 80)
    p, d = plain.step_time(prefill), plain.step_time(decode)
    assert waking.waking                                   # the engine starts idle
    assert [waking.step_time(prefill), waking.step_time(decode), waking.step_time(decode)] == \
        pytest.approx([2.0 * p, 1.5 * d, d])
    assert not waking.waking
    assert waking.step_time(BatchShape(0, 0, 0, 0)) == 0.0 and not waking.waking   # an empty step is no step
    waking.engine_idle()
    assert waking.waking
    with pytest.raises(RuntimeError, match="one at a time"):
        waking.decode_step_times(1, 80, 4)                 # no span over the first steps after idle
    assert waking.step_time(decode) == pytest.approx(2.0 * d)
    assert plain.decode_step_times(1, 80, 2) == [plain.step_time(BatchShape.decode(1, 80 + j)) for j in range(2)]
    for bad in ({"factors": [1.1, 0.0]}, {"factors": [1.1, float("nan")]}, {"factors": "1.1"}, {"n": [1]}):
        with pytest.raises(ValueError, match="wake"):
            check_model({**_model(None), "wake": bad})


def _spaced_trace(n: int = 6, gap: float = 30.0) -> Trace:
    """Requests far enough apart that each finds the engine idle."""
    return Trace([TraceRequest(f"r{i}", arrival_time=gap * i, prompt_len=60 + 10 * i, output_len=12)
                  for i in range(n)], source="spaced")


def _sim(tmp_path, wake, trace, **kw):
    path = tmp_path / f"model-{wake}.json"
    path.write_text(json.dumps(_model(wake)))
    return simulate(SimConfig(model="SmolLM2-135M", hardware="cpu-2core", num_gpu_blocks=400,
                              cost_model=str(path), **kw), trace)


def test_the_simulator_prices_each_request_that_finds_the_engine_idle_as_waking(tmp_path):
    """Alone on an idle engine, a request's prefill is the first step after idle: its TTFT
    is the wake factor times the plain one, every time the engine went idle, and its decode
    steps past the wake places cost what they did. Event skipping (spans) changes nothing."""
    trace = _spaced_trace()
    plain = _sim(tmp_path, None, trace)
    waking = _sim(tmp_path, [1.3, 1.1], trace)
    for a, b in zip(plain.records, waking.records):
        assert b.ttft == pytest.approx(1.3 * a.ttft, rel=1e-9)
    d = plain.records[0].itls                  # the first decode x1.1, the other ten as they were
    assert waking.records[0].itls == pytest.approx([1.1 * d[0]] + d[1:], rel=1e-9)
    assert _sim(tmp_path, [1.3, 1.1], trace, event_skipping=False).records == waking.records
    assert waking.num_normal_steps < waking.num_steps           # spans still skip the busy stretches
    # a busy engine (every request at once) wakes once
    burst = Trace([replace(r, arrival_time=0.0) for r in trace.requests], source="burst")
    once, flat = _sim(tmp_path, [1.3, 1.1], burst), _sim(tmp_path, None, burst)
    assert once.records[0].ttft == pytest.approx(1.3 * flat.records[0].ttft, rel=1e-9)
    late = [b.e2el - a.e2el for a, b in zip(flat.records, once.records)]
    assert max(late) == pytest.approx(min(late), rel=1e-6)   # two steps dearer, once: everyone is as late


def test_fleet_replicas_wake_after_their_own_idle_gaps(tmp_path):
    """Each replica of a fleet prices its own first steps after idle, spans or not."""
    trace = _spaced_trace(8, 20.0)
    path = tmp_path / "wake.json"
    path.write_text(json.dumps(_model([1.3, 1.1])))
    plain_path = tmp_path / "plain.json"
    plain_path.write_text(json.dumps(_model(None)))
    base = SimConfig(model="SmolLM2-135M", hardware="cpu-2core", num_gpu_blocks=400, cost_model=str(path))
    waking = simulate_fleet(FleetConfig(base, 2), trace)
    stepwise = simulate_fleet(FleetConfig(replace(base, event_skipping=False), 2), trace)
    plain = simulate_fleet(FleetConfig(replace(base, cost_model=str(plain_path)), 2), trace)
    assert waking.records == stepwise.records
    for a, b in zip(plain.records, waking.records):
        assert b.ttft == pytest.approx(1.3 * a.ttft, rel=1e-9)


def test_calibration_fits_the_wake_apart_and_the_twin_predicts_ttft_with_it(tmp_path):
    """A host on which each request (alone, after idle) has its first four steps cost 1.4,
    1.2, 1.1, 1.05x more than its busy steps (x1.1, the host's speed). Every prefill here is
    a first step after idle: with no busy prefill to tell them apart, the prefill factor is
    the one after idle (1.54) and place 1's factor 1; the decodes at places 2-4 get theirs
    on top of a decode factor of 1.1 fitted on the busy steps. The twin's TTFT and TPOT are
    right; without the wake section its TPOT comes out short."""
    wake = [1.4, 1.2, 1.1, 1.05]
    report, _, _ = _rounds_on_a_drifting_host(tmp_path, "interleaved", lambda i: 1.1, wake=wake)
    for entry in report["rounds"]:
        model = json.loads((tmp_path / "light" / f"calibrated.r{entry['round']}.json").read_text())
        served = model["served"]["factors"]
        assert served["decode"] == pytest.approx(1.1, rel=1e-6) and served["prefill"] == pytest.approx(1.1 * 1.4)
        assert model["wake"]["factors"] == pytest.approx([1.0] + wake[1:], rel=1e-6)
        assert abs(entry["errors"]["median_ttft"]) < 0.01
        assert abs(entry["errors"]["median_tpot"]) < 0.01
    assert abs(report["errors"]["sim vs mean"]["median_ttft"]) < 0.01
    # the same calibrated model without its wake section: the first decodes at the busy price
    from sim.twin.validate import client_stats, run_sim, workload_from_log
    model = json.loads((tmp_path / "light" / "calibrated.r0.json").read_text())
    path = tmp_path / "no-wake.json"
    path.write_text(json.dumps({k: v for k, v in model.items() if k != "wake"}))
    (log,) = tmp_path.glob("runs/*-val-light-r0/real1.steps.jsonl")
    config, trace, engine = workload_from_log(log)
    stats = run_sim(config, trace, str(path), engine["first_visible"]).stats
    real = client_stats(json.loads(log.with_name("real1.bench.json").read_text()))
    assert stats["median_ttft"] == pytest.approx(real["median_ttft"], rel=1e-3)      # the prefill: served factor
    assert stats["median_tpot"] < 0.97 * real["median_tpot"]
    # the uncalibrated profile misses the host's speed and the wake both
    assert report["errors"]["uncalibrated vs mean"]["median_ttft"] < -0.3
    from sim.twin.tables import markdown
    assert "| first steps after idle |" in markdown(report) and "| x1.00 x1.20 x1.10 x1.05 |" in markdown(report)


def test_intake_counts_only_requests_that_found_the_engine_idle():
    """a finds the engine idle (t - t_arrival = its intake); b reaches the server during a's
    first step and waits for it (no intake to see); c reaches it just as step 1 ends: the
    engine is idle again and c's 4 ms are its intake."""
    steps = [_step(0, 0.004, 0.1, "a"), _step(1, 0.1, 0.2, "a", "b"), _step(2, 0.214, 0.3, "c")]
    arrivals = [{"req_id": "a", "t": 0.004, "t_arrival": 0.0}, {"req_id": "b", "t": 0.1, "t_arrival": 0.05},
                {"req_id": "c", "t": 0.214, "t_arrival": 0.21}]
    assert intake_seconds(steps, arrivals) == pytest.approx([0.004, 0.004])
    assert intake_seconds([], arrivals[:1]) == pytest.approx([0.004])


def test_calibration_measures_the_intake_and_the_twin_hands_requests_over_that_late(tmp_path):
    """A server that takes 30 ms to hand each request to its (idle) engine: the calibrated
    model's client section says so, and the twin's TTFT, which counts from the server,
    includes it; the same model with intake 0 comes out 30 ms short."""
    from sim.twin.validate import client_stats, run_sim, workload_from_log

    report, _, _ = _rounds_on_a_drifting_host(tmp_path, "interleaved", lambda i: 1.1, intake=0.03)
    for entry in report["rounds"]:
        assert entry["client"]["intake_s"] == pytest.approx(0.03, abs=1e-6)
        assert abs(entry["errors"]["median_ttft"]) < 0.01 and abs(entry["errors"]["median_e2el"]) < 0.01
    model = json.loads((tmp_path / "light" / "calibrated.r0.json").read_text())
    path = tmp_path / "no-intake.json"
    path.write_text(json.dumps({**model, "client": {**model["client"], "intake_s": 0.0}}))
    (log,) = tmp_path.glob("runs/*-val-light-r0/real1.steps.jsonl")
    config, trace, engine = workload_from_log(log)
    stats = run_sim(config, trace, str(path), engine["first_visible"]).stats
    real = client_stats(json.loads(log.with_name("real1.bench.json").read_text()))
    assert real["median_ttft"] - stats["median_ttft"] == pytest.approx(0.03, abs=1e-6)
    with pytest.raises(ValueError, match="intake_s"):
        check_model({**model, "client": {**model["client"], "intake_s": -0.01}})


def test_disaggregated_replicas_wake_after_their_own_idle_gaps(tmp_path):
    """A prefill replica and a decode replica, requests far apart: the prefill replica's
    every prefill is its first step after idle (TTFT x1.3), and spans change nothing."""
    from sim.cluster.disagg import LINKS, DisaggConfig, DisaggFleet

    trace = _spaced_trace(5, 20.0)
    results = {}
    for name, wake, skipping in (("plain", None, True), ("wake", [1.3, 1.1], True), ("stepwise", [1.3, 1.1], False)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_model(wake)))
        cfg = SimConfig(model="SmolLM2-135M", hardware="cpu-2core", num_gpu_blocks=400, cost_model=str(path),
                        event_skipping=skipping)
        results[name] = DisaggFleet(DisaggConfig(cfg, 1, 1, next(iter(LINKS))), trace).run()
    assert results["wake"].records == results["stepwise"].records
    for a, b in zip(results["plain"].records, results["wake"].records):
        assert b.ttft == pytest.approx(1.3 * a.ttft, rel=1e-9)
