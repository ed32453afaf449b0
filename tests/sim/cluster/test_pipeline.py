"""Pipeline parallelism in the simulator (sim/cluster/pipeline_parallel.py): stage pricing, per-stage KV
capacity, the batch queue's overlap, conservation, and P = 1 left exactly as it was."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sim import SimConfig, resolve, simulate
from core.cost.model import BatchShape, RooflineCostModel, kv_cache_capacity_blocks
from sim.cluster.pipeline_parallel import PipelineSimEngine
from sim.cluster.pipeline_stages import (INTER_NODE_BANDWIDTH, PipelineCostModel, PipelineLayout, pipeline_kv_capacity_blocks,
                        stage_weight_bytes)
from sim.results import build_summary
from core.cost.specs import get_hardware, get_model
from traces import Trace, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[3]
SHAREGPT = ROOT / "traces" / "sharegpt.json"
LLAMA70 = dict(model="Llama-2-70B", hardware="A100-80G")


def trace_of(*shapes, gap: float = 0.0) -> Trace:
    """(prompt_len, output_len) per request, arriving `gap` seconds apart."""
    return Trace([TraceRequest(f"r{i}", i * gap, p, o) for i, (p, o) in enumerate(shapes)], "test")


@pytest.fixture(scope="module")
def sharegpt_200():
    return load_trace(SHAREGPT, num_requests=200, rate=8.0, seed=1)


def records_equal(a, b, rel=1e-12):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.request_id, x.status, x.num_output_tokens) == (y.request_id, y.status, y.num_output_tokens)
        for t, u in zip([x.first_token_time, x.finished_time, *x.token_times],
                        [y.first_token_time, y.finished_time, *y.token_times]):
            assert math.isclose(t, u, rel_tol=rel, abs_tol=1e-12), (x.request_id, t, u)


# -- pricing --------------------------------------------------------------------------------

def test_stages_split_the_work_of_the_whole_model():
    model, hw = get_model("Llama-2-70B"), get_hardware("A100-80G")
    layout = PipelineLayout.of(model, hw, tp=2, pp=4)
    pipe = PipelineCostModel(model, hw, layout)
    whole = RooflineCostModel(model, hw, 2)
    b = BatchShape.from_lists([1, 1, 300], [500, 900, 0])
    # FLOPs and streamed bytes add up over the stages (the embedding is gathered, not streamed).
    assert math.isclose(sum(s.flops(b) for s in pipe.stages), whole.flops(b), rel_tol=1e-12)
    assert math.isclose(sum(s.bytes_moved(b) for s in pipe.stages), whole.bytes_moved(b), rel_tol=1e-12)
    # Only the last stage computes the LM head; only the first pays the step overhead.
    heads = [s.flops(BatchShape.decode(1, 0)) - s.flops(BatchShape(1, 1, 0, 0)) for s in pipe.stages]
    assert heads[0] == heads[1] == heads[2] and heads[3] == heads[0]
    assert pipe.stages[-1]._flops_per_seq > 0 and pipe.stages[0]._flops_per_seq == 0
    assert [s.step_overhead_s for s in pipe.stages] == [whole.step_overhead_s, 0.0, 0.0, 0.0]
    # A batch's latency through the pipe: the stages plus three activation hops over NVLink.
    hop = 10e-6 + 2 * 8192 * 2 * b.num_new_tokens / hw.interconnect_bandwidth
    assert math.isclose(pipe.step_time(b), sum(pipe.stage_times(b)) + 3 * hop, rel_tol=1e-12)
    # More GPUs than one node: the stages talk over the network.
    assert PipelineLayout.of(model, hw, tp=8, pp=2).link_bandwidth == INTER_NODE_BANDWIDTH


def test_kv_capacity_is_the_minimum_over_stages():
    model, hw = get_model("Llama-2-13B"), get_hardware("A100-40G")
    even = PipelineLayout.of(model, hw, tp=1, pp=2)
    skew = PipelineLayout.of(model, hw, tp=1, pp=2, partition="30,10")
    blocks_even = pipeline_kv_capacity_blocks(model, hw, 16, 0.9, even, 2048)
    blocks_skew = pipeline_kv_capacity_blocks(model, hw, 16, 0.9, skew, 2048)
    one_gpu = kv_cache_capacity_blocks(model, hw, 16, 0.9, 1, max_num_batched_tokens=2048)
    # Two GPUs each holding half the weights and half the layers' KV: far more than 2x one GPU.
    assert blocks_even > 4 * one_gpu
    # The 30-layer stage bounds the skewed pipeline; restate its arithmetic independently.
    budget = hw.mem_bytes * 0.9
    weights = (30 * model.params_per_layer() + model.vocab_size * model.hidden_size) * 2
    act = 2048 * (2 * model.hidden_size + 3 * model.intermediate_size) * 2
    per_block = 2 * 30 * model.num_kv_heads * model.head_dim * 2 * 16
    assert blocks_skew == int((budget - weights - act) // per_block) < blocks_even
    assert stage_weight_bytes(model, 40, True, True, 1) == model.weight_bytes()
    assert math.isclose(sum(stage_weight_bytes(model, n, k == 0, k == 1, 1) for k, n in enumerate((20, 20))),
                        model.weight_bytes())


def test_stages_and_links_serve_one_batch_at_a_time():
    import simpy
    from core import SchedulerOutput
    from sim.cluster.pipeline_parallel import PipelineExecutor
    model, hw = get_model("Llama-2-7B"), get_hardware("A100-80G")
    # A slow link (0.1 GB/s), so that batches queue on it too.
    layout = PipelineLayout.of(model, hw, tp=1, pp=2, link_gbps=0.1)
    pipe = PipelineCostModel(model, hw, layout)
    env = simpy.Environment()
    ex = PipelineExecutor(pipe, 1, env)
    ex.execute_model = lambda out: None        # tokens are not the point here
    outs = []
    for _ in range(3):
        out = SchedulerOutput()
        out.num_batched_tokens = 2048
        outs.append(out)
    shape = BatchShape(1, 2048, 0, 2048 * 2049 // 2)
    s0, s1 = pipe.stage_times(shape)
    x = pipe.transfer_time(2048)
    assert x > s0 > 0                          # the link is the bottleneck here
    from unittest import mock
    with mock.patch("sim.cluster.pipeline_parallel.batch_shape", return_value=shape):
        for out in outs:
            out.scheduled = [object()]         # non-empty: priced as `shape`
            ex.execute_model_async(out)
    ends = []                                  # all submitted at t = 0
    for done in list(ex.done):
        env.run(until=done)
        ends.append(env.now)
    # batch i: leaves stage 0 at (i+1) s0; the link takes one at a time; then stage 1.
    link_end, stage1_end, want = 0.0, 0.0, []
    for i in range(3):
        link_end = max((i + 1) * s0, link_end) + x
        stage1_end = max(link_end, stage1_end) + s1
        want.append(stage1_end)
    assert [round(e, 12) for e in ends] == [round(w, 12) for w in want]
    assert ex.stage_busy == [3 * s0, 3 * s1] and ex.link_busy == [3 * x]


# -- the loop -------------------------------------------------------------------------------

def test_p1_runs_exactly_as_before(sharegpt_200):
    # --pp 1 takes the one-batch engine; the pipelined loop forced onto one stage agrees with
    # it step for step (up to float rounding of SimPy's clock).
    cfg = SimConfig(**LLAMA70, tensor_parallel_size=8, event_skipping=False)
    base = simulate(cfg, sharegpt_200)
    assert simulate(dataclasses.replace(cfg, pipeline_parallel_size=1), sharegpt_200).records == base.records
    piped = PipelineSimEngine(resolve(cfg), sharegpt_200).run()
    records_equal(piped.records, base.records)
    assert piped.num_steps == base.num_steps


def test_p2_conserves_requests_and_tokens_under_preemption(sharegpt_200):
    cfg = SimConfig(**LLAMA70, tensor_parallel_size=4, pipeline_parallel_size=2, num_gpu_blocks=400, max_num_seqs=32)
    result = simulate(cfg, sharegpt_200)
    assert result.num_preemptions > 0
    assert [r.request_id for r in result.records] == [r.request_id for r in sharegpt_200.requests]
    for rec, want in zip(result.records, result.requested_output_lens):
        assert rec.status == "length" and rec.num_output_tokens == want
        assert len(rec.token_times) == want or rec.num_preemptions    # one token per landed batch
    s = build_summary(result)
    assert s["completed"] == 200 and s["pipeline"]["gpus"] == 8 and s["pipeline"]["stage_layers"] == [40, 40]
    assert result.num_normal_steps == result.num_steps                   # no event skipping at P > 1
    assert simulate(cfg, sharegpt_200).records == result.records          # deterministic


def test_p_batches_in_flight_keep_every_stage_busy():
    # Compute-bound: 64 long prompts at once, one output token each, 2048-token batches.
    trace = trace_of(*[(2000, 1)] * 64)
    cfg = resolve(SimConfig(model="Llama-2-13B", hardware="A100-80G", tensor_parallel_size=1, pipeline_parallel_size=2, max_num_batched_tokens=2048))
    one = PipelineSimEngine(cfg, trace, max_batches_in_flight=1).run().pipeline
    full = PipelineSimEngine(cfg, trace).run().pipeline
    assert all(b < 0.55 for b in one["stage_busy"])              # every stage idles half the time
    assert all(0.9 < b <= 1 + 1e-12 for b in full["stage_busy"])   # (a stage runs one batch at a time)
    assert all(f > 1.8 * o for f, o in zip(full["stage_busy"], one["stage_busy"]))
    assert full["batches_in_flight_mean"] > 1.9 and one["batches_in_flight_mean"] <= 1.0


def test_ttft_of_a_lone_request_is_the_pipeline_latency():
    trace = trace_of((500, 3))
    resolved = resolve(SimConfig(**LLAMA70, tensor_parallel_size=4, pipeline_parallel_size=2))
    rec = simulate(resolved, trace).records[0]
    pipe = PipelineCostModel(resolved.model, resolved.hardware, PipelineLayout.of(resolved.model, resolved.hardware,
                                                                                4, 2))
    assert math.isclose(rec.ttft, pipe.step_time(BatchShape.prefill(500)), rel_tol=1e-12)
    # Its decodes cannot overlap each other: one token per trip through both stages.
    assert math.isclose(rec.token_times[1] - rec.token_times[0], pipe.step_time(BatchShape.decode(1, 500)),
                        rel_tol=1e-9)


def test_an_arrival_starts_a_batch_while_another_flies():
    # r1 comes while r0's prefill is on the first stage: with room in the pipeline it is
    # scheduled at once (it does not wait for r0's batch to land), and its own prefill then
    # follows r0's through the stages.
    trace = Trace([TraceRequest("r0", 0.0, 2000, 2), TraceRequest("r1", 0.001, 100, 2)], "test")
    resolved = resolve(SimConfig(**LLAMA70, tensor_parallel_size=4, pipeline_parallel_size=2))
    r0, r1 = simulate(resolved, trace).records
    assert r1.first_scheduled_time == 0.001
    assert r0.first_token_time < r1.first_token_time < r0.first_token_time + 0.5 * (r0.first_token_time - 0.0)


# -- the command line -----------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sim", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_pp_end_to_end_and_errors(tmp_path):
    proc = run_cli("run", "traces/sharegpt.json", "--num-requests", "40", "--model", "Llama-2-70B",
                   "--hardware", "A100-80G", "--tp", "2", "--pp", "4", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "8x (TP2 x PP4) A100-80G" in proc.stdout and "stages of 20/20/20/20 layers" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["pipeline_parallel_size"] == 4 and summary["pipeline"]["gpus"] == 8
    for args, msg in ((["--pp", "2", "--pp-layer-partition", "30,30"], "covers 60 layers"),
                      (["--pipeline-parallel-size", "3", "--pp-layer-partition", "40,40"], "has 2 stages"),
                      (["--pp", "0"], "must be >= 1"),
                      (["--pp", "2", "--replicas", "2"], "one pipelined replica"),
                      (["--pp", "2", "--cost-model", "x.json"], "drop --cost-model or --pipeline-parallel-size")):
        proc = run_cli("run", "traces/sharegpt.json", "--num-requests", "5", "--model", "Llama-2-70B",
                       "--hardware", "A100-80G", "--tp", "4", "--out", str(tmp_path / "bad"), *args)
        assert proc.returncode != 0 and msg in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_pp_vs_tp_figure_draws_every_layout(tmp_path, monkeypatch):
    from plots import figures
    drawn = []
    save = figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, out: (drawn.append(fig), save(fig, out))[1])
    rows = [{"layout": name, "rate": rate, "output_throughput": 100.0 * rate, "median_ttft": 0.05 * k,
             "p90_ttft": 0.1 * k, "median_tpot": 0.02 * k, "p90_tpot": 0.03 * k}
            for k, name in enumerate(("TP8", "TP4 x PP2", "PP8"), start=1) for rate in (2, 8)]
    path = figures.pp_vs_tp(rows, tmp_path / "f.png", title="t")
    assert path.stat().st_size > 10_000
    throughput, ttft, tpot = drawn[0].axes
    assert [line.get_label() for line in throughput.lines] == ["TP8", "TP4 x PP2", "PP8"]
    def data(ax):
        return [line for line in ax.lines if len(line.get_xdata())]
    assert len(data(ttft)) == len(data(tpot)) == 6                        # p50 and p90 per layout
    assert [round(v, 9) for v in tpot.lines[1].get_ydata()] == [30.0, 30.0]   # TP8 p90 TPOT in ms
    assert ttft.get_yscale() == "log" and "p90" in [t.get_text() for t in ttft.get_legend().get_texts()]
