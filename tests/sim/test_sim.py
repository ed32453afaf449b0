"""The simulator driver: CLI end to end, determinism, event-skipping equivalence,
conservation, preemption and swap accounting, bad input. Kept small (seconds)."""
from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core import SchedulerOutput
from sim import SimConfig, SimEngine, SimExecutor, build_summary, resolve, simulate
from sim.cli import main as cli_main
from core.cost.model import BatchShape, RooflineCostModel, kv_block_bytes
from sim.executor import SIM_EOS_TOKEN_ID
from sim.results import REQUEST_COLUMNS
from core.cost.specs import get_hardware, get_model
from traces import load_trace, retime

ROOT = Path(__file__).resolve().parents[2]
SHAREGPT = ROOT / "traces" / "sharegpt.json"
MOONCAKE = ROOT / "traces" / "mooncake_conversation.jsonl.gz"
PY = sys.executable


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "sim", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def sharegpt():
    return load_trace(SHAREGPT)


# --- CLI end to end ----------------------------------------------------------------------

def test_cli_run_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("run", "traces/sharegpt.json", "--num-requests", "50", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout and "throughput" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == 50
    assert summary["completed"] + summary["rejected"] == 50
    for key in ("request_throughput", "output_throughput", "mean_ttft", "p99_ttft", "median_tpot",
                "p90_itl", "p99_e2el", "mean_normalized_latency", "kv_usage_mean", "kv_usage_max",
                "prefix_cache_hit_rate", "num_preemptions", "rejected", "config"):
        assert key in summary, key
    assert "wall" not in json.dumps(summary)
    assert summary["config"]["model"] == "Llama-2-13B" and summary["config"]["hardware"] == "A100-40G"
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 50 and tuple(rows[0]) == REQUEST_COLUMNS
    r = rows[0]
    assert math.isclose(float(r["prefill_e2e_time"]), float(r["prefill_completed_at"]) - float(r["arrived_at"]))
    assert int(r["request_num_decode_tokens"]) == int(r["num_output_tokens"])
    with open(out / "timeseries.csv") as f:
        ts = list(csv.DictReader(f))
    assert ts and {"time", "kv_usage", "running", "waiting", "swapped", "batch_tokens"} <= set(ts[0])


def test_determinism_byte_identical(tmp_path):
    """Same inputs -> byte-identical summary.json, across processes and within one."""
    args = ["run", "traces/sharegpt.json", "--num-requests", "120", "--rate", "8", "--quiet"]
    a = run_cli(*args, "--out", str(tmp_path / "a"))
    assert a.returncode == 0, a.stderr
    assert a.stderr == "" and "TTFT" in a.stdout                 # --quiet: no progress bar
    for name in ("b", "c"):                                         # in-process: other seq-id bases
        assert cli_main([*args[:1], str(SHAREGPT), *args[2:], "--out", str(tmp_path / name)]) == 0
    for name in ("b", "c"):
        for f in ("summary.json", "requests.csv", "timeseries.csv"):
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / name / f).read_bytes(), f


# --- event skipping ------------------------------------------------------------------------

def both_modes(config: SimConfig, trace):
    results = []
    for skipping in (True, False):
        c = SimConfig(**{**config.__dict__, "event_skipping": skipping})
        results.append(simulate(c, trace))
    return results


def assert_equivalent(skip, step):
    assert skip.num_normal_steps < step.num_normal_steps          # skipping really skipped
    assert skip.records == step.records                            # every RequestRecord field
    assert skip.time_weighted == step.time_weighted
    assert skip.kv_stats == step.kv_stats
    assert (skip.sim_time, skip.num_steps, skip.num_preemptions, skip.num_swaps, skip.swap_time) == \
           (step.sim_time, step.num_steps, step.num_preemptions, step.num_swaps, step.swap_time)
    s1, s2 = build_summary(skip), build_summary(step)
    s1["config"].pop("event_skipping"), s2["config"].pop("event_skipping")
    assert s1 == s2


def test_event_skipping_equivalence_sharegpt(sharegpt):
    """Default deployment (KV-bound at 4 req/s: preemptions) on a ShareGPT slice."""
    skip, step = both_modes(SimConfig(), retime(sharegpt, num_requests=400))
    assert step.num_preemptions > 0
    assert_equivalent(skip, step)


def test_event_skipping_equivalence_swap_and_fork(sharegpt):
    """Swap preemption, n=2 parallel sampling (forks, copy-on-write) and a tiny pool."""
    trace = retime(sharegpt, num_requests=150, rate=20.0)
    config = SimConfig(num_gpu_blocks=400, preemption_mode="swap", n=2, max_num_seqs=64)
    skip, step = both_modes(config, trace)
    assert step.num_swaps > 0 and step.swap_time > 0
    assert_equivalent(skip, step)


def test_event_skipping_equivalence_samples_finishing_apart(sharegpt):
    """n=2 under recompute preemption: a request's samples can reach max_tokens at
    different steps, so a span may end with one sample finishing and its sibling running
    on (spans run through finishes; the KV self-check must allow the freed blocks)."""
    trace = retime(sharegpt, num_requests=300, rate=20.0)
    config = SimConfig(num_gpu_blocks=600, preemption_mode="recompute", n=2, max_num_seqs=64)
    skip, step = both_modes(config, trace)
    assert step.num_preemptions > 0
    assert_equivalent(skip, step)


def test_event_skipping_equivalence_mooncake_prefix_sharing():
    """Shared-prefix Mooncake slice with prefix caching and a pool small enough to evict."""
    trace = retime(load_trace(MOONCAKE, limit=120), time_scale=0.5)
    config = SimConfig(model="Llama-3-8B", hardware="H100", enable_prefix_caching=True, num_gpu_blocks=3000)
    skip, step = both_modes(config, trace)
    assert step.kv_stats["prefix_cache_hits"] > 0 and step.kv_stats["num_evictions"] > 0
    assert_equivalent(skip, step)


def test_spans_go_on_past_finishes(sharegpt, monkeypatch):
    """Requests that finish while the others decode on, with nothing waiting: a span goes
    on past their finishes, in phases that are exactly the spans an engine stopping at
    every finish runs (same timeseries rows, records and integrals), in fewer spans; each
    phase's memory accounting is checked against the core (TWINSERVE_SIM_CHECK)."""
    import sim.engine
    monkeypatch.setattr(sim.engine, "CHECK_SPANS", True)
    trace = retime(sharegpt, num_requests=200, rate=3.0)
    resolved = resolve(SimConfig(model="Llama-3-8B", hardware="H100"))
    runs = []
    for past_finishes in (True, False):
        engine = SimEngine(resolved, trace)
        assert engine._past_finishes                     # paged, no prefix cache, n = 1
        engine._past_finishes = past_finishes
        spans = []
        span = engine._span
        engine._span = lambda: spans.append(1) or span()
        runs.append((engine.run(), len(spans)))
    (merged, merged_spans), (plain, plain_spans) = runs
    assert merged_spans < 0.8 * plain_spans
    assert merged.records == plain.records and merged.timeseries == plain.timeseries
    assert merged.time_weighted == plain.time_weighted and merged.memory_breakdown == plain.memory_breakdown
    assert_equivalent(merged, simulate(SimConfig(model="Llama-3-8B", hardware="H100", event_skipping=False), trace))


# --- conservation, preemption, swap ----------------------------------------------------------

def test_conservation_every_request_finished_or_rejected(sharegpt):
    trace = retime(sharegpt, num_requests=300, rate=30.0)
    resolved = resolve(SimConfig(num_gpu_blocks=300, max_model_len=512))   # long prompts are rejected
    engine = SimEngine(resolved, trace)
    result = engine.run()
    statuses = [r.status for r in result.records]
    assert len(statuses) == len(trace)
    assert set(statuses) <= {"length", "rejected"}
    assert 0 < statuses.count("rejected") < len(trace)
    assert [r.request_id for r in result.records] == [r.request_id for r in trace]
    for rec, tr, want in zip(result.records, trace, result.requested_output_lens):
        if rec.status == "length":
            assert rec.num_output_tokens == min(want, 512 - tr.prompt_len) and len(rec.token_times) >= 1
            assert rec.arrival_time <= rec.first_scheduled_time <= rec.first_token_time <= rec.finished_time
        else:
            assert rec.finished_time == rec.arrival_time and rec.num_output_tokens == 0
    sched = engine.scheduler
    assert not sched.requests and sched.kv.gpu.num_used == 0 and sched.kv.cpu.num_used == 0


def test_preemption_counted_with_tiny_pool(tmp_path, sharegpt):
    out = tmp_path / "tiny"
    assert cli_main(["run", str(SHAREGPT), "--num-requests", "80", "--rate", "50", "--num-gpu-blocks", "120",
                     "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "requests.csv") as f:
        restarts = sum(int(r["request_num_restarts"]) for r in csv.DictReader(f))
    assert summary["num_preemptions"] > 0 and restarts == summary["num_preemptions"]
    assert summary["num_swaps"] == 0 and summary["swap_time"] == 0
    assert summary["config"]["num_gpu_blocks"] == 120 and summary["config"]["max_model_len"] == 120 * 16


def test_swap_mode_charges_swap_time(sharegpt):
    trace = retime(sharegpt, num_requests=80, rate=50.0)
    swap = simulate(SimConfig(num_gpu_blocks=150, preemption_mode="swap"), trace)
    assert swap.num_swaps > 0 and swap.num_swapped_blocks > 0
    model, hw = get_model("Llama-2-13B"), get_hardware("A100-40G")
    cm = RooflineCostModel(model, hw)
    assert swap.swap_time >= cm.swap_time(swap.num_swapped_blocks, kv_block_bytes(model, 16)) * 0.999
    assert sum(r.num_swaps for r in swap.records) == swap.num_swaps


def test_executor_step_time_adds_swap_time():
    model, hw = get_model("Llama-2-13B"), get_hardware("A100-40G")
    cm = RooflineCostModel(model, hw)
    ex = SimExecutor(cm, kv_block_bytes(model, 16))
    out = SchedulerOutput(blocks_to_swap_out=[(1, 2), (3, 4)], blocks_to_swap_in=[(5, 6)])
    want = cm.swap_time(2, ex.block_bytes) + cm.swap_time(1, ex.block_bytes)
    assert ex.step_time(out) == want and ex.swap_seconds == want and ex.num_swapped_blocks == 3


def test_decode_step_times_bit_identical_to_step_time():
    for name, hwname, tp in (("Llama-2-13B", "A100-40G", 1), ("Llama-2-70B", "H100", 4), ("OPT-13B", "A100-80G", 2),
                             ("SmolLM2-135M", "cpu-2core", 1)):
        cm = RooflineCostModel(get_model(name), get_hardware(hwname), tp)
        for n, ctx in ((1, 0), (7, 1234), (256, 300_000), (64, 9)):
            times = cm.decode_step_times(n, ctx, 300)
            assert times == [cm.step_time(BatchShape.decode(n, ctx + j * n)) for j in range(300)]


def test_sampled_tokens_never_eos_and_beam_candidates_descending():
    ex = SimExecutor(RooflineCostModel(get_model("SmolLM2-135M"), get_hardware("A100-80G")), 1, seed=3)

    class FakeSeq:
        def __init__(self, seq_id):
            self.seq_id = seq_id

    for sid in (0, 1, 17, 40000):
        seq = FakeSeq(sid)
        ids = [ex.token_id(seq, p) for p in range(0, 70000, 7)]
        assert SIM_EOS_TOKEN_ID not in ids
        assert list(ex.token_ids(seq, 65000, 1000)) == [ex.token_id(seq, p) for p in range(65000, 66000)]
        toks, lps = ex.beam_candidates(seq, 12, 8)
        assert len(set(toks)) == 8 and SIM_EOS_TOKEN_ID not in toks
        assert all(a > b for a, b in zip(lps, lps[1:])) and lps[0] < 0
        assert (toks, lps) == ex.beam_candidates(seq, 12, 8)


def test_beam_search_and_parallel_sampling_run(sharegpt):
    trace = retime(sharegpt, num_requests=40, rate=10.0)
    for config in (SimConfig(beam_width=3, model="Llama-3-8B", hardware="H100"), SimConfig(n=3)):
        result = simulate(config, trace)
        assert all(r.status in ("length", "rejected") for r in result.records)
        done = [(r, want) for r, want in zip(result.records, result.requested_output_lens) if r.status == "length"]
        assert len(done) > 30 and all(r.num_output_tokens == want for r, want in done)


def test_sweep_writes_table(tmp_path):
    out = tmp_path / "sweep.csv"
    assert cli_main(["sweep", str(SHAREGPT), "--num-requests", "40", "--rates", "2,16",
                     "--policies", "queue=fcfs,queue=sjf+preemption=swap", "--out", str(out), "--quiet"]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["rate"], r["policy"]) for r in rows] == [
        ("2.0", "queue=fcfs"), ("2.0", "queue=sjf+preemption=swap"),
        ("16.0", "queue=fcfs"), ("16.0", "queue=sjf+preemption=swap")]
    assert all(int(r["completed"]) == 40 for r in rows)
    assert float(rows[2]["mean_ttft"]) >= float(rows[0]["mean_ttft"])


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--model", "GPT-9"], "unknown model"),
    (["--hardware", "TPU"], "unknown hardware"),
    (["--rate", "-1"], "--rate"),
    (["--queue-policy", "random"], "--queue-policy"),
    (["--queue", "random"], "--queue"),
    (["--num-requests", "0"], "--num-requests"),
    (["--watermark", "1"], "--watermark"),
    (["--tp", "3"], "tp=3"),
    (["--max-model-len", "100000"], "max-model-len"),
    (["--model", "Llama-2-70B", "--hardware", "A100-40G"], "weights"),
    (["--time-scale", "2", "--rate", "3"], "not both"),
])
def test_bad_flags_exit_2(args, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        code = cli_main(["run", str(SHAREGPT), "--out", str(tmp_path / "x"), "--quiet", *args])
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and needle in err and "Traceback" not in err


def test_old_flag_spellings_still_work_with_a_warning(capsys):
    from sim.cli import _config, build_parser
    parser = build_parser()
    new = _config(parser.parse_args(["run", "t.json", "--queue-policy", "lpm", "--preemption-mode", "swap",
                                     "--victim-policy", "least-computed", "--eviction-policy", "lfu",
                                     "--swap-space", "2", "--no-enable-chunked-prefill"]))
    assert capsys.readouterr().err == ""
    old = _config(parser.parse_args(["run", "t.json", "--queue", "lpm", "--preemption", "swap",
                                     "--victim", "least-computed", "--eviction", "lfu", "--swap-space-gib", "2",
                                     "--no-chunked-prefill"]))
    assert old == new
    assert (new.queue_policy, new.preemption_mode, new.swap_space, new.enable_chunked_prefill) == ("lpm", "swap", 2.0, False)
    err = capsys.readouterr().err
    for flag, replacement in (("--queue", "--queue-policy"), ("--swap-space-gib", "--swap-space"),
                              ("--no-chunked-prefill", "--no-enable-chunked-prefill")):
        assert f"{flag} is deprecated; use {replacement}" in err


def _help(main, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def test_help_lists_every_queue_policy_and_hides_old_spellings(capsys):
    from policies import REGISTRY
    for command in ("run", "sweep", "compare", "sharing"):
        text = _help(cli_main, [command], capsys)
        assert " | ".join(REGISTRY["queue"]) in text and "lpm" in text
        assert "--queue-policy" in text and "--queue " not in text and "--swap-space-gib" not in text
        assert "most sequences running at once" in text        # --max-num-seqs has a description


def test_sim_and_real_engine_share_flag_names(capsys):
    """The knobs both backends have are spelled the same on both command lines."""
    from realexec.cli import main as real_main
    real = _help(real_main, ["serve"], capsys)
    sim = _help(cli_main, ["run"], capsys)
    for flag in ("--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--num-gpu-blocks", "--gpu-memory-utilization", "--swap-space", "--enable-prefix-caching",
                 "--no-enable-chunked-prefill", "--watermark", "--queue-policy", "--preemption-mode",
                 "--victim-policy", "--eviction-policy", "--seed"):
        assert re.search(rf"{flag}\b(?!-)", real) and re.search(rf"{flag}\b(?!-)", sim), flag


def test_every_sim_config_field_is_a_flag():
    import dataclasses
    from sim.cli import _config, build_parser
    from sim.engine import SimConfig
    args = build_parser().parse_args(["run", "t.json"])
    assert _config(args) == SimConfig()                      # flags' defaults are the config's
    assert all(hasattr(args, f.name) for f in dataclasses.fields(SimConfig))


def test_bad_trace_exit_2_no_traceback(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "twinserve-trace", "version": 1, "requests": [{"id": "a", "arrival_time": 0,\n')
    proc = run_cli("run", str(broken), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    bad_csv = tmp_path / "t.csv"
    bad_csv.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,12,x\n")
    for path in (bad_csv, tmp_path / "missing.json"):
        code = cli_main(["run", str(path), "--out", str(tmp_path / "o"), "--quiet"])
        assert code == 2


def test_sim_never_imports_realexec():
    code = ("import sys, sim, sim.cli, sim.bench, sim.engine, sim.results; "
            "sys.exit(any(m == 'realexec' or m.startswith('realexec.') for m in sys.modules))")
    assert subprocess.run([PY, "-c", code], cwd=ROOT).returncode == 0
