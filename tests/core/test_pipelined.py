"""Batches in flight (pipeline parallelism): the scheduler's in-flight rule and the
EngineCore batch queue, with the deterministic async toy executor."""
from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import event, strategies as st
from hypothesis.stateful import initialize, invariant, rule

from core import CacheConfig, EngineCore, ModelRunnerOutput, Request, RequestStatus, SamplingParams, Scheduler, \
    SchedulerConfig
from core.config import pipeline_stage_layers
from core.kv.kv_capacity import kv_blocks_per_pipeline, kv_blocks_per_rank
from policies import PolicySet
from tests.core.sched.test_scheduler import SETUP, InFlightRules, SchedulerMachine, WatermarkProbe
from tests.core.toy_executor import AsyncToyExecutor, ToyExecutor, reference_outputs


def make(pp=2, batches=None, threaded=False, **kw):
    cache_kw = {k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__}
    policy_kw = {k: kw.pop(k) for k in list(kw) if k in ("queue", "preemption", "victim", "eviction")}
    kw.setdefault("max_model_len", 32)
    cache_kw.setdefault("block_size", 4)
    cache_kw.setdefault("num_gpu_blocks", 64)
    sched = Scheduler(SchedulerConfig(pipeline_parallel_size=pp, **kw), CacheConfig(**cache_kw),
                      PolicySet.from_names(**policy_kw))
    ex = AsyncToyExecutor(threaded=threaded)
    return EngineCore(sched, ex, max_concurrent_batches=batches or pp), sched, ex


def ids(out):
    return [s.seq.request.request_id for s in out.scheduled]


def add(engine, name, prompt, max_tokens=5, **params):
    return engine.add_request(Request(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)))


def test_two_requests_alternate_between_two_batches_in_flight():
    engine, sched, ex = make(max_num_seqs=1, max_num_batched_tokens=64)
    a = add(engine, "a", [1, 2, 3])
    b = add(engine, "b", [4, 5, 6])
    engine.run_until_done(100)
    assert ex.max_in_flight == 2
    # Each batch holds one sequence (max_num_seqs per batch), the two requests alternate.
    assert [ids(out) for out in ex.steps[:4]] == [["a"], ["b"], ["a"], ["b"]]
    for r in (a, b):
        assert r.finished_seqs[0].output_token_ids == reference_outputs(r.prompt_token_ids, 5, 1, None, True, 32)[0]


def test_a_request_in_flight_is_not_scheduled_again():
    # Its next prefill chunk waits until the batch holding the previous one is updated.
    engine, sched, ex = make(max_num_batched_tokens=4)
    r = add(engine, "solo", list(range(10)), max_tokens=4)
    engine.step()
    assert ex.max_in_flight == 1 and [(s.start, s.num_tokens) for s in ex.steps[0].scheduled] == [(0, 4)]
    engine.run_until_done(50)
    assert ex.max_in_flight == 1
    assert [(s.start, s.num_tokens) for out in ex.steps for s in out.scheduled] == \
        [(0, 4), (4, 4), (8, 2), (10, 1), (11, 1), (12, 1)]
    assert r.finished_seqs[0].output_token_ids == reference_outputs(list(range(10)), 4, 1, None, True, 32)[0]


def test_budgets_apply_per_batch():
    engine, sched, ex = make(max_num_seqs=2, max_num_batched_tokens=5)
    for i in range(5):
        add(engine, f"r{i}", [i + 1] * 3, max_tokens=6)
    engine.step()
    assert sched.num_running == 4                   # 2 batches x max_num_seqs
    engine.run_until_done(200)
    for out in ex.steps:
        assert len(out.scheduled) <= 2 and out.num_batched_tokens <= 5
    assert ex.max_in_flight == 2


@pytest.mark.parametrize("pp", [2, 3])
def test_never_more_than_p_batches_in_flight(pp):
    # Small token budgets, many slots: the scheduler would find work for more batches.
    engine, sched, ex = make(pp=pp, max_num_seqs=8, max_num_batched_tokens=4)
    for i in range(8):
        add(engine, f"r{i}", [i + 1] * 3, max_tokens=4)
    while engine.has_unfinished_requests() or engine.num_in_flight:
        engine.step()
        assert engine.num_in_flight <= pp - 1       # step() lands one of the (at most) P it filled
    assert ex.max_in_flight == pp


def test_aborting_an_in_flight_request_waits_for_its_batch():
    engine, sched, ex = make(max_num_batched_tokens=64)
    add(engine, "a", list(range(9)), max_tokens=10)
    add(engine, "b", [1, 2], max_tokens=10)
    out_a = sched.schedule()                         # both prefills in batch 1
    out_b = sched.schedule()                         # both in flight: no batch
    assert ids(out_a) == ["a", "b"] and out_b.is_empty and sched.num_in_flight == 1
    used = sched.kv.gpu.num_used
    assert sched.abort("a") and not sched.abort("a")  # deferred (once)
    assert sched.kv.gpu.num_used == used and sched.requests["a"].status is RequestStatus.RUNNING
    res = sched.update(out_a, ToyExecutor().execute_model(out_a))
    assert [r.request_id for r in res.finished] == ["a"]
    assert res.finished[0].status is RequestStatus.FINISHED_ABORTED
    assert not res.finished[0].finished_seqs[0].output_token_ids     # its token never landed
    assert [r.request_id for r in res.updated] == ["b"]
    assert sched.kv.gpu.num_used < used
    assert sched.schedule().finished_request_ids == ["a"]


def test_update_out_of_order_is_an_error():
    engine, sched, ex = make(max_num_seqs=1, max_num_batched_tokens=64)
    add(engine, "a", [1, 2])
    add(engine, "b", [3, 4])
    first, second = sched.schedule(), sched.schedule()
    assert ids(first) == ["a"] and ids(second) == ["b"]
    with pytest.raises(RuntimeError, match="order"):
        sched.update(second, ToyExecutor().execute_model(second))
    sched.update(first, ToyExecutor().execute_model(first))
    sched.update(second, ToyExecutor().execute_model(second))


def test_an_in_flight_request_is_never_preempted():
    # 3 running requests grow into a small pool; the victim must come from outside flight.
    engine, sched, ex = make(max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks=9, watermark=0.0,
                             max_model_len=24)
    reqs = [add(engine, f"r{i}", [i + 1] * 4, max_tokens=14) for i in range(4)]
    in_flight_when_preempted = []
    original = sched._preempt

    def watch(request, out, now, **kw):
        in_flight_when_preempted.append(sched._is_in_flight(request))
        original(request, out, now, **kw)

    sched._preempt = watch
    engine.run_until_done(500)
    assert sched.num_preemptions > 0 and not any(in_flight_when_preempted)
    for r in reqs:
        assert r.finished_seqs[0].output_token_ids == reference_outputs(r.prompt_token_ids, 14, 1, None, True, 24)[0]
    assert sched.kv.gpu.num_used == 0


def test_a_request_whose_victim_flies_waits_instead_of_preempting_itself():
    """Found by the machine (>3,000 examples): when the only victims allowed were those not
    in flight, groups re-prefilling in alternate batches kept preempting themselves (each
    one's preferred victim was the other, always in flight) and the engine never drained."""
    engine, sched, ex = make(max_num_seqs=3, max_num_batched_tokens=12, long_prefill_token_threshold=3,
                             num_gpu_blocks=9, watermark=0.0, victim="least-computed")
    for rid, prompt, n, max_tokens, priority in (
            ("r0", [38, 23, 25, 20, 40, 37, 47, 25, 22], 3, 3, 2), ("r1", [3, 12, 31], 3, 9, 1),
            ("r2", [35, 27, 12, 43, 3, 9, 17, 13, 7, 27, 15, 21, 28], 3, 11, 2), ("r3", [42, 4, 34, 3, 49], 2, 3, 2)):
        engine.add_request(Request(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
                                   priority=priority))
    done = engine.run_until_done(3000)
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2", "r3"] and sched.num_preemptions > 0
    assert [r.request_id for r in done if r.status is RequestStatus.FINISHED_REJECTED] == ["r2"]   # 3 x 6 blocks > 9
    for r in done:
        if r.status is RequestStatus.FINISHED_REJECTED:
            continue
        want = reference_outputs(r.prompt_token_ids, r.params.max_tokens, r.params.n, None, True, 32)
        assert sorted(s.output_token_ids for s in r.finished_seqs) == sorted(want)


def test_stop_string_finish_of_an_in_flight_sequence_is_deferred():
    engine, sched, ex = make(max_num_batched_tokens=64)
    req = add(engine, "a", [1, 2, 3], max_tokens=10)
    out = sched.schedule()
    seq = req.seqs[0]
    sched.finish_sequence(seq, RequestStatus.FINISHED_STOPPED, "stop string")
    assert seq.status is RequestStatus.RUNNING and seq.seq_id in sched.kv.tables
    res = sched.update(out, ToyExecutor().execute_model(out))
    assert req.status is RequestStatus.FINISHED_STOPPED and seq.finish_reason_detail == "stop string"
    assert [r.request_id for r in res.finished] == ["a"] and sched.kv.gpu.num_used == 0


def test_threaded_executor_gives_the_same_tokens():
    outs = {}
    for threaded in (False, True):
        engine, sched, ex = make(max_num_seqs=3, max_num_batched_tokens=16, threaded=threaded)
        reqs = [add(engine, f"r{i}", list(range(i, i + 7)), max_tokens=9) for i in range(7)]
        try:
            engine.run_until_done(500)
        finally:
            ex.shutdown()
        outs[threaded] = [r.finished_seqs[0].output_token_ids for r in reqs]
    assert outs[False] == outs[True]


def test_no_event_skipping_while_batches_fly():
    from core.sched.event_skipping import steady_decode_horizon
    engine, sched, ex = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(2):
        add(engine, f"r{i}", [i + 1] * 3, max_tokens=20)
    out = sched.schedule()
    sched.update(out, ToyExecutor().execute_model(out))   # both prefilled, nothing flies: steady
    assert steady_decode_horizon(sched) > 0
    sched.schedule()                                      # now a batch flies: its requests have
    assert steady_decode_horizon(sched) == 0              # nothing pending, so no span can start


def test_pipelined_engine_needs_an_async_executor():
    sched = Scheduler(SchedulerConfig(max_model_len=32), CacheConfig(block_size=4, num_gpu_blocks=16), PolicySet())
    with pytest.raises(TypeError, match="execute_model_async"):
        EngineCore(sched, ToyExecutor(), max_concurrent_batches=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        SchedulerConfig(pipeline_parallel_size=0).validate(CacheConfig(num_gpu_blocks=1000))


def test_stage_layers_and_pipeline_kv_capacity():
    assert pipeline_stage_layers(30, 2) == [15, 15]
    assert pipeline_stage_layers(10, 3) == [4, 3, 3]
    assert pipeline_stage_layers(30, 3, "10,12,8") == [10, 12, 8]
    for bad, msg in (("10,10", "2 stages"), ("10,x,10", "comma-separated"), ("0,20,10", "at least one"),
                     ("10,10,11", "covers 31")):
        with pytest.raises(ValueError, match=msg):
            pipeline_stage_layers(30, 3, bad)
    with pytest.raises(ValueError, match="cannot be split"):
        pipeline_stage_layers(2, 3)
    # The stage with more layers bounds the pipeline; a stage with less memory may too.
    gib = 2**30
    args = dict(block_size=16, num_kv_heads=8, head_dim=128, dtype_bytes=2, tp=2)
    per_layer = kv_blocks_per_rank(gib, num_layers=1, **args)
    assert kv_blocks_per_pipeline(gib, stage_layers=[4, 3, 3], **args) == kv_blocks_per_rank(gib, num_layers=4, **args)
    assert kv_blocks_per_pipeline([gib, gib / 4], stage_layers=[2, 2], **args) == per_layer // 8


# -- the scheduler machine with batches in flight ---------------------------------------------

class PipelinedSchedulerMachine(InFlightRules, SchedulerMachine):
    """SchedulerMachine's load, budgets, FCFS, liveness and output equality (every request
    ends with exactly the tokens of an unpreempted one-batch-at-a-time run), with up to
    P = 2 or 3 batches in flight: rules schedule a new batch or update the oldest in any
    interleaving, and aborts hit in-flight requests too. The teardown drains through
    EngineCore's batch queue."""

    @initialize(**SETUP, pp=st.integers(2, 3))
    def setup(self, pp, **kw):
        SchedulerMachine.setup(self, pp=pp, **kw)
        self.pp = pp
        self.flight: deque = deque()     # (out, {seq_id: block table at submission}), oldest first
        # Every schedule() call with what _check_step needs: (out, busy before, free blocks after).
        self.schedules: list = []
        schedule = self.sched.schedule

        def logged_schedule(*args, **kwargs):
            busy = bool(self.sched.running or self.sched.swapped)
            out = schedule(*args, **kwargs)
            self.schedules.append((out, busy, self.sched.kv.stats().num_free_gpu_blocks))
            return out

        self.sched.schedule = logged_schedule
        # One clock for the engine's calls and the machine's own (timestamps stay ordered).
        ticks = itertools.count()
        self.engine.clock = lambda: float(next(ticks))

    step = None                          # replaced by the rules below

    def make_executor(self):
        # batches compute when they land, and their inputs must not change in flight
        return WatermarkProbe(self.sched.kv)

    @rule()
    def engine_step(self):
        """EngineCore.step(): fill up to P batches in flight, land the oldest. Batches the
        machine scheduled itself are older: they land first (FIFO)."""
        if self.flight:
            return
        first = len(self.schedules)
        self.finished.extend(self.engine.step().finished)
        for out, busy, free in self.schedules[first:]:
            if not out.is_empty:
                self.busy_before_step = busy
                self.executor.free_during.append(free)
                self._check_step(out)

    # (no preconditions: a rule with nothing to do is a no-op, which keeps every draw valid)
    @rule()
    def schedule_batch(self):
        if len(self.flight) + self.engine.num_in_flight >= self.pp:
            return
        sched = self.sched
        self.busy_before_step = bool(sched.running or sched.swapped)
        before = sched.num_in_flight
        out = sched.schedule(self.engine.clock())
        if out.is_empty and self.flight:
            assert sched.num_in_flight == before, "an empty output counted as a batch"
            return
        if out.is_empty:                 # nothing flies: an empty step, as with P = 1
            self.finished.extend(sched.update(out, ModelRunnerOutput(token_ids={}), self.engine.clock()).finished)
            return
        self.executor.free_during.append(sched.kv.stats().num_free_gpu_blocks)
        self._check_step(out)
        event(f"batches in flight={len(self.flight) + 1}")
        self.flight.append((out, {s.seq_id: list(s.block_table) for s in out.scheduled}))

    @rule()
    def fill_pipeline(self):
        """What EngineCore.step() does first: schedule until P fly or nothing is left."""
        while len(self.flight) + self.engine.num_in_flight < self.pp:
            before = len(self.flight)
            self.schedule_batch()
            if len(self.flight) == before:
                break

    @rule()
    def update_oldest(self):
        if self.engine.num_in_flight:    # the engine's batches are the oldest
            self.finished.extend(self.engine.land_oldest().finished)
            return
        if not self.flight:
            return
        out, _ = self.flight.popleft()
        result = ToyExecutor().execute_model(out)
        self.finished.extend(self.sched.update(out, result, self.engine.clock()).finished)

    @invariant()
    def in_flight_requests_are_untouched(self):
        if not hasattr(self, "flight"):
            return
        engine_batches = self.engine.num_in_flight
        assert self.sched.num_in_flight == len(self.flight) + engine_batches
        # At most P batches in flight, counting EngineCore's own (its fill() included).
        assert len(self.flight) + engine_batches <= self.pp
        assert self.executor.max_in_flight <= self.pp, f"{self.executor.max_in_flight} batches in flight, P = {self.pp}"
        seen: set[str] = set()
        tables = self.sched.kv.tables
        for out, snapshot in self.flight:
            batch = {s.seq.request.request_id for s in out.scheduled}
            assert not batch & seen, f"requests {batch & seen} are in two in-flight batches"
            seen |= batch
            for s in out.scheduled:
                req = s.seq.request
                # Never preempted, finished or freed while flying (an abort waits for the update).
                assert req.status is RequestStatus.RUNNING and s.seq.status is RequestStatus.RUNNING, req
                assert tables.get(s.seq_id) == snapshot[s.seq_id], f"{s.seq} lost or changed its blocks in flight"

    def teardown(self):
        if not hasattr(self, "flight"):
            return
        while self.flight or self.engine.num_in_flight:
            self.update_oldest()
        SchedulerMachine.teardown(self)
        assert self.executor.max_in_flight <= self.pp
        self.check_stopped_outputs()


TestPipelinedSchedulerMachine = PipelinedSchedulerMachine.TestCase
