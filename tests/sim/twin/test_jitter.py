"""Step jitter in the twin: `sim calibrate` measures how served steps scatter around their
calibrated prediction within a run (core.cost.fit.fit_step_jitter), and `--jitter-seed`
draws that scatter per simulated step (core.cost.fit.StepJitter via core.cost.fitted)."""
from __future__ import annotations

import json
import math

import pytest

from core.cost.fit import ServedStep, StepJitter, check_model, fit_step_cost, fit_step_jitter
from sim.config import SimConfig
from sim.cluster.fleet import FleetConfig
from sim.run import simulate
from traces import load_trace, retime
from tests.conftest import ROOT
from tests.sim.twin.test_calibration import TRUE_EXECUTE, TRUE_OVERHEAD, synthetic_samples


def _lag1(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    d = [x - m for x in xs]
    return sum(a * b for a, b in zip(d, d[1:])) / sum(x * x for x in d)


def test_jitter_factors_average_one_correlate_as_asked_and_repeat_with_their_seed():
    for sigma, phi in ((0.3, 0.0), (0.3, 0.8), (0.05, 0.95)):
        draws = StepJitter(sigma, phi, seed=7)
        f = [draws.next() for _ in range(100_000)]
        assert sum(f) / len(f) == pytest.approx(1.0, abs=0.02 if phi > 0.9 else 0.01)   # mean 1: no bias
        logs = [math.log(x) for x in f]
        m = sum(logs) / len(logs)
        assert math.sqrt(sum((x - m) ** 2 for x in logs) / len(logs)) == pytest.approx(sigma, rel=0.05)
        assert _lag1(logs) == pytest.approx(phi, abs=0.03)
        again = StepJitter(sigma, phi, seed=7)
        assert [again.next() for _ in range(50)] == f[:50]
        other = StepJitter(sigma, phi, seed=8)
        assert [other.next() for _ in range(50)] != f[:50]
    still = StepJitter(0.0, 0.5, seed=1)
    assert {still.next() for _ in range(10)} == {1.0}


def _autocorrelation(xs: list[float], k: int) -> float:
    m = sum(xs) / len(xs)
    d = [x - m for x in xs]
    return sum(a * b for a, b in zip(d, d[k:])) / (len(d) - k) / (sum(x * x for x in d) / len(d))


def test_two_time_scales_keep_the_mean_and_the_slow_part_correlates_far():
    """Half the variance fast (lag-1 0.3), half slow (0.97): the factors average 1, their
    log has the total sd, and the correlation 16 steps apart is the slow half's 0.97^16,
    where one AR(1) with the same lag-1 correlation would have almost none."""
    draws = StepJitter(0.2, 0.3, 0.5, 0.97, seed=11)
    f = [draws.next() for _ in range(200_000)]
    assert sum(f) / len(f) == pytest.approx(1.0, abs=0.02)
    logs = [math.log(x) for x in f]
    m = sum(logs) / len(logs)
    assert math.sqrt(sum((x - m) ** 2 for x in logs) / len(logs)) == pytest.approx(0.2, rel=0.06)
    assert _autocorrelation(logs, 1) == pytest.approx(0.5 * 0.3 + 0.5 * 0.97, abs=0.04)
    assert _autocorrelation(logs, 16) == pytest.approx(0.5 * 0.97 ** 16, abs=0.05)
    one = StepJitter(0.2, 0.5 * 0.3 + 0.5 * 0.97, seed=11)
    assert _autocorrelation([math.log(one.next()) for _ in range(50_000)], 16) < 0.05


@pytest.mark.parametrize("phi,n", [(0.0, 5), (0.7, 12), (0.95, 30)])
def test_demeaned_covariances_are_exact(phi, n):
    """The correction for each run's mean being removed, against the exact covariance of
    the demeaned series (M S M with S_ij = phi^|i-j|, M = I - 11'/n), averaged per lag."""
    from core.cost.fit import demeaned_ar1_covariances

    cov = [[phi ** abs(i - j) for j in range(n)] for i in range(n)]
    row = [sum(r) / n for r in cov]
    total = sum(row) / n
    exact = [[cov[i][j] - row[i] - row[j] + total for j in range(n)] for i in range(n)]
    lags = min(4, n - 1)
    expected = [sum(exact[t][t + k] for t in range(n - k)) / (n - k) for k in range(lags + 1)]
    assert demeaned_ar1_covariances(phi, n, lags) == pytest.approx(expected, abs=1e-12)


def _runs(sigma: float, phi: float, offsets: list[float], n: int = 3000) -> list[list[ServedStep]]:
    """Calibration runs whose steps cost (served factor) x (the run's offset) x jitter
    times the grid prediction; decode steps of 1 and 8 sequences, prefills."""
    return _runs_of(StepJitter, (sigma, phi), offsets, n)


def _runs_of(jitter, params: tuple, offsets: list[float], n: int) -> list[list[ServedStep]]:
    factors = {"decode": 1.2, "prefill": 1.5, "decode:<=1": 1.1}
    runs = []
    for r, offset in enumerate(offsets):
        draws = jitter(*params, seed=r)
        rows = []
        for i in range(n):
            phase, seqs, tokens, pred = [("decode", 1, 1, 0.05), ("decode", 8, 8, 0.09), ("prefill", 1, 120, 0.3)][i % 3]
            f = factors.get(f"{phase}:<={seqs}", factors[phase])
            rows.append(ServedStep(phase, seqs, tokens, pred, pred * f * offset * draws.next()))
        runs.append(rows)
    return runs, factors


def _implied_correlation(fit: dict, k: int) -> float:
    return (1 - fit["slow_share"]) * fit["phi"] ** k + fit["slow_share"] * fit["slow_phi"] ** k


def test_the_fit_recovers_the_spread_and_correlation_within_runs_not_between_them():
    runs, factors = _runs(0.06, 0.9, [0.8, 1.0, 1.35])
    fit = fit_step_jitter(runs, factors)
    assert fit["sigma"] == pytest.approx(0.06, rel=0.1)      # the runs' offsets are not jitter
    for k in (1, 4, 16):                                     # one time scale: whatever the split, 0.9^k
        assert _implied_correlation(fit, k) == pytest.approx(0.9 ** k, abs=0.05)
    assert fit["n"] == 9000 and fit["runs"] == 3
    # a short run says nothing about correlation and is left out; no run at all: no jitter
    assert fit_step_jitter(runs + [runs[0][:5]], factors)["runs"] == 3
    assert fit_step_jitter([runs[0][:5]], factors) == {"sigma": 0.0, "phi": 0.0, "slow_share": 0.0, "slow_phi": 0.0,
                                                        "run_sigma": 0.0, "n": 0, "runs": 0}
    # anti-correlated residuals (alternating) are not a slow stretch: phi clips at 0
    alt = [[ServedStep("decode", 1, 1, 0.05, 0.05 * 1.2 * (1.1 if i % 2 else 0.9)) for i in range(100)]]
    assert fit_step_jitter(alt, {"decode": 1.2})["phi"] == 0.0


def test_the_fit_finds_a_slow_part_that_one_ar1_would_miss():
    """Steps drawn with 40% of their variance in slow stretches (lag-1 0.95) and the rest
    fast (0.4), in runs of 300 steps whose own means are removed: the fit recovers both
    scales and the whole variance (the removed means took part of the slow one's)."""
    runs, factors = _runs_of(StepJitter, (0.1, 0.4, 0.4, 0.95), [1.0, 0.9, 1.2, 1.1, 1.0, 0.95] * 3, n=300)
    fit = fit_step_jitter(runs, factors)
    assert fit["sigma"] == pytest.approx(0.1, rel=0.12)
    assert fit["slow_share"] == pytest.approx(0.4, abs=0.15)
    assert fit["slow_phi"] == pytest.approx(0.95, abs=0.03)
    assert fit["phi"] == pytest.approx(0.4, abs=0.15)
    for k, tol in ((1, 0.05), (4, 0.05), (16, 0.08)):      # (0.01 on slow_phi moves its 16th power by 0.07)
        assert _implied_correlation(fit, k) == pytest.approx(0.6 * 0.4 ** k + 0.4 * 0.95 ** k, abs=tol)


def test_the_fit_measures_how_much_whole_runs_differ():
    """run_sigma: the sd of the runs' mean log residuals (their host state), apart from the
    step jitter within them; one run gives none. (Reported by `sim calibrate`: how well any
    one run can be predicted at best.)"""
    import random
    rng = random.Random(5)
    offsets = [math.exp(rng.gauss(0.0, 0.08)) for _ in range(40)]
    runs, factors = _runs(0.05, 0.5, offsets, n=300)
    logs = [math.log(o) for o in offsets]
    mean = sum(logs) / len(logs)
    expected = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    fit = fit_step_jitter(runs, factors)
    assert fit["run_sigma"] == pytest.approx(expected, rel=0.1)
    assert fit["sigma"] == pytest.approx(0.05, rel=0.1)
    assert fit_step_jitter(runs[:1], factors)["run_sigma"] == 0.0


def _model(tmp_path, jitter: dict | None) -> str:
    model = fit_step_cost(synthetic_samples(TRUE_EXECUTE, TRUE_OVERHEAD))
    if jitter is not None:
        model["jitter"] = jitter
    path = tmp_path / ("jittered.json" if jitter else "plain.json")
    path.write_text(json.dumps(model))
    return str(path)


@pytest.fixture(scope="module")
def slice_():
    return retime(load_trace(ROOT / "traces" / "sharegpt.json"), rate=20.0, num_requests=60)


def _run(cost_model: str, trace, seed: int | None, **kw):
    cfg = SimConfig(model="SmolLM2-135M", hardware="cpu-2core", num_gpu_blocks=2000, cost_model=cost_model,
                    jitter_seed=seed, **kw)
    return simulate(cfg, trace)


def test_a_jittered_simulation_repeats_with_its_seed_and_keeps_the_mean_step_time(tmp_path, slice_):
    plain = _model(tmp_path, None)
    jittered = _model(tmp_path, {"sigma": 0.1, "phi": 0.9, "n": 100, "runs": 2})
    base = _run(plain, slice_, None)
    a, b, c = (_run(jittered, slice_, s) for s in (0, 0, 1))
    assert a.records == b.records                   # the same seed: the same run
    assert a.records != c.records and a.records != base.records
    assert a.num_steps == a.num_normal_steps        # drawn step by step: no skipped spans
    # each step keeps its mean time: the busy time per step stays within a few % of the plain run's
    busy = [sum(row[1] for row in r.timeseries if row[2]) / r.num_steps for r in (base, a, c)]
    assert busy[1] == pytest.approx(busy[0], rel=0.06) and busy[2] == pytest.approx(busy[0], rel=0.06)
    assert busy[1] != busy[0]
    # no spread: exactly the plain model's run (which skips spans)
    (tmp_path / "zero").mkdir()
    zero = _model(tmp_path / "zero", {"sigma": 0.0, "phi": 0.5, "n": 100, "runs": 2})
    assert _run(zero, slice_, 3).records == base.records


def test_jitter_needs_a_calibrated_model_and_a_single_engine(tmp_path, slice_):
    with pytest.raises(ValueError, match="add --cost-model"):
        _run(None, slice_, 0)
    with pytest.raises(ValueError, match="jitter section"):
        _run(_model(tmp_path, None), slice_, 0)
    for bad_section in ({"sigma": 0.1, "phi": 1.0}, {"sigma": 0.1, "phi": 0.5, "slow_share": 1.5, "slow_phi": 0.9},
                        {"sigma": 0.1, "phi": 0.5, "slow_share": 0.5, "slow_phi": 1.0}, [0.1, 0.5]):
        bad = _model(tmp_path, bad_section)
        with pytest.raises(ValueError, match="jitter"):
            check_model(json.loads(open(bad).read()))
    cfg = SimConfig(model="SmolLM2-135M", hardware="cpu-2core", jitter_seed=0,
                    cost_model=_model(tmp_path, {"sigma": 0.1, "phi": 0.5}))
    with pytest.raises(ValueError, match="fleets"):
        FleetConfig(cfg, 2).validate()
    # the CLI names the problem and exits 2
    from sim.cli import main
    assert main(["run", "traces/sharegpt.json", "--num-requests", "5", "--jitter-seed", "1", "--quiet",
                 "--out", str(tmp_path / "r")]) == 2


def test_validation_averages_jitter_draws_and_twin_spread_reads_them(tmp_path, slice_):
    from sim.twin.spread import session_errors
    from sim.twin.validate import first_requests_stats

    real = [(0.1 + 0.01 * i, 0.05 + 0.002 * (i % 5), 1.0 + 0.1 * i) for i in range(30)]
    draws = [[tuple(v * f for v in x) for x in real] for f in (1.1, 0.96)]
    report = {"rounds": [{"latencies": {"real": real, "sim": draws[0], "sim_draws": draws}}]}
    (err,) = session_errors(report, 30, 1)
    assert err["median_tpot"] == pytest.approx((0.1 - 0.04) / 2)       # the draws' mean, not the first draw
    del report["rounds"][0]["latencies"]["sim_draws"]
    assert session_errors(report, 30, 1)[0]["median_tpot"] == pytest.approx(0.1)
    assert first_requests_stats(draws[1], 30)["p90_e2el"] < first_requests_stats(draws[0], 30)["p90_e2el"]
