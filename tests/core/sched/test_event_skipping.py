"""Event skipping (`steady_decode_horizon` + `fast_forward`) against single steps.

The simulator skips steady decode spans in bulk; whatever it skips must be exactly
what `schedule()` + `update()` would have done one step at a time, under every
registered policy combination (queue x preemption x victim x eviction x allocation,
prefix caching on and off). The cross product is large, so hypothesis samples it.
"""
from __future__ import annotations

import inspect
import os

from hypothesis import given, settings, strategies as st

from core import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from core.sched.event_skipping import (describe_steady_decode, fast_forward, renew_steady_plan, schedule_steady_step,
                                 steady_decode_horizon, update_steady_step)
from core.metrics import RequestRecord
from policies import REGISTRY, PolicySet
from tests.core.toy_executor import ToyExecutor, next_token

# Prompts use token ids >= 50 (the toy executor generates ids < 50), so a decode never
# publishes a block a waiting prompt could hit: the simulator's guarantee too (see
# steady_decode_horizon). A request preempted by recompute waits with its generated
# tokens, though, and the toy executor's tokens depend on the last 6 tokens only: two
# requests with the same prompt generate the same blocks, so one's decode could publish a
# block the other then hits (the simulator's tokens depend on the sequence, so it cannot).
# `distinct` prompts end in a token of their own (chained hashes then keep every later
# block apart). Shared prefixes make prefix caching (and LPM order) matter.
PREFIXES = [[50, 51, 52, 53, 54, 55, 56, 57], [60] * 8, [61, 62, 63, 64], []]
BS = 4


# The kinds a scheduler is built from (the registry also holds fleet-level kinds, e.g. routers).
SCHEDULER_KINDS = [k for k in inspect.signature(PolicySet.from_names).parameters if k in REGISTRY]


def policy_names():
    """One name per scheduler policy kind, drawn from the registry (new policies join
    automatically)."""
    return st.fixed_dictionaries({kind: st.sampled_from(sorted(REGISTRY[kind])) for kind in SCHEDULER_KINDS})


def workloads():
    return st.lists(st.tuples(st.integers(0, 40), st.sampled_from(range(len(PREFIXES))),
                              st.lists(st.integers(50, 59), max_size=12), st.integers(1, 30),
                              st.sampled_from([1, 1, 2]), st.integers(0, 2)),
                    min_size=1, max_size=10)


def drive(workload, fast: bool, names: dict, caching: bool, blocks: int, cpu_blocks: int = 8,
          through_finishes: bool = False, use_plan: bool = False, distinct: bool = False, carry: bool = False,
          past_finishes: bool = False):
    """Run `workload` step by step, or (fast) with spans; use_plan: spans come from
    `describe_steady_decode` and are applied in two pieces through it (as a fleet replica cut
    short applies them), instead of `steady_decode_horizon` + a plan-less `fast_forward`.
    carry (as sim.engine): one plan carried across spans (`renew_steady_plan`, checked
    against a fresh pass every time) and the steps that admit arrivals after a span taken
    with `schedule_steady_step` / `update_steady_step` where they apply; past_finishes: its
    spans may go on past the steps in which sequences finish (each finishing at its own)."""
    caching = caching and names["allocation"] == "paged"
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=48),
                      CacheConfig(block_size=BS, num_gpu_blocks=blocks, num_cpu_blocks=cpu_blocks,
                                  enable_prefix_caching=caching, watermark=0.0),
                      PolicySet.from_names(**names))
    ex = ToyExecutor()

    def token_fn(seq, pos, count):
        hist = seq.token_ids[:pos]
        out = []
        for _ in range(count):
            hist.append(next_token(hist))
            out.append(hist[-1])
        return out

    def renewed(plan):
        """A renewed plan is what a fresh pass over the scheduler gives (None only when
        that is None too: renewing never gives up on a plain decode state)."""
        assert plan_view(plan) == plan_view(describe_steady_decode(sched, through_finishes, past_finishes))
        return plan

    arrivals = sorted(workload, key=lambda w: w[0])
    reqs, t, i, skipped, finished_in_span = [], 0, 0, 0, 0
    carried, steady_steps, phased = None, 0, 0
    while i < len(arrivals) or sched.has_unfinished_requests():
        while i < len(arrivals) and arrivals[i][0] <= t:
            step, prefix, tail, max_tokens, n, priority = arrivals[i]
            prompt = PREFIXES[prefix] + tail + ([100 + i] if distinct else []) or [50]
            params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
            reqs.append(sched.add_request(Request(f"r{i}", prompt, params, priority=priority,
                                                  arrival_time=float(step))))
            i += 1
        step = schedule_steady_step(sched, carried, float(t)) if carried is not None else None
        if step is None:
            carried = None
            out = sched.schedule(float(t))
            res = ex.execute_model(out)
            t += 1
            sched.update(out, res, float(t))
        else:
            res = ex.execute_model(step.out)       # the admissions; the decodes take token_fn's tokens
            t += 1
            update_steady_step(sched, step, res, float(t), token_fn)
            carried = renewed(renew_steady_plan(sched, step.plan, through_finishes, step.out.admitted, past_finishes))
            steady_steps += 1
        while fast and carry:
            if carried is None:
                carried = describe_steady_decode(sched, through_finishes, past_finishes)
            elif carried.applied:
                carried = renewed(renew_steady_plan(sched, carried, through_finishes, past_finishes=past_finishes))
            k = carried.horizon if carried is not None else 0
            if i < len(arrivals):
                k = min(k, arrivals[i][0] - t)
            if k <= 0:
                break
            done = fast_forward(sched, k, [float(t + j + 1) for j in range(k)], token_fn, carried).finished
            t += k
            skipped += k
            finished_in_span += len(done)
            phased += len({r.metrics.finished_time for r in done}) > 1
            if not done:
                break
            carried = renewed(renew_steady_plan(sched, carried, through_finishes, past_finishes=past_finishes))
        while fast and not carry:                  # spans back to back while they end in finishes
            plan = (describe_steady_decode(sched, through_finishes, past_finishes) if use_plan else None)
            plan = plan if plan is not None and plan.horizon > 0 else None
            k = steady_decode_horizon(sched, through_finishes) if not use_plan else plan.horizon if plan else 0
            if i < len(arrivals):
                k = min(k, arrivals[i][0] - t)
            if k <= 0:
                break
            times = [float(t + j + 1) for j in range(k)]
            if plan is None:
                done = fast_forward(sched, k, times, token_fn).finished
            else:
                first = k // 2
                done = fast_forward(sched, first, times[:first], token_fn, plan).finished
                assert past_finishes or not done   # else finishes come at the span's last step only
                done += fast_forward(sched, k - first, times[first:], token_fn, plan).finished
            t += k
            skipped += k
            finished_in_span += len(done)
            if not done:
                break
    assert sched.kv.gpu.num_used == 0
    recs = [(RequestRecord.from_request(r), sorted(s.output_token_ids for s in r.finished_seqs)) for r in reqs]
    # Block-level state too: which ids are free, in which order, and which hold cached prefixes.
    gpu = sched.kv.gpu
    blocks_state = (gpu.uncached_free_blocks(), sorted(gpu.cached.items()))
    return recs, skipped, sched.kv.stats(), sched.num_preemptions, blocks_state, finished_in_span, steady_steps, phased


def plan_view(plan):
    """What a SteadyDecode says about the scheduler (None: not a plain decode state)."""
    if plan is None:
        return None
    return plan.horizon, plan.seqs, plan.lefts, plan.offsets, plan.context_sum, plan.num_requests, plan.applied


@given(workload=workloads(), names=policy_names(), caching=st.booleans(), blocks=st.integers(12, 28),
       through_finishes=st.booleans(), use_plan=st.booleans(), past_finishes=st.booleans())
@settings(max_examples=300 if not os.environ.get("CI") else 1000, deadline=None)
def test_fast_forward_matches_single_steps(workload, names, caching, blocks, through_finishes, use_plan,
                                           past_finishes):
    """Spans that stop before a finish, or (through_finishes) end with the finishing step
    while nothing waits: requests finishing at different steps, by max_tokens or by the
    model length limit, n = 1 and forked n = 2; spans applied whole, or from a plan in two
    pieces (as a fleet replica cut short applies them), possibly past finishes (which may
    then fall in either piece)."""
    slow = drive(workload, False, names, caching, blocks, distinct=True)
    fast = drive(workload, True, names, caching, blocks, through_finishes=through_finishes, use_plan=use_plan,
                 distinct=True, past_finishes=past_finishes)
    assert fast[0] == slow[0], names
    assert fast[2:5] == slow[2:5], names


@given(workload=workloads(), names=policy_names(), caching=st.booleans(), blocks=st.integers(12, 28),
       through_finishes=st.booleans(), past_finishes=st.booleans())
@settings(max_examples=300 if not os.environ.get("CI") else 1000, deadline=None)
def test_carried_plans_and_steady_steps_match_single_steps(workload, names, caching, blocks, through_finishes,
                                                           past_finishes):
    """The simulator's way: one plan carried across spans and renewed (equal to a fresh
    pass each time), and the step that admits arrivals after a span scheduled from it
    (`schedule_steady_step`), spans possibly going on past finishes: the same outputs,
    blocks and cache as step by step."""
    slow = drive(workload, False, names, caching, blocks, distinct=True)
    fast = drive(workload, True, names, caching, blocks, through_finishes=through_finishes, distinct=True,
                 carry=True, past_finishes=past_finishes)
    assert fast[0] == slow[0], names
    assert fast[2:5] == slow[2:5], names


def test_steady_steps_are_taken():
    """Arrivals during a steady span are admitted by steady steps (the carried plan's
    decodes in bulk), and the results equal step by step."""
    names = dict(queue="fcfs", preemption="recompute", victim="newest", eviction="lru", allocation="paged")
    workload = [(0, 3, [51], 30, 1, 0), (0, 3, [52], 25, 2, 0), (5, 3, [53], 9, 1, 0), (11, 0, [54], 12, 1, 0),
                (12, 1, [], 3, 1, 0)]
    slow = drive(workload, False, names, True, 40, distinct=True)
    fast = drive(workload, True, names, True, 40, through_finishes=True, distinct=True, carry=True)
    assert fast[0] == slow[0] and fast[2:5] == slow[2:5]
    assert fast[6] >= 2 and fast[1] > 20


def test_spans_go_on_past_finishes():
    """With past_finishes a span outlives the steps in which requests finish (each at its
    own step, its blocks freed before the survivors' next allocations): the same records,
    blocks and cache as step by step, in fewer spans."""
    names = dict(queue="fcfs", preemption="recompute", victim="newest", eviction="lru", allocation="paged")
    workload = [(0, 3, [51], 30, 1, 0), (0, 3, [52], 7, 1, 0), (0, 0, [53], 12, 1, 0), (1, 1, [], 19, 1, 0),
                (2, 2, [54, 55], 3, 1, 0)]
    for caching in (False, True):
        for blocks in (28, 14):                    # 14: the growth to the last limit does not fit
            slow = drive(workload, False, names, caching, blocks, distinct=True)
            fast = drive(workload, True, names, caching, blocks, through_finishes=True, distinct=True, carry=True,
                         past_finishes=True)
            assert fast[0] == slow[0] and fast[2:5] == slow[2:5]
            if blocks == 28:
                assert fast[7] >= 1                # a span in which requests finished at different steps


def test_span_after_a_swap_in_that_could_not_compute_publishes_like_single_steps():
    """Regression (found by the carried-plan property): a request swapped in by a step that
    had no blocks left to compute it resumes decoding with its table unpublished; step by
    step, the first step that starts a block publishes it (allocate_slots), so a span
    must too, or the cache differs from then on."""
    workload = [(0, 0, [], 1, 1, 0), (0, 0, [], 1, 1, 0), (0, 0, [], 1, 1, 0), (0, 0, [], 1, 1, 0),
                (23, 3, [], 14, 1, 0), (10, 0, [50, 50, 50], 27, 1, 0), (26, 0, [50, 50, 50, 50], 11, 1, 0)]
    names = dict(queue="fcfs", preemption="swap", victim="least-computed", eviction="fifo", allocation="paged")
    slow = drive(workload, False, names, True, 17, distinct=True)
    for carry in (False, True):
        fast = drive(workload, True, names, True, 17, distinct=True, carry=carry)
        assert fast[0] == slow[0] and fast[2:5] == slow[2:5]


def test_every_scheduler_policy_kind_is_sampled():
    assert set(SCHEDULER_KINDS) == {"queue", "preemption", "victim", "eviction", "allocation", "scheduler"}


def test_lpm_with_prefix_caching_matches_single_steps():
    """Regression (defect 3, found by the property above): under LPM the queue's head
    depends on the cache; skipped decode allocations that evict cached blocks change it,
    and the step-by-step run admitted a request the skipping run held back."""
    workload = [(0, 0, [], 1, 1, 0), (0, 0, [], 1, 1, 0), (0, 0, [], 1, 1, 0), (0, 0, [], 1, 1, 0),
                (0, 0, [], 15, 1, 0), (0, 1, [], 27, 1, 0), (0, 0, [], 1, 1, 0), (2, 3, [], 12, 1, 0),
                (9, 0, [50, 50], 8, 1, 0)]
    names = dict(queue="lpm", preemption="recompute", victim="least-computed", eviction="fifo", allocation="paged")
    slow = drive(workload, False, names, True, 12)
    fast = drive(workload, True, names, True, 12)
    assert fast[0] == slow[0]
    assert fast[2:5] == slow[2:5]


def test_fast_forward_actually_skips():
    workload = [(0, 3, [51, 52, 53], 30, 1, 0), (0, 3, [54, 55, 56, 57, 58], 25, 2, 0)]
    names = dict(queue="fcfs", preemption="recompute", victim="newest", eviction="lru", allocation="paged")
    _, skipped, _, _, _, in_span, _, _ = drive(workload, True, names, True, 40)
    assert skipped > 20 and in_span == 0


def test_spans_run_through_finishes():
    """Requests finishing at steps 9, 15 and 30: each finish ends a span and the next span
    follows with no single step in between. With a request waiting for the blocks a finish
    frees, the next single step admits it, as step by step."""
    names = dict(queue="fcfs", preemption="recompute", victim="newest", eviction="lru", allocation="paged")
    workload = [(0, 3, [51], 30, 1, 0), (0, 3, [52], 15, 1, 0), (0, 3, [53], 9, 2, 0)]
    slow = drive(workload, False, names, True, 40)
    for use_plan in (False, True):
        fast = drive(workload, True, names, True, 40, through_finishes=True, use_plan=use_plan)
        assert fast[0] == slow[0] and fast[2:5] == slow[2:5]
        # single steps: the admitting one and the copy-on-write after the n=2 fork (not the finishes)
        assert fast[5] == 3 and fast[1] == 28
    assert drive(workload, True, names, True, 40)[1] == 25   # without: each finishing step singly
    crowded = workload + [(1, 0, [], 20, 1, 0)]                # waits until a finish frees blocks
    slow = drive(crowded, False, names, True, 12)
    fast = drive(crowded, True, names, True, 12, through_finishes=True)
    assert fast[0] == slow[0] and fast[2:5] == slow[2:5]
    assert fast[5] >= 1
