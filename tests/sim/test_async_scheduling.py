"""`sim run --async-scheduling`: the host's per-step work overlaps the device's."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from core.cost.fit import fit_step_cost
from core.cost.fitted import FittedCostModel
from core.cost.model import BatchShape, RooflineCostModel
from sim import SimConfig, resolve, simulate
from sim.async_scheduling import AsyncSchedulingExecutor, AsyncSimEngine
from sim.results import build_summary
from traces import Trace, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(model="SmolLM2-135M", hardware="H100")       # host overhead large against its steps


@pytest.fixture(scope="module")
def sharegpt_200():
    return load_trace(ROOT / "traces" / "sharegpt.json", num_requests=200, rate=8.0, seed=1)


def test_a_lone_decode_runs_at_the_pace_of_the_slower_of_host_and_device():
    trace = Trace([TraceRequest("r0", 0.0, 100, 40)], "test")
    resolved = resolve(SimConfig(**SMALL, async_scheduling=True))
    engine = AsyncSimEngine(resolved, trace)
    rec = engine.run().records[0]
    cost = engine.executor.cost_model
    shape = BatchShape.decode(1, 130)
    host, total = cost.host_time(shape), cost.step_time(shape)
    assert 0 < host < total
    gaps = [b - a for a, b in zip(rec.token_times[20:], rec.token_times[21:])]
    # Steady state: a step lands every max(host, device), not every host + device.
    assert all(math.isclose(g, max(host, total - host), rel_tol=0.02) for g in gaps), (gaps[:3], host, total)
    sync = simulate(SimConfig(**SMALL), trace).records[0]
    sync_gaps = [b - a for a, b in zip(sync.token_times[20:], sync.token_times[21:])]
    assert all(math.isclose(g, total, rel_tol=0.02) for g in sync_gaps)


def test_same_requests_and_tokens_higher_throughput_under_preemption(sharegpt_200):
    kw = dict(**SMALL, num_gpu_blocks=300, max_num_seqs=32)
    sync, overlapped = simulate(SimConfig(**kw), sharegpt_200), simulate(SimConfig(**kw, async_scheduling=True),
                                                                         sharegpt_200)
    assert overlapped.num_preemptions > 0
    assert [(r.request_id, r.status, r.num_output_tokens) for r in overlapped.records] == \
        [(r.request_id, r.status, r.num_output_tokens) for r in sync.records]
    s, a = build_summary(sync), build_summary(overlapped)
    assert a["completed"] == 200 and a["output_throughput"] > s["output_throughput"]
    assert a["median_tpot"] < s["median_tpot"]
    overlap = a["async_scheduling"]
    assert overlap["batches_in_flight_mean"] > 1.0 and 0 < overlap["host_busy"] <= 1 and 0 < overlap["device_busy"] <= 1
    assert overlapped.num_normal_steps == overlapped.num_steps                # no event skipping
    assert simulate(SimConfig(**kw, async_scheduling=True), sharegpt_200).records == overlapped.records


def test_host_and_device_serve_one_step_at_a_time():
    resolved = resolve(SimConfig(**SMALL, async_scheduling=True))
    engine = AsyncSimEngine(resolved, Trace([TraceRequest("r0", 0.0, 10, 2)], "test"))
    ex = engine.executor
    assert isinstance(ex, AsyncSchedulingExecutor)

    class Step:                                  # a stand-in SchedulerOutput of one prefill
        scheduled = [type("S", (), {"num_tokens": 64, "start": 0})()]
        num_batched_tokens = num_prefill_tokens = 64
        blocks_to_swap_out = blocks_to_swap_in = blocks_to_copy = []

    host, device = ex.split(Step())
    ex.execute_model = lambda out: None          # (tokens are not the point here)
    for _ in range(3):
        ex.execute_model_async(Step())
    # Three steps at t=0: the host prepares them back to back, the device runs each after
    # its host part and the device's previous step (here the host is the slower one).
    assert host > device > 0
    assert math.isclose(ex.host_free, 3 * host) and math.isclose(ex.device_free, 3 * host + device)
    assert math.isclose(ex.host_busy, 3 * host) and math.isclose(ex.device_busy, 3 * device)


def test_fitted_profiles_price_their_overhead_part_as_host_time():
    # A fit of steps whose engine overhead is 0.4 ms + 30 us per sequence.
    samples = [{"seqs": s, "tokens": t, "context": c, "pairs": c + t,
                "execute_s": 1e-3 + 1e-4 * t + 1e-8 * (c + t), "overhead_s": 4e-4 + 3e-5 * s}
               for s, t, c in [(1, 64, 0), (1, 256, 0), (2, 512, 0), (4, 1024, 0), (1, 1, 100), (4, 4, 800),
                               (8, 8, 3000), (16, 16, 9000), (2, 128, 0), (8, 8, 400)] * 2]
    resolved = resolve(SimConfig())
    model = FittedCostModel(fit_step_cost(samples, k=2), RooflineCostModel(resolved.model, resolved.hardware))
    shape = BatchShape.decode(8, 800)
    assert math.isclose(model.host_time(shape), 4e-4 + 3e-5 * 8, rel_tol=1e-3)
    assert model.host_time(shape) < model.step_time(shape)
    assert model.host_time(BatchShape.decode(0, 0)) == 0.0


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sim", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_end_to_end_and_errors(tmp_path):
    proc = run_cli("run", "traces/sharegpt.json", "--num-requests", "40", "--async-scheduling", "--out", str(tmp_path),
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "async        host busy" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["async_scheduling"] is True and summary["async_scheduling"]["device_busy"] > 0
    for args, msg in ((["--replicas", "2"], "simulates one replica"),
                      (["--pp", "2", "--model", "Llama-2-70B", "--hardware", "A100-80G", "--tp", "4"],
                       "async scheduling overlaps the steps of one pipeline stage")):
        proc = run_cli("run", "traces/sharegpt.json", "--num-requests", "5", "--async-scheduling",
                       "--out", str(tmp_path / "bad"), *args)
        assert proc.returncode != 0 and msg in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
