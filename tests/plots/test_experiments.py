"""The PagedAttention experiments in the simulator (issue 5): allocation policies, memory
breakdown, sharing savings, workloads (shared prefix, multi-turn), `sim compare`, the
notebook. Orderings, not magic numbers. ~1 minute on 2 cores."""
from __future__ import annotations

import csv
import json
import math
import os

import pytest

from policies import REGISTRY
from sim import SimConfig, SimEngine, resolve, simulate
from sim.cli import main as cli_main
from sim.config import POLICY_FIELDS
from sim.explore.compare import parse_variant, run_grid, sharing_rows, sustainable_rate
from sim.memory import CATEGORIES
from sim.workloads import SYSTEM_PROMPT_BASE, ConversationTrace, apply_workload
from traces import load_trace, retime

from tests.conftest import ROOT

SHAREGPT = ROOT / "traces" / "sharegpt.json"
# The paper's Section 6.2 deployment: OPT-13B (2048-token context) on one A100-40G.
OPT = dict(model="OPT-13B", hardware="A100-40G")
ORDER = ("paged", "orca-oracle", "orca-pow2", "orca-max")


@pytest.fixture(scope="module")
def sharegpt():
    return load_trace(SHAREGPT)


def rel_close(a: float, b: float, tol: float = 1e-6) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-300)


# --- memory breakdown (the paper's Figure 2) -------------------------------------------------

@pytest.fixture(scope="module")
def breakdowns(sharegpt):
    """300 ShareGPT requests at 4 req/s: enough to fill the KV memory under every policy."""
    trace = retime(sharegpt, num_requests=300, rate=4.0)
    return {a: simulate(SimConfig(**OPT, allocation=a), trace) for a in ORDER}


def test_paged_keeps_token_states_and_orca_ordering(breakdowns):
    share = {a: r.memory_breakdown["shares"]["token_states"] for a, r in breakdowns.items()}
    for a, r in breakdowns.items():
        assert r.time_weighted["kv_usage_max"] > 0.9, f"{a}: the load must fill the KV memory"
        assert all(x.status == "length" for x in r.records)
    assert share["paged"] >= 0.90
    assert share["orca-max"] < 0.5 * share["paged"]
    assert share["paged"] > share["orca-oracle"] > share["orca-pow2"] > share["orca-max"]
    paged = breakdowns["paged"].memory_breakdown["shares"]
    assert paged["reserved"] == 0 and paged["external_frag"] == 0          # paging reserves nothing ahead
    assert breakdowns["orca-oracle"].memory_breakdown["shares"]["reserved"] > 0.2
    assert breakdowns["orca-max"].memory_breakdown["shares"]["internal_frag"] > 0.5
    assert max(r.memory_breakdown["shares"]["external_frag"] for r in breakdowns.values()) > 0


def test_breakdown_conserves_slots_and_lands_in_summary_and_timeseries(breakdowns, tmp_path):
    from sim import write_results
    for a, r in breakdowns.items():
        mb = r.memory_breakdown
        total = sum(mb["slot_seconds"].values())
        assert rel_close(total, mb["total_slots"] * r.sim_time, 1e-9), a     # every slot, all the time
        assert rel_close(sum(mb["shares"].values()), 1.0, 1e-12)
    summary = write_results(breakdowns["orca-pow2"], tmp_path)
    assert set(summary["memory_breakdown"]["shares"]) == set(CATEGORIES)
    assert json.loads((tmp_path / "summary.json").read_text())["memory_breakdown"] == summary["memory_breakdown"]
    with open(tmp_path / "timeseries.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(0 <= float(r[c]) <= 1 + 1e-9 for r in rows for c in CATEGORIES)
    # The rows' time-weighted token states reproduce the summary's slot-seconds.
    slots = summary["memory_breakdown"]["total_slots"]
    ts = sum(float(r["token_states"]) * float(r["duration"]) for r in rows) * slots
    assert rel_close(ts, summary["memory_breakdown"]["slot_seconds"]["token_states"], 1e-6)


# --- event skipping stays exact with the new measurements -----------------------------------

def _both(config: SimConfig, trace):
    out = []
    for skipping in (True, False):
        out.append(simulate(SimConfig(**{**config.__dict__, "event_skipping": skipping}), trace))
    return out


@pytest.mark.parametrize("case", ["orca-oracle", "orca-max", "paged-n2-swap", "prefix-341", "multi-turn-cache"])
def test_event_skipping_exact_with_memory_measurements(case, sharegpt):
    trace = retime(sharegpt, num_requests=150, rate=6.0)
    config = SimConfig(**OPT)
    if case.startswith("orca"):
        config.allocation = case
    elif case == "paged-n2-swap":
        config.n, config.preemption_mode, config.num_gpu_blocks = 2, "swap", 500
    elif case == "prefix-341":
        config.enable_prefix_caching = True
        trace = apply_workload(trace, shared_prefix_len=341)
    else:
        config.enable_prefix_caching = True
        trace = apply_workload(trace, multi_turn=True, max_model_len=2048, seed=3)
    skip, step = _both(config, trace)
    assert skip.num_normal_steps < step.num_normal_steps
    assert skip.records == step.records and skip.sim_time == step.sim_time
    for key in ("slot_seconds", "mean_slots", "shares"):
        for c, v in step.memory_breakdown[key].items():
            assert rel_close(skip.memory_breakdown[key][c], v), (key, c)
    for k, v in step.kv_sharing.items():
        assert rel_close(skip.kv_sharing[k], v), k
    # Same integers added in the same order: in fact bit-identical.
    assert skip.memory_breakdown == step.memory_breakdown and skip.kv_sharing == step.kv_sharing


# --- rate at a latency bound -------------------------------------------------------------------

def test_paged_sustains_a_higher_rate_than_orca_oracle(sharegpt):
    base = SimConfig(**OPT)
    variants = [(a, parse_variant(a)) for a in ("paged", "orca-oracle", "orca-max")]
    rows = run_grid(base, variants, [1.0, 2.0, 3.0, 4.0],
                    lambda rate: retime(sharegpt, num_requests=200, rate=rate))
    bound = 0.1                                     # s/token; unloaded ~0.025
    rate = {a: sustainable_rate(rows, a, bound) for a, _ in variants}
    assert rate["paged"] is not None and rate["orca-oracle"] is not None
    assert rate["paged"] > rate["orca-oracle"] > (rate["orca-max"] or 0)
    at4 = {r["policy"]: r for r in rows if r["rate"] == 4.0}
    assert at4["paged"]["request_throughput"] > at4["orca-oracle"]["request_throughput"]


def test_sustainable_rate_interpolates_and_stops_at_first_violation():
    rows = [{"policy": "p", "rate": r, "mean_normalized_latency": v}
            for r, v in ((1, 0.05), (2, 0.08), (3, 0.2), (4, 0.05))]
    assert math.isclose(sustainable_rate(rows, "p", 0.1), 2 + (0.1 - 0.08) / (0.2 - 0.08))
    assert sustainable_rate(rows, "p", 0.01) is None
    assert sustainable_rate(rows, "p", 1.0) == 4


# --- sharing ---------------------------------------------------------------------------------

def test_parallel_sampling_and_beam_search_use_less_memory_with_sharing(sharegpt):
    trace = retime(sharegpt, num_requests=40, rate=0.5)
    rows = sharing_rows(SimConfig(**OPT), trace, ns=[1, 2, 4], beam_widths=[2, 4])
    saving = {(r["workload"], r["width"]): r for r in rows}
    assert saving[("parallel sampling", 1)]["saving"] == 0          # nothing to share: physical == logical
    for key in [("parallel sampling", 2), ("parallel sampling", 4), ("beam search", 2), ("beam search", 4)]:
        r = saving[key]
        assert r["mean_physical_blocks"] < r["mean_logical_blocks"], key
        assert r["saving"] > 0, key
    assert saving[("parallel sampling", 4)]["saving"] > saving[("parallel sampling", 2)]["saving"]
    assert saving[("beam search", 4)]["saving"] > saving[("beam search", 2)]["saving"]
    assert saving[("beam search", 2)]["saving"] > saving[("parallel sampling", 2)]["saving"]


def test_without_sharing_orca_holds_more_blocks_than_paged_for_parallel_samples(sharegpt):
    """Cross-check of the counterfactual with real unshared allocation: orca-oracle gives
    each sample its own region (the prompt copied), so it holds more blocks than paged."""
    trace = retime(sharegpt, num_requests=30, rate=0.2)
    paged = simulate(SimConfig(**OPT, n=4), trace)
    oracle = simulate(SimConfig(**OPT, n=4, allocation="orca-oracle"), trace)
    assert paged.kv_sharing["saving"] > 0 and oracle.kv_sharing["saving"] <= 0
    assert paged.kv_sharing["physical_block_seconds"] < oracle.kv_sharing["physical_block_seconds"]


# --- shared prefix -----------------------------------------------------------------------------

def test_shared_prefix_token_ids_identical_across_requests(sharegpt):
    trace = apply_workload(retime(sharegpt, num_requests=20), shared_prefix_len=80)
    prompts = [list(r.prompt_token_ids) for r in trace]
    system = [SYSTEM_PROMPT_BASE + k for k in range(80)]
    assert all(p[:80] == system for p in prompts)
    assert len({p[80] for p in prompts}) == len(prompts)                  # the own part differs at once
    assert all(r.prompt_len == orig.prompt_len + 80 for r, orig in zip(trace, sharegpt.requests[:20]))
    assert "shared system prompt of 80 tokens" in trace.source


def test_prefix_caching_raises_throughput_on_shared_prefix_workload(sharegpt):
    trace = apply_workload(retime(sharegpt, num_requests=150, rate=5.0), shared_prefix_len=341)
    on = simulate(SimConfig(**OPT, enable_prefix_caching=True), trace)
    off = simulate(SimConfig(**OPT), trace)
    from sim import build_summary
    s_on, s_off = build_summary(on), build_summary(off)
    assert s_on["prefix_cache_hit_rate"] > 0.5 and s_off["prefix_cache_hit_rate"] == 0
    assert s_on["request_throughput"] > s_off["request_throughput"]
    assert s_on["mean_normalized_latency"] < s_off["mean_normalized_latency"]
    assert on.kv_sharing["saving"] > 0.1


# --- multi-turn --------------------------------------------------------------------------------

def test_multi_turn_prompts_carry_previous_turns_and_arrive_after_them(sharegpt):
    base = retime(sharegpt, num_requests=60, rate=4.0)
    trace = apply_workload(base, multi_turn=True, max_turns=4, seed=1, max_model_len=2048, think_time=0.5)
    assert isinstance(trace, ConversationTrace)
    assert trace.parents == apply_workload(base, multi_turn=True, max_turns=4, seed=1, max_model_len=2048).parents
    convs = trace.conversations()
    assert 60 / 4 <= len(convs) < 60 / 2 + 5 and max(map(len, convs)) <= 4
    engine = SimEngine(resolve(SimConfig(**OPT, enable_prefix_caching=True)), trace)
    made = {}                                   # trace index -> the request the engine built
    add = engine.scheduler.add_request

    def capture(request):
        made[request.user_data] = request
        return add(request)

    engine.scheduler.add_request = capture
    result = engine.run()
    followups = [i for i, p in enumerate(trace.parents) if p >= 0]
    assert followups
    for i in followups:
        p = trace.parents[i]
        parent, child = made[p], made[i]
        before = parent.finished_seqs[0].token_ids
        assert len(before) == parent.num_prompt_tokens + result.requested_output_lens[p]
        assert child.prompt_token_ids[:len(before)] == before                 # the ids the parent had
        assert len(child.prompt_token_ids) == len(before) + trace[i].prompt_len
        rec, prec = result.records[i], result.records[p]
        assert rec.arrival_time == max(trace[i].arrival_time, prec.finished_time + 0.5)
    assert sum(result.records[i].num_cached_prompt_tokens for i in followups) > 0
    assert result.kv_stats["prefix_cache_hit_rate"] > 0


# --- every policy, every flag -------------------------------------------------------------------

@pytest.mark.parametrize("kind,name", [(k, n) for k, names in REGISTRY.items() for n in names])
def test_every_registry_policy_runs_end_to_end(kind, name, tmp_path):
    args = ["run", str(SHAREGPT), "--num-requests", "40", "--rate", "8", "--quiet", "--out", str(tmp_path),
            "--model", "OPT-13B", "--num-gpu-blocks", "300", f"--{kind}", name]
    if kind in ("eviction", "queue", "router"):
        args += ["--enable-prefix-caching", "--shared-prefix-len", "80"]
    if kind == "preemption":
        args += ["--n", "2"]
    assert cli_main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"][POLICY_FIELDS.get(kind, kind)] == name
    assert summary["completed"] + summary["rejected"] == 40 and summary["completed"] > 30
    assert summary["memory_breakdown"]["shares"]["token_states"] > 0


def test_compare_cli_table_csv_and_plots(tmp_path, capsys):
    out, plots = tmp_path / "cmp.csv", tmp_path / "figs"
    policies = "paged,orca-oracle,orca-pow2,orca-max,allocation=orca-max,queue=sjf+preemption=swap,paged+prefix-caching"
    assert cli_main(["compare", str(SHAREGPT), "--model", "OPT-13B", "--num-requests", "60", "--rates", "1,4",
                     "--policies", policies, "--out", str(out), "--plot", str(plots), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "highest request rate" in text and "orca-pow2" in text
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["policy"] for r in rows[:7]] == policies.split(",") and len(rows) == 14
    for r in rows:
        for col in ("request_throughput", "mean_normalized_latency", "p99_normalized_latency", "mean_ttft",
                    "mean_tpot", "num_preemptions", "token_states_share", "reserved_share", "internal_frag_share",
                    "external_frag_share", "prefix_cache_hit_rate"):
            assert r[col] != "", col
    assert float(rows[-1]["prefix_cache_hit_rate"]) == 0       # ShareGPT prompts share nothing
    assert (plots / "latency_vs_rate.png").stat().st_size > 10_000
    assert (plots / "memory_breakdown.png").stat().st_size > 10_000


def test_sweep_accepts_allocation_and_bare_names(tmp_path):
    out = tmp_path / "sweep.csv"
    assert cli_main(["sweep", str(SHAREGPT), "--num-requests", "30", "--rates", "2", "--policies",
                     "orca-oracle,allocation=paged+sjf", "--out", str(out), "--quiet"]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["policy"] for r in rows] == ["orca-oracle", "allocation=paged+sjf"]
    assert float(rows[0]["reserved_share"]) > 0 and float(rows[1]["reserved_share"]) == 0


@pytest.mark.parametrize("args, needle", [
    (["--allocation", "orca-max", "--enable-prefix-caching"], "no prefix cache"),
    (["--allocation", "buddy"], "--allocation"),
    (["--max-turns", "3"], "--multi-turn"),
])
def test_bad_workload_and_allocation_flags_exit_2(args, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(cli_main(["run", str(SHAREGPT), "--out", str(tmp_path), "--quiet", *args]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_compare_rejects_unknown_and_impossible_policies(tmp_path, capsys):
    for policies, needle in (("paged,orca-maxx", "unknown policy"), ("orca-max+prefix-caching", "no prefix cache"),
                             ("queue=sjf+queue=fcfs", "twice")):
        code = cli_main(["compare", str(SHAREGPT), "--rates", "1", "--policies", policies, "--out",
                         str(tmp_path / "x.csv"), "--quiet"])
        assert code == 2 and needle in capsys.readouterr().err


# --- the notebook ----------------------------------------------------------------------------

def test_notebook_executes_at_small_scale_and_writes_figures(tmp_path, monkeypatch):
    """Figures go next to the results (results/notebook/<scale>/figures by default), never
    over the committed plots/figures/ unless TWINSERVE_NB_OUT asks."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from plots.experiments import FIGURES
    results = tmp_path / "results"
    figs = results / "figures"
    committed = {p.name: p.stat().st_mtime_ns for p in (ROOT / "plots" / "figures").glob("*.png")}
    monkeypatch.setenv("TWINSERVE_NB_SCALE", "small")
    monkeypatch.delenv("TWINSERVE_NB_OUT", raising=False)
    monkeypatch.setenv("TWINSERVE_NB_RESULTS", str(results))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(ROOT / "plots" / "policy_comparison.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "plots")}})
    client.execute()
    for name in (f for names in FIGURES.values() for f in names):
        assert (figs / name).stat().st_size > 10_000, name
    images = sum(1 for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
                 if "image/png" in o.get("data", {}))
    assert images == sum(map(len, FIGURES.values()))
    assert committed == {p.name: p.stat().st_mtime_ns for p in (ROOT / "plots" / "figures").glob("*.png")}
