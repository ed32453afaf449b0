"""A request reaching a served engine while a step runs lengthens that step: the server's
own work on the request (HTTP, JSON, tokenizing) shares the cores with it. The step log
tells which steps had arrivals (sim.twin.served_steps.step_rows), `sim calibrate` fits the
cost per arrival (core.cost.fit.fit_arrival_cost, the model's client.arrival_s), and the
simulator charges it to the step in flight (SimConfig.arrival_cost_s; sim validate and the
twin tables take it from the model)."""
from __future__ import annotations

import random

import pytest

from core.cost.fit import MIN_ARRIVAL_STEPS, ServedStep, fit_arrival_cost
from sim.config import SimConfig
from sim.run import simulate
from traces import Trace, TraceRequest


def _rows(cost: float, with_one: int = 40, seed: int = 0, wall_extra: float = 0.0) -> list[ServedStep]:
    """Decode steps priced 50 ms, served x1.1 with 3% noise; `with_one` of them had one
    arrival and took `cost` seconds more; wake and prefill steps with arrivals, far slower,
    which the fit must leave out."""
    rng = random.Random(seed)
    rows = []
    for i in range(300):
        arrivals = 1 if i < with_one else 0
        measured = 0.05 * 1.1 * rng.lognormvariate(0.0, 0.03) + cost * arrivals
        rows.append(ServedStep("decode", 4, 4, 0.05, measured, 5, arrivals))
    if wall_extra:                                          # CPU seconds grew less than wall seconds
        rows = [r._replace(wall=r.measured, measured=r.measured - wall_extra * r.arrivals) for r in rows]
    rows += [ServedStep("decode", 1, 1, 0.05, 0.2, 1, 1)] * 50          # first steps after idle
    rows += [ServedStep("prefill", 1, 80, 0.1, 0.4, 3, 1)] * 50         # prefills
    rows += [ServedStep("decode", 4, 4, 0.05, 0.5, 4, 2)] * 50          # two arrivals: not the fit's
    return rows


def test_the_fit_recovers_the_cost_of_one_arrival_from_decode_steps():
    fit = fit_arrival_cost(_rows(0.0017), {"decode": 1.0, "prefill": 1.0})
    assert fit["n"] == 40
    assert fit["arrival_s"] == pytest.approx(0.0017, abs=0.0006)
    # the served factor prices the steps: the excess is over the quiet steps' ratio, not the price
    assert fit_arrival_cost(_rows(0.0017), {"decode": 1.1, "prefill": 1.0})["arrival_s"] == \
        pytest.approx(fit["arrival_s"], rel=1e-9)
    # rows with wall seconds: the wall's excess, whatever the CPU seconds did
    assert fit_arrival_cost(_rows(0.0017, wall_extra=0.0012), {"decode": 1.0})["arrival_s"] == \
        pytest.approx(fit["arrival_s"], rel=1e-9)


def test_too_few_steps_with_an_arrival_or_a_cheaper_step_give_no_cost():
    assert fit_arrival_cost(_rows(0.0017, with_one=MIN_ARRIVAL_STEPS - 1), {"decode": 1.0}) == \
        {"arrival_s": 0.0, "n": MIN_ARRIVAL_STEPS - 1}
    assert fit_arrival_cost(_rows(-0.004), {"decode": 1.0})["arrival_s"] == 0.0
    assert fit_arrival_cost([], {})["arrival_s"] == 0.0


def test_step_rows_count_the_requests_that_reached_the_server_during_each_step():
    from core.cost.fit import StepCostEvaluator, fit_step_cost
    from sim.twin.served_steps import step_rows
    from tests.sim.twin.test_calibration import TRUE_EXECUTE, TRUE_OVERHEAD, synthetic_samples

    def step(i, t0, t1, *rids):
        return {"kind": "step", "step": i, "t_start": t0, "t_end": t1, "step_s": t1 - t0, "cpu_s": t1 - t0,
                "decision": {"batch": [[r, 0, 1, 1, 1] for r in rids], "preempted": []}}

    steps = [step(0, 0.0, 0.1, "a"), step(1, 0.1, 0.2, "a"), step(2, 0.2, 0.3, "a", "b"),
             {"kind": "step", "step": 3, "t_start": 0.3, "t_end": 0.31, "decision": {"batch": []}},
             step(4, 0.31, 0.4, "a", "b", "c", "d")]
    # a at idle (before step 0); b during step 1; c and d during step 2; e as step 4 starts
    arrivals = [{"req_id": r, "t": t + 0.001, "t_arrival": t}
                for r, t in (("a", -0.01), ("b", 0.15), ("c", 0.22), ("d", 0.29), ("e", 0.31))]
    grid = StepCostEvaluator(fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD)))
    rows = step_rows(steps, grid, "wall", arrivals=arrivals)
    assert [r.arrivals for r in rows] == [0, 1, 2, 1]
    assert [r.wall for r in rows] == pytest.approx([0.1, 0.1, 0.1, 0.09])
    assert [r.arrivals for r in step_rows(steps, grid, "wall")] == [0, 0, 0, 0]


def _trace(second_at: float) -> Trace:
    return Trace([TraceRequest("a", arrival_time=0.0, prompt_len=40, output_len=30),
                  TraceRequest("b", arrival_time=second_at, prompt_len=20, output_len=5)], source="two")


def _run(trace: Trace, cost: float, **kw):
    cfg = SimConfig(model="SmolLM2-135M", hardware="cpu-2core", num_gpu_blocks=400, arrival_cost_s=cost, **kw)
    return {r.request_id: r for r in simulate(cfg, trace).records}


def test_the_simulator_charges_an_arrival_to_the_step_in_flight():
    """b arrives in the middle of one of a's decode steps: that step, and so everything
    after it, ends `cost` later; a request that finds the engine idle costs nothing."""
    plain = _run(_trace(1000.0), 0.0)
    times = plain["a"].token_times
    mid = (times[10] + times[11]) / 2                      # inside a's 12th step
    base, charged = _run(_trace(mid), 0.0), _run(_trace(mid), 0.25)
    assert charged["a"].first_token_time == pytest.approx(base["a"].first_token_time, abs=1e-12)
    assert charged["a"].token_times[10] == pytest.approx(base["a"].token_times[10], abs=1e-12)
    for k in range(11, len(times)):
        assert charged["a"].token_times[k] == pytest.approx(base["a"].token_times[k] + 0.25, abs=1e-9)
    assert charged["b"].ttft == pytest.approx(base["b"].ttft + 0.25, abs=1e-9)
    assert charged["b"].finished_time == pytest.approx(base["b"].finished_time + 0.25, abs=1e-9)
    # b arriving after a finished finds the engine idle: nothing to charge
    late = _run(_trace(1000.0), 0.25)
    assert late["b"].ttft == pytest.approx(plain["b"].ttft, abs=1e-12)
    assert late["a"].finished_time == pytest.approx(plain["a"].finished_time, abs=1e-12)
    # step by step or with event skipping asked for: the same (the cost turns skipping off)
    assert _run(_trace(mid), 0.25, event_skipping=False)["b"].finished_time == \
        pytest.approx(charged["b"].finished_time, abs=1e-12)


def test_a_lengthened_step_takes_in_the_arrivals_its_extra_time_reaches():
    """b arrives mid-step and c just after that step would have ended: the 0.25 s b adds
    reaches c too, so that one step carries both charges."""
    plain = _run(_trace(1000.0), 0.0)
    times = plain["a"].token_times
    trace = Trace(_trace((times[10] + times[11]) / 2).requests +
                  [TraceRequest("c", arrival_time=times[11] + 0.01, prompt_len=20, output_len=5)], source="three")
    base, charged = _run(trace, 0.0), _run(trace, 0.25)
    assert charged["a"].token_times[11] == pytest.approx(base["a"].token_times[11] + 0.5, abs=1e-9)


def test_the_arrival_cost_is_checked():
    with pytest.raises(ValueError, match="arrival-cost-s must be"):
        _run(_trace(1.0), -0.1)
    with pytest.raises(ValueError, match="synchronous engine loop"):
        _run(_trace(1.0), 0.01, async_scheduling=True)


def test_validation_takes_the_cost_from_the_model_except_for_an_async_engine():
    from sim.twin.validate import sim_config_from_log
    from tests.sim.twin.test_calibration import DriftingHost

    config = dict(DriftingHost.CONFIG)
    assert sim_config_from_log(config, "cost.json", None, 0.002).arrival_cost_s == 0.002
    asynchronous = {**config, "scheduler": {**config["scheduler"], "async_scheduling": True}}
    assert sim_config_from_log(asynchronous, "cost.json", None, 0.002).arrival_cost_s == 0.0


def test_validation_simulates_the_logged_workload_with_the_models_arrival_cost(tmp_path):
    """run_sim on a model whose client section has arrival_s: a request arriving in the
    middle of another's decode ends that much later than with arrival_s 0."""
    import json

    from sim.twin.validate import run_sim
    from tests.sim.twin.test_calibration import DriftingHost
    from tests.sim.twin.test_wake import _model

    paths = {}
    for cost in (0.0, 0.25):
        paths[cost] = tmp_path / f"model-{cost}.json"
        paths[cost].write_text(json.dumps({**_model(None), "client": {"first_token_s": 0.0, "last_token_s": 0.0,
                                                                      "arrival_s": cost}}))
    config = dict(DriftingHost.CONFIG)
    (a,) = [r for r in run_sim(config, _trace(1000.0), str(paths[0.0])).result.records if r.request_id == "a"]
    trace = _trace((a.token_times[10] + a.token_times[11]) / 2)
    e2e = {cost: run_sim(config, trace, str(path)).e2e for cost, path in paths.items()}
    assert e2e[0.25]["b"] == pytest.approx(e2e[0.0]["b"] + 0.25, abs=1e-9)


def test_calibration_fits_the_arrival_cost_from_served_runs(tmp_path):
    """Served runs in which request a decodes alone for 120 steps of the profile's price x1.1
    while 20 others reach the server, each lengthening the step in flight by 2 ms of wall
    time and 0.5 ms of the stepping thread's CPU time (they are turned away before the
    engine sees them): `calibrate` puts the wall time's ~2 ms in client.arrival_s, as the
    simulated clock is wall time, and the report says so."""
    import json

    from core.cost.fit import StepCostEvaluator, fit_step_cost, shape_of
    from sim.twin.calibrate import calibrate, format_report
    from tests.sim.twin.test_calibration import DriftingHost, TRUE_EXECUTE, TRUE_OVERHEAD, synthetic_samples

    profile = fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))
    grid = StepCostEvaluator(profile)
    profile["profile"] = {"time_basis": "cpu"}          # steps priced in the stepping thread's CPU seconds
    rng = random.Random(1)
    runs = []
    for run in range(2):
        recs = [dict(DriftingHost.CONFIG), {"kind": "arrival", "req_id": "a", "step": 0, "t": 0.0, "t_arrival": 0.0,
                                            "prompt_token_ids": [7] * 20}]
        t, itls, first = 0.0, [], None
        for j in range(121):
            start, n = (0, 20) if j == 0 else (19 + j, 1)
            dt = grid.step_time(*shape_of([start], [n])) * 1.1 * rng.lognormvariate(0.0, 0.02)
            cpu = dt
            if j % 6 == 3 and j < 120:                        # someone reaches the server mid-step
                recs.append({"kind": "arrival", "req_id": f"x{j}", "step": len(recs), "t": t + dt / 2,
                             "t_arrival": t + dt / 2, "prompt_token_ids": [7] * 5})
                dt, cpu = dt + 0.002, cpu + 0.0005            # the stepping thread is off its core the rest
            recs.append({"kind": "step", "step": len(recs), "t_start": t, "t_end": t + dt, "step_s": dt,
                         "cpu_s": cpu, "decision": {"batch": [["a", start, n, 1, 4]], "preempted": []}})
            if j:
                itls.append(dt)
            t += dt
            first = first or t
        recs.append({"kind": "finish", "req_id": "a", "status": "length", "num_output_tokens": 121,
                     "first_text_token": 1})
        log = tmp_path / f"run{run}.steps.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in recs))
        runs.append((log, {"ttfts": [first], "itls": [itls], "input_lens": [20], "output_lens": [121],
                           "errors": [""]}))
    model = calibrate(profile, runs)
    assert model["client"]["arrival_n"] == 40
    assert model["client"]["arrival_s"] == pytest.approx(0.002, abs=0.0005)
    assert "arrival cost (median over 40 decode steps" in format_report(model)
