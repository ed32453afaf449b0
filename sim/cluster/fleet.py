"""A fleet: N replicas of the same core on one clock, and a router in front.

    result = simulate_fleet(FleetConfig(SimConfig(...), replicas=4, router="least-kv"), trace)

Every replica is a full `SimEngine` (its own Scheduler, KV cache, prefix cache, executor,
metrics); nothing is shared between replicas but the clock. The fleet walks the trace
and, at each arrival instant, asks the router policy (`policies.router`) which replica
takes the request.

What a router sees. At arrival time a, each replica is shown as it will be at its first
step boundary at or after a (the state the request would meet there): a replica applies
a normal step's results when the step starts (its end time is known then), and a replica
in the middle of a skipped decode span commits the span's steps that start before a
before the router reads its KV state (`Router.reads_kv`). Requests with equal arrival
times are all routed before any replica starts a step at that instant. These rules make
a replica with a router in front behave exactly like the single engine
(`sim.engine.SimEngine`) when it sees the same arrivals (tested: a 1-replica fleet gives
identical records), and the routing decisions independent of event skipping.

Driving. Between two arrival instants nothing outside a replica can change it, so the
fleet needs no event queue: before routing the arrivals at a it brings each replica to a
(`Replica.advance_to`), which runs normal steps and spans back to back on the replica's
own clock as the single engine does, and stops at the first step boundary at or after a,
idle, or inside a span. (sim.cluster.disagg adds KV transfers, events between arrivals, and runs
its replicas as SimPy processes under the same rules.)

Cost. Replicas skip steady decode spans as the single engine does, spans included that end
with the step in which sequences reach their length limit (the next span follows at once). A
replica does not know whether the next arrival is its own: a span is planned to cover the
next arrival and kept pending while the router sends requests elsewhere (its plan then grows
to the next arrival, by at least a quarter, and on to the next finishing step when that is
near), and it is cut short (`Span.cut`) when a request is routed to it. Planning only prices
steps and stamps their end times; their accounting (blocks, memory integrals) runs once,
when they are committed (`sim.span`). So a replica pays for its own arrivals and finishes
only, plus a constant per arrival instant, and a fleet of N replicas costs about N single
replicas serving 1/N of the load each, plus the router's look at every replica at every
arrival (measured in README's Speed); routers that read KV state add one partial commit per
replica and arrival. Other routers still see finishes as of each arrival: the requests a
pending span finishes in steps that started before the arrival no longer count
(`sync_finishes`). That count is kept between arrivals (`Replica._load_until`) until the
pending span's next finishing step starts or the replica moves (a step, a new span, a
delivery), so most arrivals read most replicas without a bisect.
"""
from __future__ import annotations

import math
import sys
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from core import Request
from core.sched.event_skipping import fast_forward, renew_steady_plan, schedule_steady_step, update_steady_step
from core.metrics import summarize
from policies import make as make_policy
from sim.engine import (_EMPTY_RESULT, CHECK_SPANS, ResolvedConfig, SimConfig, SimEngine, SimResult,
                        gc_tuned_for_run, resolve)
from sim.memory import sample as memory_sample
from sim.span import Span
from traces import Trace


@dataclass
class FleetConfig:
    """N identical replicas behind a router (disaggregation: see sim.cluster.disagg)."""
    replica: SimConfig = field(default_factory=SimConfig)
    replicas: int = 1
    router: str = "round-robin"

    def validate(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        make_policy("router", self.router)
        if self.replica.jitter_seed is not None:
            raise ValueError("--jitter-seed draws one engine's step noise (every replica would draw the same): "
                             "drop it for fleets")
        if self.router == "prefix-aware" and not self.replica.enable_prefix_caching:
            raise ValueError("the prefix-aware router routes by cached prefixes: add --enable-prefix-caching")

    @property
    def num_gpus(self) -> int:
        return self.replicas * self.replica.tensor_parallel_size


# Steps a replica plans when a span starts: those that start before the fleet's next
# arrival (the estimate as in sim.engine), at least MIN_CHUNK; while the router sends
# requests elsewhere, the plan grows to the next arrival, by at least a quarter
# (`span_chunk`: planning past a cut only prices steps, so a small overshoot beats many
# small extensions), and on to the next finishing step when it is near (`reach_next_finish`).
MIN_CHUNK = 8
FINISH_REACH = 4


def span_chunk(span: "Span", a: float, reach: int = 1) -> int:
    """Steps to add to a span's plan so that it covers time a (its steps never shorten)."""
    planned = len(span.ends)
    left = span.horizon - planned
    if a == math.inf:
        return left
    return min(left, reach_next_finish(span, planned, max(int((a - span.ends[-1]) / span.durations[-1]) + 2,
                                                          planned // 4), reach))


def reach_next_finish(span: "Span", planned: int, need: int, reach: int) -> int:
    """Steps to plan past `planned`: `need`, or on to the end of the next finishing step
    when that is at most `reach` times as far. The router's count of the replica stays
    valid until that step starts, so arrivals before it need not touch the replica. Worth
    it where most arrivals go elsewhere: a replica gets one in N (`Replica.finish_reach`:
    min(FINISH_REACH, N - 1); Azure conversation trace, 3,000 requests, instructions: -3.4%
    at 16 replicas, -0.6% at 4, +3.3% if a single replica reached)."""
    if reach <= 1:
        return need
    steps = span.finish_steps
    j = bisect_left(steps, planned + need - 1)
    if j < len(steps):
        need = max(need, min(steps[j] + 1 - planned, reach * need))
    return need


class Replica(SimEngine):
    """One engine of a fleet: requests arrive in its inbox when the router sends them.

    The fleet drives it with `advance_to(a)` (a: the next arrival still to be routed): it
    runs normal steps back to back on its own clock, as the single engine does, and stops
    at its first step boundary at or after a, when it runs out of work (it then waits for a
    delivery), or inside a steady-decode span planned past a (kept pending: committed up
    to the step in progress when a request is delivered, or when the router reads it)."""

    def __init__(self, index: int, resolved: ResolvedConfig, trace: Trace, fleet: "Fleet"):
        super().__init__(resolved, trace)
        if self._parents is not None:
            raise ValueError("fleets do not run --multi-turn conversations (a turn must follow its "
                             "conversation's replica); drop --multi-turn")
        self.index = index
        self.fleet = fleet
        self.finish_reach = min(FINISH_REACH, max(1, fleet.config.replicas - 1))    # see reach_next_finish
        self.inbox: deque[Request] = deque()
        self.served: list[int] = []           # trace indices routed here, in routing order
        self._span: Span | None = None
        self._seen_at: float | None = None    # the router's instant (`sync_finishes`), for `outstanding`
        # `outstanding` as of router instants t in (the instant it was counted, _load_until]:
        # a count changes only when a pending span's next finishing step starts, or when the
        # replica takes a normal step, starts a span or gets a delivery, which reset
        # _load_until. (A commit does not: it moves requests the count already left out
        # from the pending span to the scheduler.)
        self._load = 0
        self._load_until = -math.inf
        # Waiting (idle, or blocked with nothing that fits) until a delivery: the state
        # then, for the gap's accounting (used blocks, counts, memory sample).
        self._waiting: tuple | None = None
        self._span_due = False                # at the clock: try a span before the next normal step
        # advance_to(a) has nothing to do for a <= quiet_until (a wait, a pending span's
        # planned end, or a step boundary past the last arrival routed); -inf after a delivery.
        self.quiet_until = -math.inf

    # -- what the router sees ----------------------------------------------------------
    @property
    def outstanding(self) -> int:
        seen = self._seen_at
        if seen is not None and seen <= self._load_until:
            return self._load
        n = len(self.scheduler.requests) + len(self.inbox)
        span = self._span
        if span is None:
            until = math.inf
        elif seen is None:
            return n
        else:
            finished, until = span.requests_finished_before(seen)
            n -= finished
        if seen is not None:
            self._load, self._load_until = n, until
        return n

    @property
    def kv_usage(self) -> float:
        gpu = self.scheduler.kv.gpu
        return gpu.num_used / gpu.num_blocks

    def cached_prefix_tokens(self, request: Request) -> int:
        kv = self.scheduler.kv
        return len(kv.find_cached_prefix(request.seqs[0])) * kv.block_size if kv.enable_prefix_caching else 0

    def sync(self, t: float, last: bool = False) -> None:
        """Apply the steps of a pending span that start before t (the router reads KV state;
        `last`: a delivery, which cuts the span there)."""
        span = self._span
        if span is not None:
            self._commit_span(span, max(span.done, span.steps_started_before(t)), last=last)

    def sync_finishes(self, t: float) -> None:
        """Let the router count outstanding requests as of t, as step by step (where a
        finishing step's results apply when it starts): a pending span's requests that
        finish in steps starting before t no longer count (`Span.requests_finished_before`;
        a span whose requests have several sequences is committed through that step)."""
        self._seen_at = None
        span = self._span
        if span is None:
            self._seen_at = t
            return
        if span.plan.num_requests == span.plan.num_seqs:
            self._seen_at = t                          # `outstanding` subtracts them, uncommitted
            return
        for f in reversed(span.finish_steps):         # the last finishing step started before t
            if f < span.done:
                return
            if f < len(span.ends) and span.end_of(f) < t:
                self._commit_span(span, f + 1, last=False)
                return

    def deliver(self, request: Request, now: float) -> None:
        """Take `request` at time `now` (its exact arrival time): it enters at this
        replica's next step boundary (a pending span stops at the step in progress)."""
        self.sync(now, last=True)
        self.inbox.append(request)
        self.served.append(request.user_data)
        span = self._span
        self.quiet_until = self._load_until = -math.inf
        if span is not None and span.cut is None:
            span.cut = span.steps_started_before(now)
        else:
            self.wake(now)

    def _intake_inbox(self) -> None:
        """The delivered requests enter the scheduler (at this step boundary)."""
        inbox, add = self.inbox, self._add
        while inbox:
            add(inbox.popleft())

    def wake(self, t: float) -> None:
        """End a wait at time t (exact): account the idle (or blocked) gap."""
        waiting = self._waiting
        if waiting is None:
            return
        self._waiting = None
        self.quiet_until = -math.inf
        clock = self.clock
        dt = t - clock
        if dt > 0:
            used, counts, mem = waiting
            self._account(dt, used, *counts)
            self.memory.add(dt, mem)
            self.timeseries.idle(clock, dt, used, *counts, mem)
            self.clock = t

    def _wait(self) -> None:
        sched = self.scheduler
        self._waiting = (sched.kv.gpu.num_used, (len(sched.running), len(sched.waiting), len(sched.swapped)),
                         memory_sample(sched))
        self.quiet_until = math.inf

    # -- the engine loop ---------------------------------------------------------------------
    def advance_to(self, a: float) -> None:
        """Run what starts before time a, the next arrival still to be routed (inf: none is
        left). Routing at a then sees this replica as at its first step boundary at or after
        a: normal steps apply their results when they start, a pending span commits lazily."""
        if self._waiting is not None:
            return                                   # only a delivery ends a wait
        sched, ex = self.scheduler, self.executor
        gpu = sched.kv.gpu
        skipping = self.event_skipping
        while True:
            span = self._span
            if span is not None:
                if span.cut is None:
                    planned = len(span.ends)
                    if span.ends[-1] < a and planned < span.horizon:
                        span.extend(span_chunk(span, a, self.finish_reach))
                        continue
                    if span.ends[-1] >= a:
                        self.quiet_until = span.ends[-1]
                        return                       # still running when the router looks at a
                    k = planned                      # ran to its horizon before a
                else:
                    k = span.cut
                self._span = None
                self._commit_span(span, k)
                self.clock = span.end_of(k)
                # A span that ends in finishes is followed at once by the next one.
                self._span_due = k == span.horizon and span.finishes
            clock = self.clock
            if clock >= a:
                self.quiet_until = clock
                return                               # the router routes a first
            if self._span_due:
                # The boundary after a normal step (or a span ending in finishes): a span
                # starts here unless a request was delivered meanwhile, as in sim.engine.
                self._span_due = False
                if not self.inbox and self._start_span(a):
                    continue
            if self.inbox:
                self._intake_inbox()
            if not sched.requests:
                ex.engine_idle()
                self._wait()
                return
            # The step that admits arrivals after a span takes the plan's decodes in bulk, as
            # in sim.engine (core.sched.event_skipping.schedule_steady_step).
            steady = self._steady
            step = schedule_steady_step(sched, steady, clock) if steady is not None else None
            self._load_until = -math.inf             # a step may finish or reject requests
            if step is None:
                self._steady = None
                out = sched.schedule(clock)
                dt = ex.step_time(out)
                if dt <= 0.0:
                    self._finish(sched.update(out, _EMPTY_RESULT, clock).finished)
                    if sched.requests:
                        self._wait()                 # nothing fits: only a delivery changes that
                        return
                    continue
                num_seqs, num_tokens = len(out.scheduled), out.num_batched_tokens
            else:
                out = step.out
                dt = ex.step_time(out, step.num_decodes, step.decode_context_sum)
                num_seqs, num_tokens = step.num_seqs, step.num_batched_tokens
            result = ex.execute_model(out)
            used = gpu.num_used
            running, waiting, swapped = len(sched.running), len(sched.waiting), len(sched.swapped)
            self._account(dt, used, running, waiting, swapped)
            mem = memory_sample(sched)
            self.memory.add(dt, mem)
            self.timeseries.step(clock, dt, used, running, waiting, swapped, num_seqs, num_tokens, len(out.preempted),
                                 mem)
            end = clock + dt
            self.clock = end
            self.num_steps += 1
            self.num_normal_steps += 1
            if step is None:
                self._finish(sched.update(out, result, end).finished)
            else:
                self._finish(update_steady_step(sched, step, result, end, ex.token_ids, ex.extend_tokens).finished)
                self._steady = renew_steady_plan(sched, step.plan, True, step.out.admitted, self._past_finishes)
            self._span_due = skipping and not ex.waking      # (the first steps after idle: one at a time)

    def _start_span(self, a: float) -> bool:
        """Plan a steady-decode span from the clock (False: none now), its first chunk
        covering the steps that start before a."""
        sched = self.scheduler
        if not sched.requests:
            return False
        plan = self._span_plan()                  # carried and renewed, as in sim.engine
        if plan is None or plan.horizon <= 0:
            return False
        span = Span(self, plan)
        self._load_until = -math.inf                 # its finishes will count
        horizon = plan.horizon
        if a == math.inf or horizon == 1:
            span.extend(horizon)                     # nothing can cut it, or one step
        else:
            # Steps never get shorter as contexts grow: at most (a - start) / first + 1 start before a.
            first = self.executor.decode_step_times(plan.num_seqs, plan.context_sum, 1)[0]
            span.extend(min(horizon, reach_next_finish(span, 0, max(MIN_CHUNK, int((a - span.start) / first) + 2),
                                                     self.finish_reach)))
        self._span = span
        return True


    def _commit_span(self, span: Span, k: int, last: bool = True) -> None:
        """Apply steps [span.done, k) of a planned span: their accounting (`Span.account`),
        then the core (`fast_forward`: tokens, token times, blocks, finishes). `last`: no
        later piece of this span will be committed."""
        i0 = span.done
        if k <= i0:
            return
        sched = self.scheduler
        span.account(self, k)
        if not last:
            span.keep_cached_tokens()
        plan = span.plan
        result = fast_forward(sched, k - i0, span.ends[i0:k], self.executor.token_ids, plan,
                              self.executor.extend_tokens)
        # Sequences that finished in the last step gave their blocks back (the cursor
        # counts those of earlier steps as gone).
        finished_last = span.finishes_in(k - 1)
        used, expected = sched.kv.gpu.num_used, span.blocks_in_use
        if used != expected and not (finished_last and used < expected):
            raise RuntimeError(f"event skipping: KV usage {used} after {k} span steps, expected {expected}")
        if CHECK_SPANS and not finished_last and memory_sample(sched) != span.sample_after():
            raise RuntimeError(f"event skipping: memory breakdown {memory_sample(sched)} after {k} span steps, "
                               f"expected {span.sample_after()}")   # the state now = the span's last step
        span.done = k
        self.num_steps += k - i0
        # The plan still describes the running set (its steps counted), less what finished.
        if plan.first_finish <= plan.applied:
            self._steady = renew_steady_plan(sched, plan, True, past_finishes=self._past_finishes)
        self._finish(result.finished)


@dataclass
class FleetResult:
    """Per-replica results and the fleet's records (trace order)."""
    config: FleetConfig
    trace_source: str
    records: list                          # RequestRecord per trace request
    requested_output_lens: list[int]
    replica_of: list[int]                  # replica index per trace request
    replicas: list[SimResult]              # each over the requests it served
    sim_time: float
    extra: dict = field(default_factory=dict)   # e.g. sim.cluster.disagg's transfer statistics


class Fleet:
    """Replicas + router. The fleet walks the trace's arrival instants in order: it brings
    every replica to the instant (`Replica.advance_to`), then routes all of the instant's
    arrivals. Replicas share nothing but the clock, so none needs to wait for another
    between two arrival instants: no event queue is involved (sim.cluster.disagg adds KV transfers,
    events between arrivals, and runs its replicas as SimPy processes)."""

    def __init__(self, config: FleetConfig, trace: Trace, *, progress: bool = False,
                 resolved: ResolvedConfig | None = None):
        config.validate()
        self.config = config
        self.trace = trace
        resolved = resolved or resolve(config.replica)
        self.replicas = self._make_replicas(resolved)
        self.router = make_policy("router", config.router)
        self.arrivals = [r.arrival_time for r in trace.requests]
        self._next = 0                       # next trace request to route
        self.records: list = [None] * len(trace.requests)
        self.replica_of = [-1] * len(trace.requests)
        self.progress = progress
        for r in self.replicas:
            r.records = self.records         # replicas record into the fleet's list, trace order

    def _make_replicas(self, resolved: ResolvedConfig) -> list:
        return [Replica(i, resolved, self.trace, self) for i in range(self.config.replicas)]

    def next_arrival(self) -> float:
        """Time of the next arrival still to be routed (inf when none is left)."""
        return self.arrivals[self._next] if self._next < len(self.arrivals) else math.inf

    # -- routing --------------------------------------------------------------------------
    def make_request(self, i: int) -> Request:
        first = self.replicas[0]
        request = first._make_request(i)
        if i == 0:                           # token ids are relative to the run's first sequence
            for r in self.replicas:
                r.executor.seq_id_base = request.seqs[0].seq_id
        return request

    def route(self, request: Request, now: float) -> Replica:
        replicas = self.replicas
        if len(replicas) == 1:
            return replicas[0]
        if self.router.reads_kv:
            for r in replicas:
                r.sync(now)
        else:
            for r in replicas:
                if now <= r._load_until:
                    r._seen_at = now                 # the count it kept is still its count now
                else:
                    r.sync_finishes(now)
        return replicas[self.router.choose(request, replicas)]

    def _route_instant(self, t: float) -> None:
        """Route every arrival at time t (exact trace times: equal ones route together)."""
        arrivals, n = self.arrivals, len(self.arrivals)
        while self._next < n and arrivals[self._next] <= t:
            i = self._next
            request = self.make_request(i)
            target = self.route(request, t)
            self.replica_of[i] = target.index
            self._next = i + 1
            target.deliver(request, t)

    def _drive(self) -> None:
        replicas, arrivals, n = self.replicas, self.arrivals, len(self.arrivals)
        while self._next < n:
            t = arrivals[self._next]
            for r in replicas:
                if t > r.quiet_until:
                    r.advance_to(t)
            self._route_instant(t)
            last = t
        if n:
            for r in replicas:               # idle replicas wait until the last arrival instant
                r.wake(last)
        for r in replicas:
            r.advance_to(math.inf)
            if r.scheduler.requests:
                raise RuntimeError(f"replica {r.index}: the scheduler made no progress at t={r.clock:.6f} "
                                   f"with {len(r.scheduler.requests)} unfinished requests")

    # -- run ------------------------------------------------------------------------------
    def run(self) -> FleetResult:
        pbar = None
        if self.progress:
            from tqdm import tqdm
            pbar = tqdm(total=len(self.arrivals), unit="req", file=sys.stderr, delay=0.5, mininterval=0.5,
                        dynamic_ncols=True, desc=f"fleet x{len(self.replicas)}")
        for r in self.replicas:
            r._pbar = pbar
        try:
            with gc_tuned_for_run(len(self.replicas)):
                self._drive()
        finally:
            if pbar is not None:
                pbar.close()
        return self._result()

    def _result(self) -> FleetResult:
        lost = [self.trace.requests[i].request_id for i, r in enumerate(self.records) if r is None]
        if lost:
            raise RuntimeError(f"{len(lost)} requests never finished (first: {lost[:5]})")
        per = []
        for r in self.replicas:
            idx = sorted(r.served)
            per.append(r.build_result([self.records[i] for i in idx], [r.max_tokens[i] for i in idx]))
        return FleetResult(self.config, self.trace.source, self.records, self.replicas[0].max_tokens,
                           self.replica_of, per, max(r.clock for r in self.replicas))


def simulate_fleet(config: FleetConfig, trace: Trace, *, progress: bool = False) -> FleetResult:
    return Fleet(config, trace, progress=progress).run()


# -- summaries --------------------------------------------------------------------------------
def replica_summary(result: SimResult) -> dict:
    """The per-replica block of a fleet summary."""
    s = summarize(result.records)
    return {
        "num_requests": len(result.records), "completed": s["completed"], "rejected": s["rejected"],
        "output_tokens": sum(r.num_output_tokens for r in result.records),
        "mean_ttft": s["mean_ttft"], "p90_ttft": s["p90_ttft"], "mean_tpot": s["mean_tpot"],
        "p90_tpot": s["p90_tpot"], "num_preemptions": result.num_preemptions,
        "prefix_cache_hit_rate": result.kv_stats["prefix_cache_hit_rate"],
        "kv_usage_mean": result.time_weighted["kv_usage_mean"], "kv_usage_max": result.time_weighted["kv_usage_max"],
        "sim_time": result.sim_time, "num_steps": result.num_steps,
    }


def goodput(records, duration: float, slo_ttft: float, slo_tpot: float) -> int:
    """Requests that finished meeting both SLOs (DistServe's goodput numerator); a
    one-token request has no TPOT and is judged on TTFT alone."""
    good = 0
    for r in records:
        if r.status in ("length", "stop") and r.ttft is not None and r.ttft <= slo_ttft:
            tpot = r.tpot
            if tpot is None or tpot <= slo_tpot:
                good += 1
    return good


def fleet_summary(result: FleetResult, num_gpus: int | None = None,
                  slo: tuple[float, float] | None = None) -> dict:
    """summary.json of a fleet: the fleet's aggregates over all requests (same names as a
    single run), fleet-wide counters, and one block per replica. `slo` = (TTFT, TPOT)
    seconds adds goodput: requests meeting both per second, and per GPU."""
    from sim.results import _clean, reject_reasons
    s = summarize(result.records)
    s = {"num_requests": len(result.records), **s}
    s["reject_reasons"] = reject_reasons(result.records)
    reps = result.replicas
    s["num_preemptions"] = sum(r.num_preemptions for r in reps)
    s["num_swaps"] = sum(r.num_swaps for r in reps)
    dis = result.extra.get("disaggregation")
    # Under disaggregation the decode side "hits" the KV handed over to it: count prompts
    # where they are first looked up, on the prefill replicas.
    looked_up = reps[:dis["prefill_replicas"]] if dis else reps
    q = sum(r.kv_stats["prefix_cache_queries"] for r in looked_up)
    h = sum(r.kv_stats["prefix_cache_hits"] for r in looked_up)
    s["prefix_cache_queries"], s["prefix_cache_hits"] = q, h
    s["prefix_cache_hit_rate"] = h / q if q else 0.0
    s["kv_usage_mean"] = sum(r.time_weighted["kv_usage_mean"] * r.sim_time for r in reps) / \
        max(1e-12, sum(r.sim_time for r in reps))
    s["kv_usage_max"] = max(r.time_weighted["kv_usage_max"] for r in reps)
    s["sim_time"] = result.sim_time
    s["num_steps"] = sum(r.num_steps for r in reps)
    slot_seconds = {c: sum(r.memory_breakdown["slot_seconds"][c] for r in reps)
                    for c in reps[0].memory_breakdown["slot_seconds"]}
    in_use = sum(v for c, v in slot_seconds.items() if c != "free")
    s["memory_breakdown"] = {"shares": {c: (v / in_use if in_use > 0 else 0.0)
                                        for c, v in slot_seconds.items() if c != "free"},
                             "slot_seconds": slot_seconds}
    phys = sum(r.kv_sharing["physical_block_seconds"] for r in reps)
    logical = sum(r.kv_sharing["logical_block_seconds"] for r in reps)
    s["kv_sharing"] = {"physical_block_seconds": phys, "logical_block_seconds": logical,
                       "saving": 1.0 - phys / logical if logical > 0 else 0.0}
    gpus = num_gpus if num_gpus is not None else result.config.num_gpus
    s["num_gpus"] = gpus
    s["request_throughput_per_gpu"] = s["request_throughput"] / gpus if gpus else None
    if slo is not None:
        good = goodput(result.records, s["duration"], *slo)
        s["slo_ttft"], s["slo_tpot"] = slo
        s["slo_attainment"] = good / len(result.records) if result.records else 0.0
        s["goodput"] = good / s["duration"] if s["duration"] > 0 else 0.0
        s["goodput_per_gpu"] = s["goodput"] / gpus if gpus else None
    s["replicas"] = [replica_summary(r) for r in reps]
    s.update(result.extra)
    s["trace"] = result.trace_source
    cfg = reps[0].config.echo()
    cfg.update(replicas=result.config.replicas, router=result.config.router)
    if dis:
        cfg.update(disaggregate=f"{dis['prefill_replicas']}:{dis['decode_replicas']}", link=dis["link"])
    s["config"] = cfg
    return _clean(s)


def write_fleet_results(result: FleetResult, out_dir, slo: tuple[float, float] | None = None) -> dict:
    """requests.csv (one row per request, trace order, plus its `replica`), summary.json
    (fleet_summary) and timeseries.csv (every replica's rows, tagged `replica`)."""
    import csv
    import json
    from pathlib import Path
    from sim.results import REQUEST_COLUMNS, request_row
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = fleet_summary(result, slo=slo)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow((*REQUEST_COLUMNS, "replica"))
        for rec, req_out, rep in zip(result.records, result.requested_output_lens, result.replica_of):
            w.writerow(["" if v is None else v for v in request_row(rec, req_out)] + [rep])
    with open(out / "timeseries.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow((*SimResult.TIMESERIES_COLUMNS, "replica"))
        for i, rep in enumerate(result.replicas):
            w.writerows((*row, i) for row in rep.timeseries)
    return summary


def format_fleet_summary(summary: dict) -> str:
    """The single-run table for the fleet, then one line per replica."""
    from sim.results import format_summary
    lines = [format_summary(summary)]
    c = summary["config"]
    dis = summary.get("disaggregation")
    head = (f"fleet        {dis['prefill_replicas']} prefill + {dis['decode_replicas']} decode replicas, "
            f"{dis['link']} {dis['link_bandwidth_gbps']:g} GB/s; {dis['num_transfers']:,} KV transfers, mean "
            f"{dis['mean_transfer_time'] * 1e3:.2f} ms (+ {dis['mean_wait_for_decode_memory'] * 1e3:.2f} ms waiting "
            f"for decode memory, {dis['mean_wait_for_link'] * 1e3:.2f} ms for the link)" if dis else
            f"fleet        {c['replicas']} replicas, router {c['router']}")
    lines.append(head + f"; {summary['num_gpus']} GPUs, {summary['request_throughput_per_gpu']:.3f} req/s per GPU")
    if "goodput" in summary:
        lines.append(f"goodput      {summary['goodput']:.3f} req/s ({summary['goodput_per_gpu']:.3f} per GPU) meet "
                     f"TTFT <= {summary['slo_ttft'] * 1e3:g} ms and TPOT <= {summary['slo_tpot'] * 1e3:g} ms "
                     f"({summary['slo_attainment']:.1%} of requests)")
    for i, r in enumerate(summary["replicas"]):
        ttft = "-" if r["mean_ttft"] is None else f"{r['mean_ttft'] * 1e3:,.1f}"
        tpot = "-" if r["mean_tpot"] is None else f"{r['mean_tpot'] * 1e3:,.1f}"
        lines.append(f"  replica {i:<3} {r['num_requests']:>7,} req  TTFT mean {ttft:>8} ms  TPOT mean {tpot:>6} ms  "
                     f"KV mean {r['kv_usage_mean']:.1%}  prefix hits {r['prefix_cache_hit_rate']:.1%}  "
                     f"preempt {r['num_preemptions']:,}")
    return "\n".join(lines)
