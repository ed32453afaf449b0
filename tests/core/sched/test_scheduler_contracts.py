"""Scheduler contracts the state machines did not reach: beams in lock-step when the budget
is short, whole prompts without chunked prefill, the prefill token count of a step,
swapped requests before new ones, slices a priority victim gives back under vLLM v1's
rules, and the queue time of a request that waits twice. Each test here was written against a mutation no other core test caught
(tests/mutation_sweep.py)."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings, strategies as st

from core import CacheConfig, ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig
from policies import PolicySet
from tests.core.kv_checking import KVCheckingExecutor
from tests.core.sched.test_scheduler import make_engine
from tests.core.toy_executor import ToyExecutor, reference_outputs


@given(pendings=st.lists(st.integers(1, 20), min_size=1, max_size=4), budget=st.integers(1, 60))
def test_beams_either_all_reach_their_end_or_none_does(pendings, budget):
    seqs = [SimpleNamespace(token_ids=[0] * (10 + p), num_computed_tokens=10) for p in pendings]
    plan = Scheduler._plan_beams(seqs, budget)
    assert sum(n for _, n in plan) <= budget
    ends = [n == len(s.token_ids) - s.num_computed_tokens for s, n in plan]
    if any(ends):
        assert all(ends) and len(plan) == len(seqs)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_whole():
    engine, sched, ex = make_engine(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False,
                                    block_size=4, num_gpu_blocks=32)
    for rid in "ac":
        engine.add_request(Request(rid, [1, 2], SamplingParams(max_tokens=20, ignore_eos=True)))
    engine.step()
    engine.add_request(Request("b", list(range(31)), SamplingParams(max_tokens=1, ignore_eos=True)))
    engine.step()                                  # two decodes take 2 of the 32 tokens: b does not fit whole
    assert [(s.seq.request.request_id, s.num_tokens) for s in ex.steps[-1].scheduled] == [("a", 1), ("c", 1)]
    engine.run_until_done(100)
    assert [s.num_tokens for out in ex.steps for s in out.scheduled if s.seq.request.request_id == "b"] == [31]


def test_a_step_counts_its_prefill_tokens():
    engine, sched, ex = make_engine(max_num_batched_tokens=8, max_model_len=64, block_size=4, num_gpu_blocks=64)
    engine.add_request(Request("short", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    engine.step()
    engine.add_request(Request("long", list(range(30)), SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()
    out = ex.steps[-1]
    assert (out.num_batched_tokens, out.num_prefill_tokens) == (8, 7)      # 1 decode + a 7-token chunk
    assert (ex.steps[0].num_batched_tokens, ex.steps[0].num_prefill_tokens) == (3, 3)


class _SwapOrderProbe(ToyExecutor):
    """Records, per step, whether it admitted a request while another was still swapped out."""

    def __init__(self, kv):
        super().__init__()
        self.sched = None
        self.admitted_past_swapped = 0
        self.steps_with_both_waiting = 0

    def execute_model(self, out):
        if self.sched.swapped and len(self.sched.waiting):
            self.steps_with_both_waiting += 1
        if out.admitted and self.sched.swapped:
            self.admitted_past_swapped += 1
        return super().execute_model(out)


def test_swapped_requests_come_back_before_waiting_ones_are_admitted():
    engine, sched, ex = make_engine(_SwapOrderProbe, max_num_batched_tokens=64, max_model_len=32, block_size=4,
                                    num_gpu_blocks=12, num_cpu_blocks=32, watermark=0.0,
                                    preemption="swap")
    ex.sched = sched
    reqs = [engine.add_request(Request(f"r{i}", [i + 1] * 10, SamplingParams(max_tokens=16, ignore_eos=True)))
            for i in range(4)]
    for step in range(400):
        if step % 6 == 5 and len(reqs) < 12:      # new small requests keep arriving
            reqs.append(engine.add_request(Request(f"n{step}", [50 + step % 7] * 2,
                                                   SamplingParams(max_tokens=3, ignore_eos=True))))
        engine.step()
        if not engine.has_unfinished_requests():
            break
    assert sched.num_swaps > 0 and ex.steps_with_both_waiting > 0       # the case arose
    assert ex.admitted_past_swapped == 0
    for r in reqs:
        assert r.finished_seqs[0].output_token_ids == reference_outputs(
            r.prompt_token_ids, r.params.max_tokens, 1, None, True, 32)[0]


PREFIXES = [[], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(range(len(PREFIXES))), st.lists(st.integers(10, 40), max_size=9),
                          st.integers(0, 3), st.integers(1, 10), st.integers(0, 3)), min_size=2, max_size=10),
       st.integers(8, 14))
def test_vllm_v1_priority_victims_give_back_slices_whose_kv_was_never_written(workload, blocks):
    """Under vLLM v1's priority rules an already scheduled request may be the victim: it
    gives its slice back, and the blocks that slice published must leave the prefix cache
    (a later hit would read KV never computed; the KV-checking worker reads every slot)."""
    engine, sched, ex = make_engine(KVCheckingExecutor, max_num_batched_tokens=16, max_model_len=32,
                                    max_num_seqs=4, block_size=4, num_gpu_blocks=blocks,
                                    enable_prefix_caching=True, watermark=0.0,
                                    scheduler="vllm-v1", queue="priority")
    reqs, pending = [], sorted(enumerate(workload), key=lambda item: item[1][4])     # by arrival step
    for step in range(2000):
        while pending and pending[0][1][4] <= step:
            i, (prefix, tail, priority, max_tokens, _) = pending.pop(0)
            prompt = (PREFIXES[prefix] + tail)[:24] or [10]
            reqs.append(engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                                                   ignore_eos=True),
                                                   priority=priority)))
        if not pending and not engine.has_unfinished_requests():
            break
        engine.step()
    for r in reqs:
        assert r.finished_seqs[0].output_token_ids == reference_outputs(
            r.prompt_token_ids, r.params.max_tokens, 1, None, True, 32)[0]


def test_a_vllm_v1_priority_victim_gives_back_a_slice_that_published_blocks():
    """The low-priority request's decode would fill (and so publishes) a block at schedule
    time; the high-priority request then lacks a block, and the victim is the low one,
    already scheduled: its slice is taken back, and the block it published must leave the
    prefix-cache index, whose every block holds KV a step wrote. (Under LRU the block is
    evicted first, so no later read would show it: the index is checked after each step.)"""
    engine, sched, ex = make_engine(KVCheckingExecutor, max_num_batched_tokens=6, max_model_len=32, max_num_seqs=4,
                                    block_size=4, num_gpu_blocks=9, enable_prefix_caching=True, watermark=0.0,
                                    scheduler="vllm-v1", queue="priority")
    low = engine.add_request(Request("low", list(range(100, 124)), SamplingParams(max_tokens=6, ignore_eos=True),
                                     priority=5))
    engine.step()
    high = engine.add_request(Request("high", list(range(7)), SamplingParams(max_tokens=20, ignore_eos=True),
                                      priority=0))
    for _ in range(200):
        engine.step()
        for block in sched.kv.gpu.cached.values():
            assert all(block * 4 + offset in ex.gpu for offset in range(4)), f"block {block} indexed, never written"
        if not engine.has_unfinished_requests():
            break
    taken_back = [out for out in ex.steps if low in out.preempted]
    assert len(taken_back) == 1 and low not in {s.seq.request for s in taken_back[0].scheduled}
    for r in (low, high):
        assert r.finished_seqs[0].output_token_ids == reference_outputs(
            r.prompt_token_ids, r.params.max_tokens, 1, None, True, 32)[0]


def _step(sched, now):
    out = sched.schedule(now)
    sched.update(out, ModelRunnerOutput(token_ids={s.seq.seq_id: [1] for s in out.scheduled if s.num_samples}), now)
    return out


def test_queue_time_adds_every_wait_in_the_queue_preemptions_included():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32),
                      CacheConfig(block_size=4, num_gpu_blocks=16), PolicySet.from_names())
    a = sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=1.0))
    b = sched.add_request(Request("b", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=1.5))
    now = 2.0
    while b not in _step(sched, now).admitted:      # one sequence at a time: b waits for a
        now += 1.0
    assert a.metrics.queue_time == 1.0                # arrived at 1.0, admitted at 2.0
    assert b.metrics.queue_time == now - 1.5 == 3.5   # admitted at 5.0, after a's three steps


def test_a_recomputed_request_counts_its_second_wait_too():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32),
                      CacheConfig(block_size=4, num_gpu_blocks=12, watermark=0.0), PolicySet.from_names())
    reqs = [sched.add_request(Request(f"r{i}", [i + 1] * 10, SamplingParams(max_tokens=16, ignore_eos=True)))
            for i in range(4)]
    queued_since = {r.request_id: 0.0 for r in reqs}
    waited = dict.fromkeys(queued_since, 0.0)
    now = 1.0
    while sched.has_unfinished_requests():
        out = _step(sched, now)
        for r in out.preempted:
            queued_since[r.request_id] = now
        for r in out.admitted:
            waited[r.request_id] += now - queued_since[r.request_id]
        now += 1.0
    assert sched.num_preemptions > 0
    assert {r.request_id: r.metrics.queue_time for r in reqs} == waited


def test_an_empty_schedule_with_a_batch_in_flight_passes_its_finished_ids_on():
    """Workers drop a request's state when its id comes in a batch's finished ids: an id
    that finished while the only runnable request was in flight (no batch to carry it)
    must reach the next batch."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32,
                                      pipeline_parallel_size=2),
                      CacheConfig(block_size=4, num_gpu_blocks=16), PolicySet.from_names())
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
    sched.add_request(Request("b", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True)))
    first = sched.schedule()
    assert [s.seq.request.request_id for s in first.scheduled] == ["a"]      # one seat per batch
    assert sched.abort("b")                                                   # b leaves from the queue
    empty = sched.schedule()                                                  # a is in flight: nothing to run
    assert empty.is_empty and empty.finished_request_ids == []
    sched.update(first, ModelRunnerOutput(token_ids={first.scheduled[0].seq.seq_id: [1]}))
    assert "b" in sched.schedule().finished_request_ids
