"""Fleets (sim.cluster.fleet) and routers (policies.router): the routers obey their definitions,
a 1-replica fleet is the single engine, routing does not depend on event skipping, every
request is served exactly once."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from core import Request, SamplingParams
from policies import REGISTRY, make
from policies.router import PrefixAwareRouter
from sim import SimConfig, resolve, simulate
from sim.cluster.fleet import FleetConfig, fleet_summary, simulate_fleet
from traces import Trace, TraceRequest, load_trace, retime

ROOT = Path(__file__).resolve().parents[3]
SHAREGPT = ROOT / "traces" / "sharegpt.json"
SMALL = SimConfig(model="Llama-3-8B", hardware="H100", num_gpu_blocks=400, max_num_seqs=16)


# --- the routers, on made-up replica views ----------------------------------------------------

@dataclass
class View:
    outstanding: int
    kv_usage: float
    hit: int

    def cached_prefix_tokens(self, request) -> int:
        return self.hit


CHEAP = settings(max_examples=min(settings().max_examples, 500))
views = st.lists(st.builds(View, st.integers(0, 20), st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
                           st.sampled_from([0, 16, 32, 64])), min_size=1, max_size=6)
REQ = Request("r", [1, 2, 3], SamplingParams(max_tokens=1))


def test_routers_are_registered():
    assert set(REGISTRY["router"]) == {"round-robin", "least-requests", "least-kv", "prefix-aware"}


@CHEAP
@given(st.integers(1, 6), st.lists(st.integers(0, 20), min_size=1, max_size=30))
def test_round_robin_cycles_regardless_of_load(n, loads):
    router = make("router", "round-robin")
    picks = [router.choose(REQ, [View(load + j, 0.1 * j, 16 * j) for j in range(n)]) for load in loads]
    assert picks == [i % n for i in range(len(loads))]


@CHEAP
@given(views)
def test_least_requests_picks_the_first_least_loaded(vs):
    i = make("router", "least-requests").choose(REQ, vs)
    assert vs[i].outstanding == min(v.outstanding for v in vs)
    assert all(v.outstanding > vs[i].outstanding for v in vs[:i])


@CHEAP
@given(views)
def test_least_kv_picks_lowest_usage_then_fewest_requests(vs):
    i = make("router", "least-kv").choose(REQ, vs)
    best = min((v.kv_usage, v.outstanding) for v in vs)
    assert (vs[i].kv_usage, vs[i].outstanding) == best
    assert all((v.kv_usage, v.outstanding) > best for v in vs[:i])


@CHEAP
@given(views, st.integers(0, 10), st.sampled_from([1.0, 1.5, 3.0]))
def test_prefix_aware_prefers_the_longest_cached_prefix_under_its_load_guard(vs, abs_t, rel_t):
    router = PrefixAwareRouter(abs_threshold=abs_t, rel_threshold=rel_t)
    i = router.choose(REQ, vs)
    least = min(v.outstanding for v in vs)
    longest = max(v.hit for v in vs)
    holders = [v for v in vs if v.hit == longest]
    best = min(v.outstanding for v in holders)      # among the longest holders, the least loaded
    guard = best - least > abs_t and best > rel_t * least
    if longest == 0 or guard:
        assert vs[i].outstanding == least            # falls back to least-requests
    else:
        assert vs[i].hit == longest and vs[i].outstanding == best


# --- fleets --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharegpt():
    return retime(load_trace(SHAREGPT), rate=40.0, num_requests=150)


@pytest.mark.parametrize("skipping", [True, False])
@pytest.mark.parametrize("settings", [{}, {"enable_prefix_caching": True, "preemption_mode": "swap", "n": 2}])
def test_one_replica_fleet_is_the_single_engine(sharegpt, skipping, settings):
    config = replace(SMALL, event_skipping=skipping, **settings)
    single = simulate(resolve(config), sharegpt)
    for router in ("round-robin", "least-kv"):
        fleet = simulate_fleet(FleetConfig(config, 1, router), sharegpt)
        assert fleet.records == single.records
        rep = fleet.replicas[0]
        assert rep.time_weighted == single.time_weighted
        assert rep.memory_breakdown == single.memory_breakdown
        assert rep.timeseries == single.timeseries       # the same steps and spans, cut at the same points
        assert rep.num_preemptions == single.num_preemptions > 0 or not settings
        assert rep.sim_time == single.sim_time


def shared_prefix_trace(groups: list[int], gaps: list[float], prefix_blocks: int, out_len: int) -> Trace:
    """Request i belongs to conversation groups[i]: all of a group's prompts start with the
    same prefix_blocks * 16 token ids, then 8 ids of their own."""
    reqs, t = [], 0.0
    for i, (g, gap) in enumerate(zip(groups, gaps)):
        t += gap
        prompt = [1000 * (g + 1) + j for j in range(prefix_blocks * 16)] + [900_000 + 8 * i + j for j in range(8)]
        reqs.append(TraceRequest(f"r{i}", round(t, 6), len(prompt), out_len, prompt_token_ids=prompt))
    return Trace(reqs, "synthetic shared prefixes")


fleet_cases = st.tuples(
    st.integers(1, 3),                                             # replicas
    st.lists(st.integers(0, 3), min_size=4, max_size=24),          # conversation of each request
    st.floats(0.0, 0.2),                                           # mean gap
    st.sampled_from(list(REGISTRY["router"])),
)


@settings(max_examples=min(settings().max_examples, 300))   # each example is two simulations
@given(fleet_cases)
def test_fleet_serves_every_request_once_and_routing_ignores_event_skipping(case):
    n, groups, gap, router = case
    trace = shared_prefix_trace(groups, [gap * ((i * 7) % 3) for i in range(len(groups))], 4, 20)
    config = replace(SMALL, enable_prefix_caching=True)
    runs = [simulate_fleet(FleetConfig(replace(config, event_skipping=s), n, router), trace) for s in (True, False)]
    skip, step = runs
    assert skip.replica_of == step.replica_of
    assert skip.records == step.records
    counts = [0] * n
    for r in skip.replica_of:
        counts[r] += 1
    assert [len(rep.records) for rep in skip.replicas] == counts
    assert all(rec is not None and rec.status in ("length", "rejected") for rec in skip.records)
    assert sum(rec.status == "length" for rec in skip.records) == len(trace.requests)
    if router == "round-robin":
        assert skip.replica_of == [i % n for i in range(len(trace.requests))]
    if n == 1:                                   # equal arrival times included
        assert skip.records == simulate(resolve(config), trace).records


def test_prefix_aware_keeps_conversations_together_and_hits_more():
    groups = [i % 3 for i in range(40)]   # 3 conversations, 4 replicas: round-robin scatters them
    trace = shared_prefix_trace(groups, [0.05] * 40, 8, 30)
    config = replace(SMALL, enable_prefix_caching=True)
    results = {r: simulate_fleet(FleetConfig(config, 4, r), trace) for r in ("round-robin", "prefix-aware")}
    pa = results["prefix-aware"]
    # after its first request, every conversation stays on one replica (load is light)
    for g in range(3):
        assert len({pa.replica_of[i] for i in range(len(groups)) if groups[i] == g}) == 1
    hit = {r: fleet_summary(res)["prefix_cache_hit_rate"] for r, res in results.items()}
    assert hit["prefix-aware"] > hit["round-robin"]


def test_least_requests_sees_the_fleet_as_of_each_arrival():
    # 12 requests at once on 3 replicas: each takes 4 (outstanding counts as routed)
    trace = shared_prefix_trace([0] * 12, [0.0] * 12, 1, 50)
    res = simulate_fleet(FleetConfig(SMALL, 3, "least-requests"), trace)
    assert res.replica_of == [0, 1, 2] * 4


@pytest.mark.parametrize("n", [3, 8])
def test_least_requests_on_a_busy_trace_routes_alike_with_and_without_event_skipping(n):
    """Real lengths at a rate that keeps every replica busy: replicas not chosen at an
    arrival run spans past finishes until the next one, and the outstanding counts the
    router reads (kept between arrivals while nothing changes them) must be those of the
    step-by-step run at every arrival."""
    trace = retime(load_trace(SHAREGPT), rate=12.0 * n, num_requests=400)
    config = replace(SMALL, num_gpu_blocks=4000, max_num_seqs=64)
    skip, step = (simulate_fleet(FleetConfig(replace(config, event_skipping=s), n, "least-requests"), trace)
                  for s in (True, False))
    assert skip.replica_of == step.replica_of
    assert skip.records == step.records


def test_fleet_summary_has_per_replica_blocks(sharegpt):
    res = simulate_fleet(FleetConfig(SMALL, 2, "least-kv"), sharegpt)
    s = fleet_summary(res)
    assert len(s["replicas"]) == 2 and s["num_gpus"] == 2
    assert sum(r["num_requests"] for r in s["replicas"]) == s["num_requests"] == len(sharegpt.requests)
    assert s["config"]["router"] == "least-kv" and s["config"]["replicas"] == 2


def test_bad_fleet_settings_are_rejected():
    with pytest.raises(ValueError, match="replicas"):
        FleetConfig(SMALL, 0).validate()
    with pytest.raises(ValueError, match="unknown router"):
        FleetConfig(SMALL, 2, "random").validate()
    with pytest.raises(ValueError, match="prefix-caching"):
        FleetConfig(SMALL, 2, "prefix-aware").validate()


def test_cli_fleet_and_disaggregated_runs_write_fleet_results(tmp_path, capsys):
    import csv
    import json
    from sim.cli import main as cli_main
    common = ["run", str(SHAREGPT), "--model", "Llama-3-8B", "--hardware", "H100", "--num-requests", "60",
              "--rate", "20", "--quiet", "--slo-ttft", "1", "--slo-tpot", "0.1"]
    assert cli_main(common + ["--replicas", "3", "--router", "least-requests", "--out", str(tmp_path / "f")]) == 0
    s = json.loads((tmp_path / "f" / "summary.json").read_text())
    rows = list(csv.DictReader(open(tmp_path / "f" / "requests.csv")))
    assert len(rows) == 60 and {r["replica"] for r in rows} == {"0", "1", "2"}
    assert s["num_gpus"] == 3 and len(s["replicas"]) == 3 and 0 < s["goodput"] <= s["request_throughput"]
    assert cli_main(common + ["--disaggregate", "1:2", "--link", "pcie", "--out", str(tmp_path / "d")]) == 0
    s = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert s["config"]["disaggregate"] == "1:2" and s["disaggregation"]["link"] == "pcie" and s["num_gpus"] == 3
    assert "KV transfers" in capsys.readouterr().out
    for bad, msg in ((["--disaggregate", "2"], "P:D"), (["--replicas", "2", "--router", "prefix-aware"], "prefix"),
                     (["--slo-ttft", "1"], "goodput")):
        args = [a for a in common if a not in ("--slo-ttft", "--slo-tpot", "1", "0.1")] + bad
        assert cli_main(args + ["--out", str(tmp_path / "x")]) == 2
        assert msg in capsys.readouterr().err


# --- what the router sees: the sequential driver (Replica.advance_to) -----------------------------

class RecordingRouter:
    """Wraps a router; logs, per routed request, every replica as the router sees it:
    outstanding requests, and (for routers that read KV state) blocks in use."""

    def __init__(self, inner):
        self.inner, self.name, self.reads_kv = inner, inner.name, inner.reads_kv
        self.views: list[tuple] = []

    def choose(self, request, replicas):
        self.views.append(tuple((r.outstanding, r.scheduler.kv.gpu.num_used if self.reads_kv else None)
                                for r in replicas))
        return self.inner.choose(request, replicas)


def routed_views(config, n, router, trace):
    from sim.cluster.fleet import Fleet
    fleet = Fleet(FleetConfig(config, n, router), trace)
    fleet.router = RecordingRouter(fleet.router)
    return fleet.run(), fleet.router.views


def step_boundaries(result) -> list[float]:
    """A replica's step (and idle-gap) boundaries, from its timeseries rows."""
    out = []
    for row in result.timeseries:
        out += [row[0], row[0] + row[1]]
    return sorted(set(out))


@settings(max_examples=min(settings().max_examples, 200))
@given(st.integers(2, 3), st.lists(st.integers(0, 3), min_size=4, max_size=20), st.floats(0.0, 0.15),
       st.sampled_from(list(REGISTRY["router"])), st.integers(3, 40), st.booleans())
def test_routers_see_every_replica_at_its_first_step_boundary_at_or_after_the_arrival(n, groups, gap, router,
                                                                                        out_len, caching):
    """Event skipping must not change what the router sees at any arrival (outstanding
    requests, KV blocks in use), and a request enters its replica at that replica's first
    step boundary at or after its arrival (here nothing waits for memory or batch slots).
    Without a prefix cache, spans go on past finishes: those before the arrival count."""
    trace = shared_prefix_trace(groups, [gap * ((i * 5) % 4) for i in range(len(groups))], 2, out_len)
    config = replace(SMALL, enable_prefix_caching=caching or router == "prefix-aware", num_gpu_blocks=4000,
                     max_num_seqs=64)
    skip, skip_views = routed_views(replace(config, event_skipping=True), n, router, trace)
    step, step_views = routed_views(replace(config, event_skipping=False), n, router, trace)
    assert skip_views == step_views
    assert skip.replica_of == step.replica_of and skip.records == step.records
    for i, rec in enumerate(step.records):
        rep = step.replicas[step.replica_of[i]]
        # an idle gap's row ends at the delivery that ended it (up to rounding of start + length)
        first = min(b for b in step_boundaries(rep) if b >= rec.arrival_time - 1e-9)
        assert abs(rec.first_scheduled_time - max(first, rec.arrival_time)) < 1e-9


# Gaps around one step (~8 ms here): arrivals for other replicas land inside a replica's steps.
arrivals = st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.002, 0.006, 0.02, 0.06, 0.15])),
                    min_size=4, max_size=20)


@settings(max_examples=min(settings().max_examples, 150))
@given(st.integers(1, 3), arrivals, st.sampled_from(list(REGISTRY["router"])), st.booleans(), st.integers(3, 40))
def test_each_replica_is_the_single_engine_on_the_requests_routed_to_it(n, arrivals, router, skipping, out_len):
    """Between arrival instants a replica runs alone on its own clock: it must take exactly
    the steps and spans the single engine takes on the requests it was sent (at their
    times), so its records match; under routers that do not read KV state (no partial span
    commits) so do its timeseries rows, up to the idle gap a replica counts until the
    fleet's last arrival."""
    trace = shared_prefix_trace([g for g, _ in arrivals], [gap for _, gap in arrivals], 2, out_len)
    config = replace(SMALL, enable_prefix_caching=True, event_skipping=skipping, max_num_seqs=4)
    fleet = simulate_fleet(FleetConfig(config, n, router), trace)
    for k, rep in enumerate(fleet.replicas):
        idx = [i for i, r in enumerate(fleet.replica_of) if r == k]
        alone = simulate(resolve(config), Trace([trace.requests[i] for i in idx], trace.source))
        assert alone.records == [fleet.records[i] for i in idx]
        if not make("router", router).reads_kv:
            rows = rep.timeseries
            while rows and rows[-1][2] == 0 and len(rows) > len(alone.timeseries):
                rows = rows[:-1]                 # the idle gap until the fleet's last arrival
            assert rows == alone.timeseries


@pytest.mark.parametrize("skipping", [True, False])
def test_an_arrival_exactly_at_a_step_boundary_enters_at_that_boundary(skipping):
    """Arrivals at or before a replica's clock are routed (and taken) before it starts the
    step at its clock, as the single engine takes arrivals <= its clock."""
    config = replace(SMALL, event_skipping=skipping)
    first = TraceRequest("r0", 0.0, 40, 30, prompt_token_ids=list(range(1, 41)))
    boundary = simulate(resolve(config), Trace([first], "one")).records[0].token_times[3]  # a decode step's end
    reqs = [first, TraceRequest("r1", 0.0, 40, 30, prompt_token_ids=list(range(2, 42))),
            TraceRequest("r2", boundary, 40, 30, prompt_token_ids=list(range(3, 43)))]
    trace = Trace(reqs, "boundary")
    alone = simulate(resolve(config), Trace([reqs[0], reqs[2]], "r0 and r2"))
    assert alone.records[1].first_scheduled_time == boundary
    res = simulate_fleet(FleetConfig(config, 2, "round-robin"), trace)
    assert res.replica_of == [0, 1, 0]
    assert res.records[2].first_scheduled_time == boundary
    assert [res.records[0], res.records[2]] == alone.records


def test_runs_tune_the_garbage_collector_and_leave_it_as_they_found_it(sharegpt):
    """A fleet scales the young-generation threshold by its replica count and freezes the
    state that existed before the run (sim.engine.gc_tuned_for_run); afterwards, and after
    a run that fails, thresholds and the frozen set are back as they were."""
    import gc

    from sim.cluster.fleet import Fleet
    before = gc.get_threshold()
    fleet = Fleet(FleetConfig(SMALL, 3, "least-requests"), sharegpt)
    seen = []
    inner = fleet.router.choose
    fleet.router.choose = lambda req, reps: seen.append((gc.get_threshold(), gc.get_freeze_count())) or inner(req, reps)
    fleet.run()
    assert {t for t, _ in seen} == {(before[0] * 3, *before[1:])}
    assert all(frozen > 0 for _, frozen in seen)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0

    def boom(req, reps):
        raise RuntimeError("router failed")
    fleet = Fleet(FleetConfig(SMALL, 2, "least-requests"), sharegpt)
    fleet.router.choose = boom
    with pytest.raises(RuntimeError, match="router failed"):
        fleet.run()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


class CountingRouter:
    """Least-requests, logging per routed request each replica's outstanding count next to
    what its scheduler holds (running, waiting, swapped) and its inbox."""
    name, reads_kv = "least-requests", False

    def __init__(self):
        self.inner = make("router", "least-requests")
        self.seen: list[tuple] = []

    def choose(self, request, replicas):
        s = [r.scheduler for r in replicas]
        self.seen.append(tuple((r.outstanding, len(x.running), len(x.waiting), len(x.swapped), len(r.inbox))
                               for r, x in zip(replicas, s)))
        return self.inner.choose(request, replicas)


def test_outstanding_counts_waiting_and_swapped_requests_too():
    """A replica's outstanding requests are all it was sent and has not finished: running,
    waiting (for memory or a batch slot) and swapped out, plus any not yet taken in. Here
    replicas are short of KV blocks, so requests wait and are swapped out."""
    from sim.cluster.fleet import Fleet
    trace = shared_prefix_trace([i % 4 for i in range(48)], [0.0 if i % 6 else 0.1 for i in range(48)], 2, 120)
    config = replace(SMALL, num_gpu_blocks=60, max_num_seqs=8, preemption_mode="swap")
    counts = {}
    for skipping in (False, True):
        fleet = Fleet(FleetConfig(replace(config, event_skipping=skipping), 2, "least-requests"), trace)
        fleet.router = CountingRouter()
        fleet.run()
        assert len(fleet.router.seen) == 48
        counts[skipping] = [tuple(v[0] for v in views) for views in fleet.router.seen]
        if not skipping:      # step by step, the schedulers hold the state at the router's instant
            seen = [v for views in fleet.router.seen for v in views]
            for outstanding, running, waiting, swapped, inbox in seen:
                assert outstanding == running + waiting + swapped + inbox
            assert sum(1 for v in seen if v[2]) > 10 and sum(1 for v in seen if v[3]) > 5   # the case arises
    assert counts[True] == counts[False]          # event skipping leaves the counts alone
