"""Async scheduling: step N+1 is scheduled while step N computes, and a sequence whose
token from N is not known yet decodes it as a placeholder the worker fills in.

The executor here is a worker on the far side of the step messages (the real
ModelRunner's state code, provisional tokens on) that computes each step the moment it
is submitted, before the engine has seen the previous step's tokens: the situation async
scheduling creates. It checks the paged KV cache as a model would use it: every slot a
step writes holds the fingerprint of the token prefix it encodes, and every slot a step's
attention reads (positions [0, end) through the sequence's block table) must hold its own
prefix's, so a block freed, reused, published or swapped too early shows up as a wrong
read. Tokens are a pure function of the history (tests/core/toy_executor.py), so every
request must end with exactly the tokens of an unpreempted one-batch-at-a-time run.
"""
from __future__ import annotations


import pytest
from hypothesis import event, settings
from hypothesis.stateful import initialize, invariant

from core import CacheConfig, EngineCore, Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from core.step_message import NewRequest, NewSeq, SeqDelta, StepMessage, params_to_plain
from policies import PolicySet
from realexec.worker.model_runner import ModelRunner
from tests.core.kv_checking import KVCheckingExecutor
from tests.core.sched.test_scheduler import BS, EOS, MAX_MODEL_LEN, SETUP, InFlightRules, SchedulerMachine
from tests.core.toy_executor import reference_outputs


def make(async_scheduling: bool = True, **kw):
    cache_kw = {k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__}
    policy_kw = {k: kw.pop(k) for k in list(kw) if k in ("queue", "preemption", "victim", "eviction", "scheduler")}
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    cache_kw.setdefault("block_size", BS)
    cache_kw.setdefault("num_gpu_blocks", 64)
    sched = Scheduler(SchedulerConfig(async_scheduling=async_scheduling, **kw), CacheConfig(**cache_kw),
                      PolicySet.from_names(**policy_kw))
    ex = KVCheckingExecutor(sched.kv)
    return EngineCore(sched, ex, max_concurrent_batches=2 if async_scheduling else 1), sched, ex


def add(engine, name, prompt, max_tokens=8, **params):
    params.setdefault("ignore_eos", True)
    return engine.add_request(Request(name, prompt, SamplingParams(max_tokens=max_tokens, **params),
                                      eos_token_id=EOS))


def slices(ex, request):
    return [(s.start, s.num_tokens) for out in ex.steps for s in out.scheduled if s.seq.request is request]


def expected(request):
    p = request.params
    return reference_outputs(request.prompt_token_ids, p.max_tokens, p.n, EOS, p.ignore_eos, MAX_MODEL_LEN)


# -- targeted behaviour ---------------------------------------------------------------------

def test_decodes_overlap_their_batch_in_flight():
    engine, sched, ex = make(max_num_batched_tokens=64)
    a = add(engine, "a", [1, 2, 3, 4, 5])
    b = add(engine, "b", [6, 7, 8])
    engine.run_until_done(100)
    # The first step's prefills are in flight when the second is scheduled: both requests
    # decode the token they are sampling there, and every step after holds both again.
    assert [len(out.scheduled) for out in ex.steps] == [2] * 8
    assert slices(ex, a) == [(0, 5)] + [(p, 1) for p in range(5, 12)]
    assert ex.placeholders == 14
    for r in (a, b):
        assert r.finished_seqs[0].output_token_ids == expected(r)[0]
    assert sched.kv.gpu.num_used == 0


def test_no_decode_is_scheduled_past_the_length_limit():
    engine, sched, ex = make(max_num_batched_tokens=64)
    r = add(engine, "r", [1, 2, 3], max_tokens=3)
    engine.run_until_done(50)
    # Prefill samples token 1, two decodes sample tokens 2 and 3: none beyond.
    assert slices(ex, r) == [(0, 3), (3, 1), (4, 1)]
    assert r.finished_seqs[0].output_token_ids == expected(r)[0]


def test_a_token_computed_after_the_end_is_dropped():
    prompt = [1, 2, 3, 4]
    ref = reference_outputs(prompt, 8, 1, None, True, MAX_MODEL_LEN)[0]
    eos = ref[2]                          # the third output token ends it (EOS)
    assert eos not in ref[:2], "the prompt must give a third token that is new"
    engine, sched, ex = make(max_num_batched_tokens=64)
    r = engine.add_request(Request("r", prompt, SamplingParams(max_tokens=8), eos_token_id=eos))
    engine.run_until_done(50)
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.finished_seqs[0].output_token_ids == ref[:3]
    # The decode of the EOS token was already scheduled when it was sampled: computed, dropped.
    assert slices(ex, r) == [(0, 4), (4, 1), (5, 1), (6, 1)]
    assert sched.kv.gpu.num_used == 0 and not sched.kv.tables


def test_a_stop_string_match_waits_for_the_batch_and_stops_the_overlap():
    engine, sched, ex = make(max_num_batched_tokens=64)
    r = add(engine, "r", [1, 2, 3], max_tokens=20)
    engine.step()                         # lands the prefill; the first decode is in flight
    seq = r.seqs[0]
    sched.finish_sequence(seq, RequestStatus.FINISHED_STOPPED, "stop")     # deferred: in flight
    assert seq.status is RequestStatus.RUNNING
    engine.run_until_done(20)
    assert r.status is RequestStatus.FINISHED_STOPPED
    # Nothing more was scheduled once the finish was waiting; the in-flight token is not kept.
    assert slices(ex, r) == [(0, 3), (3, 1)]
    assert seq.output_token_ids == expected(r)[0][:1]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_recomputed_group_keeps_its_prefix_hits(async_scheduling):
    """Hypothesis's find (stop 40): an n = 3 request is preempted by recompute after its
    forks' first blocks filled; on readmission each sequence hits its own cached block,
    and the parent's fresh block must not evict a hit of a later sibling (it did, with or
    without async scheduling: the sibling then read another prefix's KV). Every read is
    checked by the KV-checking worker; every sample equals an unpreempted run's."""
    engine, sched, ex = make(async_scheduling, max_num_seqs=5, max_num_batched_tokens=MAX_MODEL_LEN,
                             num_gpu_blocks=8, enable_prefix_caching=True, preemption="recompute", watermark=0.0)
    a = add(engine, "a", [0, 0, 0, 0], max_tokens=6)
    b = add(engine, "b", [0] * 8, max_tokens=6)
    c = engine.add_request(Request("c", [0, 0, 0], SamplingParams(max_tokens=3, n=3), eos_token_id=EOS))
    engine.run_until_done(200)
    assert sched.num_preemptions > 0 and sched.kv.stats().prefix_cache_hits > 0
    for r in (a, b, c):
        assert sorted(s.output_token_ids for s in r.finished_seqs) == sorted(expected(r))
    assert sched.kv.gpu.num_used == 0


def test_a_victim_in_flight_is_recomputed_even_under_swap():
    engine, sched, ex = make(max_num_batched_tokens=32, num_gpu_blocks=8, num_cpu_blocks=32, watermark=0.0,
                             preemption="swap")
    reqs = [add(engine, f"r{i}", [i + 1] * 6, max_tokens=12) for i in range(3)]
    engine.run_until_done(500)
    assert sched.num_preemptions > 0 and sched.num_swaps == 0
    for r in reqs:
        assert r.finished_seqs[0].output_token_ids == expected(r)[0]
    assert sched.kv.gpu.num_used == 0 and sched.kv.cpu.num_used == 0


def test_forked_samples_overlap_and_beams_wait_for_their_batch():
    engine, sched, ex = make(max_num_batched_tokens=64)
    n3 = add(engine, "n3", [1, 2, 3], max_tokens=6, n=3)
    beam = engine.add_request(Request("beam", [4, 5, 6], SamplingParams(beam_width=2, max_tokens=5, temperature=0.0),
                                      eos_token_id=EOS))
    overlapped = []             # requests scheduled while a batch holding them was in flight
    schedule = sched.schedule

    def watched(now=0.0):
        flying = sched._in_flight_requests() if sched.num_in_flight else set()
        out = schedule(now)
        overlapped.extend(s.seq.request.request_id for s in out.scheduled if s.seq.request in flying)
        return out

    sched.schedule = watched
    engine.run_until_done(100)
    assert sorted(s.output_token_ids for s in n3.finished_seqs) == sorted(expected(n3))
    assert beam.status.finished and len(beam.finished_seqs) == 2
    assert "beam" not in overlapped
    # Before its fork n3 waits too (its children appear when its batch lands); then its
    # three samples decode ahead, each one.
    assert overlapped.count("n3") >= 3 and overlapped.count("n3") % 3 == 0


def test_an_abort_in_flight_stops_the_overlap_and_frees_everything():
    engine, sched, ex = make(max_num_batched_tokens=64)
    r = add(engine, "r", [1, 2, 3], max_tokens=20)
    other = add(engine, "o", [4, 5], max_tokens=6)
    engine.step()
    assert sched.abort("r")
    engine.run_until_done(50)
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert len(slices(ex, r)) == 2
    assert other.finished_seqs[0].output_token_ids == expected(other)[0]
    assert sched.kv.gpu.num_used == 0


class VictimInFlight:
    """Two 4-token prompts a and b fill a 2-block pool in the first step; while it flies, a's
    decode needs a block and b, in flight, is the victim of the second. `before_second`
    runs between the two schedules. Then `land_first()` and `land_second()` update them."""

    def __init__(self, b_max_tokens: int = 3, before_second=None):
        self.engine, self.sched, self.ex = make(max_num_batched_tokens=64, num_gpu_blocks=2, watermark=0.0,
                                                max_model_len=8)
        self.a = add(self.engine, "a", [1, 2, 3, 4], max_tokens=3)
        self.b = add(self.engine, "b", [5, 6, 7, 8], max_tokens=b_max_tokens)
        self.first = self.sched.schedule(0.0)
        self._first = self.ex.execute_model_async(self.first)
        if before_second is not None:
            before_second(self)
        self.second = self.sched.schedule(1.0)
        assert self.second.preempted == [self.b]
        self._second = self.ex.execute_model_async(self.second)

    def land_first(self):
        return self.sched.update(self.first, self._first.result(), 2.0)

    def land_second(self):
        return self.sched.update(self.second, self._second.result(), 3.0)


def test_an_aborted_request_preempted_in_flight_leaves_the_queue_when_its_batch_lands():
    def abort_b(v):
        assert v.sched.abort("b")                  # in flight: waits for its batch

    v = VictimInFlight(before_second=abort_b)
    b, sched = v.b, v.sched
    assert b.status is RequestStatus.WAITING
    v.land_first()                                 # the deferred abort applies to a queued request
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert b not in list(sched.waiting) and sched.num_waiting == 0
    v.land_second()
    v.engine.run_until_done(20)
    assert v.a.status is RequestStatus.FINISHED_LENGTH and len(v.a.finished_seqs[0].output_token_ids) == 3
    assert sched.kv.gpu.num_used == 0


def test_a_victim_preempted_in_flight_keeps_the_token_its_batch_samples():
    # vLLM's AsyncScheduler delivers it too: the readmitted request recomputes with it.
    v = VictimInFlight()
    b, sched = v.b, v.sched
    v.land_first()
    assert b.status is RequestStatus.WAITING and b in list(sched.waiting)
    assert b.seqs[0].token_ids == [5, 6, 7, 8, expected(b)[0][0]] and b.seqs[0].num_computed_tokens == 0
    v.land_second()
    v.engine.run_until_done(30)
    for r in (v.a, b):
        assert r.finished_seqs[0].output_token_ids == expected(r)[0]
    assert slices(v.ex, b)[1] == (0, 5)            # readmitted: the prompt and the kept token
    assert sched.kv.gpu.num_used == 0


def test_a_kept_token_that_ends_a_preempted_request_takes_it_out_of_the_queue():
    v = VictimInFlight(b_max_tokens=1)
    b, sched = v.b, v.sched
    done = v.land_first().finished
    assert b in done and b.status is RequestStatus.FINISHED_LENGTH
    assert b.finished_seqs[0].output_token_ids == expected(b)[0]
    assert b not in list(sched.waiting) and sched.num_waiting == 0
    v.land_second()
    v.engine.run_until_done(30)
    assert v.a.finished_seqs[0].output_token_ids == expected(v.a)[0] and sched.kv.gpu.num_used == 0


def test_the_worker_confirms_provisional_tokens_in_place():
    runner = ModelRunner(None, "cpu", BS, None, provisional_tokens=True)
    runner.update_states(StepMessage(new_requests=[NewRequest("r", params_to_plain(SamplingParams()), None)],
                                     new_seqs=[NewSeq(0, "r", [1, 2, 3], 3, [0])]))
    seq = runner.seqs[0]
    seq.token_ids.extend([9, 10])              # sampled by the last two steps, not confirmed yet
    runner.update_states(StepMessage(cached_seqs=[SeqDelta(0, [9], [])]))
    assert seq.token_ids == [1, 2, 3, 9, 10] and seq.num_confirmed == 4
    # The engine dropped 10 (the sequence was preempted) and later confirmed another token there.
    runner.update_states(StepMessage(cached_seqs=[SeqDelta(0, [7], [1], resumed=True)]))
    assert seq.token_ids == [1, 2, 3, 9, 7] and seq.num_confirmed == 5 and seq.block_ids == [1]


def test_async_scheduling_with_pipeline_stages_is_a_config_error():
    with pytest.raises(ValueError, match="async scheduling"):
        SchedulerConfig(async_scheduling=True, pipeline_parallel_size=2).validate(CacheConfig(num_gpu_blocks=64))


# -- the stateful machine ---------------------------------------------------------------------

class AsyncSchedulerMachine(InFlightRules, SchedulerMachine):
    """SchedulerMachine's workload, budgets, policies, FCFS, liveness and output equality,
    under async scheduling, through the KV-checking worker; plus stop strings applied from
    outside while batches fly, and every live sequence's prefix-cache hash chain."""

    @initialize(**SETUP)
    def setup(self, **kw):
        SchedulerMachine.setup(self, async_scheduling=True, **kw)
        self.victims_in_flight = 0
        preempt = self.sched._preempt

        def counted(request, out, now, recompute=False):
            self.victims_in_flight += recompute
            preempt(request, out, now, recompute)

        self.sched._preempt = counted

    def make_executor(self):
        return KVCheckingExecutor(self.sched.kv)

    @invariant()
    def hash_chains_hold_known_tokens(self):
        if not hasattr(self, "sched") or not self.cache.enable_prefix_caching:
            return
        kv = self.sched.kv
        for r in self.sched.running:
            for seq in r.seqs:
                parent = None
                for i, h in enumerate(seq.block_hashes):
                    block = seq.token_ids[i * BS:(i + 1) * BS]
                    assert len(block) == BS, f"seq {seq.seq_id}: block {i} hashed before its tokens were known"
                    parent = kv.hash_block(parent, tuple(block), r.cache_salt if i == 0 else None)
                    assert h == parent, f"seq {seq.seq_id}: block {i}'s hash is not its tokens'"

    @invariant()
    def at_most_two_batches_fly(self):
        if hasattr(self, "sched"):
            assert self.sched.num_in_flight <= 2

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        SchedulerMachine.teardown(self)
        event(f"placeholders={min(self.executor.placeholders, 1)}")
        event(f"victims in flight={min(self.victims_in_flight, 1)}")
        self.check_stopped_outputs()


AsyncSchedulerMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
