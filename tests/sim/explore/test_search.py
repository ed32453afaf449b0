"""Config search (sim.explore.search) and Ray fan-out (sim.explore.points): search accepts a
configuration known to meet the SLOs and rejects one known not to; Ray runs give the
serial results in the serial order; progress bars in both modes. One local Ray
runtime for the module."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from sim import SimConfig, resolve, simulate
from sim.cli import main as cli_main
from sim.explore.points import run_points
from sim.explore.search import SearchPoint, SearchSpec, enumerate_points, pareto, probe, ranked, search
from traces import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[3]
SHAREGPT = ROOT / "traces" / "sharegpt.json"
BASE = SimConfig(model="Llama-3-8B", hardware="H100")


def fixed_trace(n: int = 60, prompt: int = 256, out: int = 64) -> Trace:
    return Trace([TraceRequest(f"r{i}", 0.0, prompt, out) for i in range(n)], "synthetic fixed lengths")


def decode_step(tp: int) -> float:
    """The modelled time of one decode step of a lone sequence at this TP degree."""
    one = Trace([TraceRequest("x", 0.0, 256, 64)], "one")
    rec = simulate(resolve(SimConfig(model="Llama-3-8B", hardware="H100", tensor_parallel_size=tp)), one).records[0]
    return rec.tpot


@pytest.fixture(scope="module")
def tpot_slo():
    # between the TP2 and the TP1 decode step: TP1 can never meet it, TP2 can at low load
    t1, t2 = decode_step(1), decode_step(2)
    assert t2 < t1
    return (t1 + t2) / 2


def spec(tpot_slo: float, **kw) -> SearchSpec:
    settings = dict(qps=2.0, slo_ttft_p90=0.5, slo_tpot_p90=tpot_slo, max_gpus=2, tp_degrees=(1, 2),
                    max_num_seqs=(64,), chunks=(2048,), num_requests=40, iterations=3)
    settings.update(kw)
    return SearchSpec(BASE, **settings)


def test_search_accepts_the_feasible_and_rejects_the_infeasible(tpot_slo):
    s = spec(tpot_slo)
    rows, skipped = search(s, fixed_trace(), progress=False)
    assert not skipped
    by_label = {r["label"]: r for r in rows}
    assert set(by_label) == {"1x TP1 seqs64 chunk2048", "2x TP1 seqs64 chunk2048", "1x TP2 seqs64 chunk2048"}
    for r in rows:
        assert r["feasible"] == (r["tp"] == 2), r
    tp2 = by_label["1x TP2 seqs64 chunk2048"]
    assert ranked(rows) == [tp2]
    assert tp2["capacity_qps"] >= s.qps and tp2["p90_tpot_at_qps"] <= tpot_slo
    assert by_label["2x TP1 seqs64 chunk2048"]["capacity_qps"] == 0.0
    # the reported capacity meets the SLOs; a little more load (the search's precision) does not
    cap = tp2["capacity_qps"]
    point = SearchPoint(2, 1, 64, 2048)
    assert probe(s, point, fixed_trace(), cap)[0]
    top = s.qps * s.max_factor
    if cap < top:
        step = (top - s.qps) / 2 ** s.iterations
        assert not probe(s, point, fixed_trace(), cap + step)[0]


def test_search_points_respect_the_gpu_budget_and_splits():
    s = SearchSpec(BASE, qps=1, slo_ttft_p90=1, slo_tpot_p90=1, max_gpus=4, tp_degrees=(1, 2, 8),
                   max_num_seqs=(64,), chunks=(512,), disaggregate=True)
    points, skipped = enumerate_points(s)
    assert all(p.gpus <= 4 for p in points)
    assert {(p.tp, p.replicas, p.prefill) for p in points} == {
        (1, r, p) for r in range(1, 5) for p in range(r)} | {(2, 1, 0), (2, 2, 0), (2, 2, 1)}
    assert not skipped                              # TP8 is simply over the budget
    rows = [{"gpus": g, "capacity_qps": c, "label": str(i)} for i, (g, c) in enumerate([(1, 2), (2, 1), (2, 5), (4, 4)])]
    assert [r["label"] for r in pareto(rows)] == ["0", "2"]


def test_search_cli_prints_ranking_and_writes_csv_and_figure(tmp_path, tpot_slo, capsys):
    trace = tmp_path / "t.json"
    from traces import save_trace
    save_trace(fixed_trace(), trace)
    out, fig = tmp_path / "s.csv", tmp_path / "pareto.png"
    assert cli_main(["search", str(trace), "--model", "Llama-3-8B", "--hardware", "H100",     # BASE's deployment
                     "--qps", "2", "--slo-ttft-p90", "0.5", "--slo-tpot-p90", str(tpot_slo), "--max-gpus", "2", "--tp-degrees", "1,2", "--max-num-seqs", "64", "--chunk-sizes", "2048",
                     "--num-requests", "40", "--iterations", "2", "--out", str(out), "--plot", str(fig),
                     "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "1 of 3 configurations meet" in text and "1x TP2 seqs64 chunk2048" in text
    assert len(list(csv.DictReader(open(out)))) == 3 and fig.stat().st_size > 0
    assert cli_main(["search", str(trace), "--qps", "-1", "--slo-ttft-p90", "1", "--slo-tpot-p90", "1",
                     "--max-gpus", "1"]) == 2
    assert "error: --qps" in capsys.readouterr().err


# --- Ray ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_runtime():
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray
    ray.shutdown()


def square_after(delay: float, x: int) -> int:
    import time
    time.sleep(delay)
    return x * x


@pytest.mark.timeout(300)
def test_ray_results_are_the_serial_results_in_order(ray_runtime, capsys):
    # later points finish first: the order must still be the arguments' order
    points = [(0.3 - 0.1 * i, i) for i in range(3)]
    assert run_points(square_after, points, use_ray=True, desc="t") == [0, 1, 4]
    assert ray_runtime.is_initialized()              # a runtime it did not start is left running
    assert run_points(square_after, points, use_ray=False, desc="t") == [0, 1, 4]
    err = capsys.readouterr().err
    assert "t (ray): 100%" in err and "3/3" in err and "t: 100%" in err


@pytest.mark.timeout(300)
def test_ray_sweep_equals_serial_sweep(ray_runtime, tmp_path, tpot_slo):
    common = ["sweep", str(SHAREGPT), "--model", "Llama-3-8B", "--hardware", "H100", "--num-requests", "80",
              "--rates", "4,16", "--policies", "queue=fcfs,queue=sjf+preemption=swap", "--num-gpu-blocks", "300",
              "--quiet"]
    assert cli_main(common + ["--out", str(tmp_path / "serial.csv")]) == 0
    assert cli_main(common + ["--out", str(tmp_path / "ray.csv"), "--ray"]) == 0
    serial, parallel = (tmp_path / "serial.csv").read_text(), (tmp_path / "ray.csv").read_text()
    assert serial == parallel and serial.count("\n") == 5
    s = spec(tpot_slo, iterations=1)
    assert search(s, fixed_trace(), use_ray=True, progress=False)[0] == search(s, fixed_trace(), progress=False)[0]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_probe_with_rejected_requests_fails_even_when_the_rest_meet_the_slos(tpot_slo, replicas):
    """Rejected requests have no TTFT or TPOT, so the p90s of the others can meet the SLOs
    while the deployment turns requests away: such a probe must fail."""
    s = spec(tpot_slo)
    good = fixed_trace(40)
    # three prompts longer than Llama-3-8B's context: the scheduler rejects them
    bad = Trace(good.requests[:37] + [TraceRequest(f"long{i}", 0.0, 9000, 64) for i in range(3)], "3 too long")
    point = SearchPoint(2, replicas, 64, 2048)
    ok, ttft, tpot = probe(s, point, good, 1.0)
    assert ok
    ok, ttft, tpot = probe(s, point, bad, 1.0)
    assert ttft <= s.slo_ttft_p90 and tpot <= s.slo_tpot_p90        # the served ones meet the SLOs
    assert not ok
