"""The scheduler under random load, with a deterministic toy executor.

Because the toy executor's next token depends only on a sequence's tokens, every
schedule (batched, chunked, preempted by recompute or swap) must produce exactly the
outputs of an unpreempted run; budgets, FCFS order and liveness are checked too.
"""
from __future__ import annotations

import pytest
from hypothesis import event, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core import CacheConfig, EngineCore, InvalidRequestError, Request, RequestStatus, SamplingParams, Scheduler, \
    SchedulerConfig
from policies import PolicySet
from tests.core.kv_checking import KVCheckingExecutor
from tests.core.toy_executor import VOCAB, AsyncToyExecutor, ToyExecutor, reference_outputs

BS = 4
MAX_MODEL_LEN = 32
EOS = 3


def _pool_consistent(kv):
    spares = kv.spare_regions() if hasattr(kv, "spare_regions") else []
    for pool, tables in ((kv.gpu, kv.tables), (kv.cpu, kv.cpu_tables)):
        holders = [0] * pool.num_blocks
        for t in list(tables.values()) + (spares if pool is kv.gpu else []):
            for b in t:
                holders[b] += 1
        assert holders == pool.ref_cnt, f"{pool.name} refcounts differ from table membership"
        assert sum(r > 0 for r in pool.ref_cnt) + pool.num_free == pool.num_blocks


def solo_beam_result(prompt, params):
    """Reference for beam search: the same request alone in a roomy engine."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN),
                      CacheConfig(block_size=BS, num_gpu_blocks=256), PolicySet())
    engine = EngineCore(sched, ToyExecutor())
    req = engine.add_request(Request("solo", prompt, params, eos_token_id=EOS))
    engine.run_until_done(10_000)
    return [(s.output_token_ids, round(s.cum_logprob, 9)) for s in req.finished_seqs]


# What each victim policy promises, restated independently of policies/preemption.py.
VICTIM_ORACLE = {
    "newest": lambda cands: max(cands, key=lambda r: r.arrival_index),
    "lowest-priority": lambda cands: max(cands, key=lambda r: (r.priority, r.arrival_index)),
    "least-computed": lambda cands: min(cands, key=lambda r: (sum(s.num_computed_tokens for s in r.seqs),
                                                              -r.arrival_index)),
}


class CheckedVictim:
    """Wraps the registered victim policy: every choice must be the one its name promises."""

    def __init__(self, name: str):
        self.inner = PolicySet.from_names(victim=name).victim
        self.name = name
        self.choices = 0

    def select(self, candidates):
        chosen = self.inner.select(candidates)
        want = VICTIM_ORACLE[self.name](candidates)
        assert chosen is want, f"{self.name} victim policy chose {chosen} among {candidates}, not {want}"
        self.choices += 1
        return chosen


class WatermarkProbe(AsyncToyExecutor):
    """Records the free GPU blocks while each step runs (after schedule(), before update());
    batches compute when they land (the pipelined machine's executor)."""

    def __init__(self, kv):
        super().__init__()
        self.kv = kv
        self.free_during: list[int] = []

    def execute_model(self, out):
        self.free_during.append(self.kv.stats().num_free_gpu_blocks)
        return super().execute_model(out)


SETUP = dict(
    max_num_seqs=st.integers(1, 8), budget=st.integers(4, 48), extra_blocks=st.integers(0, 10),
    num_cpu=st.integers(0, 24), chunked=st.booleans(), caching=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap", "auto"]),
    queue=st.sampled_from(["fcfs", "priority", "sjf", "lpm"]),
    victim=st.sampled_from(["newest", "lowest-priority", "least-computed"]),
    allocation=st.sampled_from(["paged", "paged", "paged", "orca-oracle", "orca-pow2", "orca-max"]),
    long_prefill=st.sampled_from([0, 0, 3, 9]), watermark=st.sampled_from([0.0, 0.1, 0.25, 0.25]),
)


class SchedulerMachine(RuleBasedStateMachine):
    """One batch at a time (pp = 1); tests/core/test_pipelined.py runs it with batches in flight."""

    @initialize(**SETUP)
    def setup(self, max_num_seqs, budget, extra_blocks, num_cpu, chunked, caching, preemption, queue, victim,
              allocation, long_prefill, watermark, pp=1, async_scheduling=False):
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)
            if long_prefill:
                # A per-step prefill cap without chunking would leave long prompts waiting forever.
                with pytest.raises(ValueError, match="needs chunked prefill"):
                    SchedulerConfig(max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                                    enable_chunked_prefill=False,
                                    long_prefill_token_threshold=long_prefill).validate(CacheConfig(num_gpu_blocks=64))
                long_prefill = 0
        self.cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=chunked,
                                   long_prefill_token_threshold=long_prefill, pipeline_parallel_size=pp,
                                   async_scheduling=async_scheduling)
        self.cache = CacheConfig(block_size=BS, num_gpu_blocks=MAX_MODEL_LEN // BS + extra_blocks,
                                 num_cpu_blocks=num_cpu, enable_prefix_caching=caching, watermark=watermark)
        self.victim, self.queue = victim, queue
        policies = PolicySet.from_names(queue=queue, preemption=preemption, allocation=allocation)
        policies.victim = self.checked_victim = CheckedVictim(victim)
        self.sched = Scheduler(self.cfg, self.cache, policies)
        self.executor = self.make_executor()
        self.engine = EngineCore(self.sched, self.executor, max_concurrent_batches=2 if async_scheduling else pp)
        self.requests: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.stopped: set[str] = set()     # a sequence finished from outside (the pipelined machine)
        self.first_admitted: list[Request] = []
        self.finished: list[Request] = []
        self.n = 0

    def make_executor(self):
        # checks every KV read (a block reused, hit or published too early reads wrong KV)
        # and records the free blocks while each step runs (the watermark invariant)
        return KVCheckingExecutor(self.sched.kv)

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), max_tokens=st.integers(1, 12),
          n=st.sampled_from([1, 1, 1, 2, 3]), beam=st.sampled_from([0, 0, 0, 0, 2]), priority=st.integers(0, 2),
          ignore_eos=st.booleans(), shared=st.booleans())
    def add_request(self, prompt, max_tokens, n, beam, priority, ignore_eos, shared):
        if shared:   # a common system prompt, so prefix caching has something to find
            prompt = [7, 7, 8, 8, 9, 9, 10, 10] + prompt
        params = SamplingParams(max_tokens=max_tokens, n=1 if beam else n, beam_width=beam, ignore_eos=ignore_eos)
        req = Request(f"r{self.n}", prompt, params, priority=priority, eos_token_id=EOS)
        self.n += 1
        self.engine.add_request(req)
        self.requests[req.request_id] = req

    @rule()
    def step(self):
        self.busy_before_step = bool(self.sched.running or self.sched.swapped)
        result = self.engine.step()
        out = self.executor.steps[-1] if self.executor.steps else None
        self.finished.extend(result.finished)
        if out is not None:
            self._check_step(out)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        if self.engine.abort_request(rid):
            self.aborted.add(rid)

    def _check_step(self, out):
        if out.admitted and self.busy_before_step:
            # Admissions (the last thing schedule() does) leave the watermark free, so
            # running sequences can still grow (an idle engine has nothing to protect).
            assert self.executor.free_during[-1] >= self.sched.kv.watermark_blocks, "admission ate the watermark"
        assert out.num_batched_tokens <= self.cfg.max_num_batched_tokens
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled)
        assert len(out.scheduled) <= self.cfg.max_num_seqs * 1
        assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            assert s.num_tokens >= 1
            assert len(s.block_table) * BS >= s.start + s.num_tokens
            if not self.cfg.enable_chunked_prefill:
                assert s.num_samples or s.seq.request.params.beam_width
            if self.cfg.long_prefill_token_threshold and s.num_tokens > 1 and not s.seq.request.params.beam_width:
                # (beams are planned in lock-step, uncapped)
                assert s.num_tokens <= self.cfg.long_prefill_token_threshold
        for req in out.admitted:
            if req.metrics.num_preemptions == 0 and req not in self.first_admitted:
                self.first_admitted.append(req)

    @invariant()
    def within_limits(self):
        if not hasattr(self, "sched"):
            return
        s = self.sched
        live = sum(len(r.seqs) for r in s.running)
        assert live <= self.cfg.max_num_seqs * self.cfg.pipeline_parallel_size
        _pool_consistent(s.kv)
        for r in s.running:
            assert r.status is RequestStatus.RUNNING
        for r in s.swapped:
            assert r.status is RequestStatus.SWAPPED
        for r in s.waiting:
            assert r.status is RequestStatus.WAITING
            assert all(seq.seq_id not in s.kv.tables for seq in r.seqs)

    @invariant()
    def fcfs_within_priority(self):
        if not hasattr(self, "sched") or self.victim != "newest" or self.queue not in ("fcfs", "priority"):
            return
        by_priority: dict[int, list[int]] = {}
        for r in self.first_admitted:
            by_priority.setdefault(r.priority, []).append(r.arrival_index)
        for order in by_priority.values():
            assert order == sorted(order), f"admission out of FCFS order: {order}"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Liveness: every admissible request finishes; nothing is lost.
        self.finished.extend(self.engine.run_until_done(max_steps=20_000))
        assert not self.sched.has_unfinished_requests()
        ids = [r.request_id for r in self.finished]
        assert sorted(ids) == sorted(self.requests), "a request was lost or reported twice"
        kv = self.sched.kv
        assert kv.gpu.num_used == 0 and kv.cpu.num_used == 0, "blocks leaked"
        assert not (hasattr(kv, "spare_regions") and kv.spare_regions()), "reserved regions leaked"
        assert not kv.tables and not kv.cpu_tables
        event(f"preempted={self.sched.num_preemptions > 0}")
        event(f"swapped={self.sched.num_swaps > 0}")
        event(f"prefix hits={kv.stats().prefix_cache_hits > 0}")
        event(f"beam={any(r.params.beam_width for r in self.finished)}")
        event(f"allocation={self.sched.policies.allocation}")
        event(f"watermark={self.sched.kv.watermark_blocks > 0}")
        event(f"victim choices={min(self.checked_victim.choices, 2)}")
        for req in self.finished:
            if req.request_id in self.aborted:
                assert req.status is RequestStatus.FINISHED_ABORTED
                continue
            if req.request_id in self.stopped:
                continue                   # checked by the machine that stopped it
            if req.status is RequestStatus.FINISHED_REJECTED:
                assert req.reject_reason
                continue
            assert req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            p = req.params
            if p.beam_width:
                got = [(s.output_token_ids, round(s.cum_logprob, 9)) for s in req.finished_seqs]
                assert got == solo_beam_result(req.prompt_token_ids, p)
            else:
                got = sorted(s.output_token_ids for s in req.finished_seqs)
                want = sorted(reference_outputs(req.prompt_token_ids, p.max_tokens, p.n, EOS, p.ignore_eos,
                                                MAX_MODEL_LEN))
                assert got == want, f"{req.request_id} (preempted {req.metrics.num_preemptions}x)"
            m = req.metrics
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


TestSchedulerMachine = SchedulerMachine.TestCase


class InFlightRules:
    """Rules for SchedulerMachine subclasses with batches in flight (pipelined, async): bursts
    of requests, and stop strings applied from outside while batches fly."""

    @rule(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=30), min_size=2, max_size=4),
          max_tokens=st.integers(1, 12))
    def add_burst(self, prompts, max_tokens):
        """Several requests at once: enough separate work for more batches than may fly (an
        engine that overfills its batch queue is caught), and load to preempt requests in flight."""
        for prompt in prompts:
            self.add_request(prompt=prompt, max_tokens=max_tokens, n=1, beam=0, priority=0, ignore_eos=True,
                             shared=False)

    @rule(data=st.data())
    def stop_string(self, data):
        """A detokenizer's stop-string match finishes one live sequence from outside; in
        flight, that waits for its batch's update."""
        live = [seq for r in self.sched.running if not r.params.beam_width for seq in r.seqs]
        if not live:
            return
        seq = data.draw(st.sampled_from(live))
        self.sched.finish_sequence(seq, RequestStatus.FINISHED_STOPPED, "stop string")
        self.stopped.add(seq.request.request_id)

    def check_stopped_outputs(self) -> None:
        """Every sample of a request stopped from outside stopped early or ran to its end: a
        prefix of an unpreempted run's output."""
        for req in self.finished:
            if req.request_id not in self.stopped or req.request_id in self.aborted:
                continue
            p = req.params
            refs = reference_outputs(req.prompt_token_ids, p.max_tokens, p.n, EOS, p.ignore_eos, MAX_MODEL_LEN)
            assert req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            for seq in req.finished_seqs:
                out = seq.output_token_ids
                assert any(ref[:len(out)] == out for ref in refs), f"{req.request_id}: {out} not a prefix of {refs}"


# -- targeted behaviour ---------------------------------------------------------------------

def make_engine(executor=None, **kw):
    """(engine, scheduler, executor) from config, cache and policy keywords; `executor(kv)`
    builds the executor (default: the toy one)."""
    cache_kw = {k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__}
    policy_kw = {k: kw.pop(k) for k in list(kw) if k in ("queue", "preemption", "victim", "eviction", "scheduler")}
    sched = Scheduler(SchedulerConfig(**kw), CacheConfig(**cache_kw), PolicySet.from_names(**policy_kw))
    ex = executor(sched.kv) if executor else ToyExecutor()
    return EngineCore(sched, ex), sched, ex


def test_chunked_prefill_serves_decodes_first():
    engine, sched, ex = make_engine(max_num_batched_tokens=8, max_model_len=64, block_size=4, num_gpu_blocks=64)
    engine.add_request(Request("short", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    engine.step()                                     # short's prefill
    engine.add_request(Request("long", list(range(30)), SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()
    out = ex.steps[-1]
    assert [(s.seq.request.request_id, s.num_tokens) for s in out.scheduled] == [("short", 1), ("long", 7)]
    engine.step()
    assert [(s.seq.request.request_id, s.start, s.num_tokens) for s in ex.steps[-1].scheduled] == \
        [("short", 4, 1), ("long", 7, 7)]


def test_rejected_requests_do_not_block_the_queue():
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=32, block_size=4, num_gpu_blocks=8,
                                    max_num_seqs=2)
    too_long = engine.add_request(Request("too-long", list(range(40)), SamplingParams()))
    too_wide = engine.add_request(Request("too-wide", [1, 2], SamplingParams(n=3)))
    ok = engine.add_request(Request("ok", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert too_long.status is RequestStatus.FINISHED_REJECTED and "max_model_len" in too_long.reject_reason
    assert too_wide.status is RequestStatus.FINISHED_REJECTED and "max_num_seqs" in too_wide.reject_reason
    done = engine.run_until_done(100)
    assert {r.request_id for r in done} == {"too-long", "too-wide", "ok"}
    assert ok.status is RequestStatus.FINISHED_LENGTH


def test_long_prefill_threshold_without_chunked_prefill_is_a_config_error():
    # It used to be accepted, and a prompt longer than the threshold then waited forever.
    with pytest.raises(ValueError, match="long_prefill_token_threshold=8 .* needs chunked prefill"):
        make_engine(max_num_batched_tokens=64, max_model_len=32, block_size=4, num_gpu_blocks=16,
                    enable_chunked_prefill=False, long_prefill_token_threshold=8)


def test_long_prefill_threshold_chunks_long_prompts():
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=32, block_size=4, num_gpu_blocks=16,
                                    long_prefill_token_threshold=8)
    req = engine.add_request(Request("long", list(range(20)), SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.run_until_done(100)
    assert [s.num_tokens for out in ex.steps for s in out.scheduled] == [8, 8, 4, 1]
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_kv_pool_too_small_for_max_model_len_is_a_config_error():
    with pytest.raises(ValueError, match="lower max_model_len"):
        make_engine(max_model_len=128, block_size=16, num_gpu_blocks=4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_happens_and_outputs_match(mode):
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=32, block_size=4, num_gpu_blocks=12,
                                    num_cpu_blocks=32, preemption=mode, watermark=0.0)
    reqs = [engine.add_request(Request(f"r{i}", [i + 1] * 10, SamplingParams(max_tokens=16, ignore_eos=True)))
            for i in range(4)]
    engine.run_until_done(1000)
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swaps > 0
    for r in reqs:
        assert r.finished_seqs[0].output_token_ids == reference_outputs(r.prompt_token_ids, 16, 1, None, True, 32)[0]
    assert sched.kv.gpu.num_used == 0


def test_parallel_sampling_shares_prompt_blocks():
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=64, block_size=4, num_gpu_blocks=64)
    req = engine.add_request(Request("n3", list(range(10)), SamplingParams(n=3, max_tokens=4, ignore_eos=True)))
    engine.step()                   # prefill: 3 blocks
    engine.step()                   # fork + first decode: CoW of the partial block for two children
    tables = [sched.kv.tables[s.seq_id] for s in req.seqs]
    assert len(tables) == 3
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]          # full prompt blocks shared
    assert len({t[2] for t in tables}) == 3                          # partial block copied on write
    assert sched.kv.gpu.num_used == 2 + 3
    assert len(ex.steps[-1].blocks_to_copy) == 2


def test_priority_queue_admits_more_important_first():
    engine, sched, ex = make_engine(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32, block_size=4,
                                    num_gpu_blocks=16, queue="priority")
    engine.add_request(Request("low", [1, 2], SamplingParams(max_tokens=1), priority=5))
    engine.add_request(Request("high", [1, 2], SamplingParams(max_tokens=1), priority=0))
    engine.add_request(Request("high2", [1, 2], SamplingParams(max_tokens=1), priority=0))
    order = [r.request_id for r in engine.run_until_done(100)]
    assert order == ["high", "high2", "low"]


def test_abort_frees_everything():
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=32, block_size=4, num_gpu_blocks=16)
    engine.add_request(Request("a", list(range(9)), SamplingParams(max_tokens=10, n=2, ignore_eos=True)))
    engine.step()
    engine.step()
    assert sched.kv.gpu.num_used > 0
    assert engine.abort_request("a")
    res = engine.step()
    assert [r.request_id for r in res.finished] == ["a"] and res.finished[0].status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.gpu.num_used == 0 and not engine.has_unfinished_requests()
    assert not engine.abort_request("a")


def test_beam_search_returns_ranked_beams():
    from core.beam_search import beam_score
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=32, block_size=4, num_gpu_blocks=32)
    req = engine.add_request(Request("b", [1, 2, 3, 4, 5], SamplingParams(beam_width=3, max_tokens=6), eos_token_id=EOS))
    engine.run_until_done(100)
    beams = req.finished_seqs
    assert len(beams) == 3
    scores = [beam_score(s, 1.0) for s in beams]
    assert scores == sorted(scores, reverse=True)
    assert sched.kv.gpu.num_used == 0


def test_recomputed_beams_sharing_a_cached_prefix_are_readmitted():
    """Found by the machine: after a recompute, two beams revive the same cached prefix
    blocks. Counting those blocks once per beam (and keeping the watermark with nothing
    running) left the request waiting forever in an idle engine."""
    engine, sched, ex = make_engine(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=32,
                                    enable_chunked_prefill=False, block_size=BS, num_gpu_blocks=9,
                                    enable_prefix_caching=True, watermark=0.25)
    shared = [7, 7, 8, 8, 9, 9, 10, 10]
    engine.add_request(Request("n2", shared + [0, 0, 0], SamplingParams(n=2, max_tokens=4), eos_token_id=EOS))
    engine.add_request(Request("beam", shared + [42, 0, 0], SamplingParams(beam_width=2, max_tokens=3),
                               eos_token_id=EOS))
    engine.run_until_done(200)
    assert sched.num_preemptions > 0            # the beam request was recomputed ...
    assert sched.kv.gpu.num_used == 0           # ... and everything finished


def test_an_idle_engine_readmits_a_recomputed_group_larger_than_the_watermark_allows():
    """A recomputed n=2 group re-prefills each sample privately: 2 x 4 blocks, more than the
    8 - 2 the watermark leaves. With nothing running the watermark has nothing to protect."""
    engine, sched, ex = make_engine(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=32, block_size=BS,
                                    num_gpu_blocks=8, watermark=0.2)
    engine.add_request(Request("c", [1], SamplingParams(max_tokens=8, ignore_eos=True), eos_token_id=EOS))
    engine.add_request(Request("g", [2] * 6, SamplingParams(n=2, max_tokens=8, ignore_eos=True), eos_token_id=EOS))
    engine.run_until_done(500)
    assert sched.num_preemptions > 0
    assert sched.kv.gpu.num_used == 0


def test_admission_counts_a_shared_revived_block_once():
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=20, block_size=BS, num_gpu_blocks=5,
                                    enable_prefix_caching=True, watermark=0.0)
    prompt = list(range(9))
    engine.add_request(Request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    engine.run_until_done(10)                   # its two full blocks stay cached, refcount 0
    kv = sched.kv
    twins = [Request(f"t{i}", prompt, SamplingParams(max_tokens=1)).seqs[0] for i in range(2)]
    plan = [(seq, 1, kv.find_cached_prefix(seq)) for seq in twins]
    assert [len(c) for _, _, c in plan] == [2, 2]
    # Each needs one new block; the two cached blocks leave the free pool once: 2 + 2 = 4 <= 5.
    assert kv.can_admit(plan)
    assert sum(kv.blocks_needed(s, n, c) for s, n, c in plan) == 6   # per-sequence counts overlap


def test_cache_salt_set_only_in_the_params_isolates_tenants():
    """Defect: core.Request read only its own cache_salt argument, so salts set in
    SamplingParams (as a server or LLM user does) shared prefix blocks across tenants."""
    engine, sched, ex = make_engine(max_num_batched_tokens=64, max_model_len=32, block_size=4, num_gpu_blocks=32,
                                    enable_prefix_caching=True)
    prompt = list(range(10, 23))                      # three full blocks and one token
    hits = {}
    for rid, salt in (("t1", "tenant-a"), ("t2", "tenant-b"), ("t3", "tenant-a"), ("t4", None)):
        req = engine.add_request(Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt)))
        engine.run_until_done(100)
        hits[rid] = req.metrics.num_cached_prompt_tokens
    assert hits == {"t1": 0, "t2": 0, "t3": 12, "t4": 0}
    # Both places agreeing is fine; disagreeing is refused, naming the parameter.
    assert Request("ok", prompt, SamplingParams(cache_salt="x"), cache_salt="x").cache_salt == "x"
    with pytest.raises(InvalidRequestError, match="cache_salt='y' differs from its SamplingParams.cache_salt='x'") \
            as err:
        Request("bad", prompt, SamplingParams(cache_salt="x"), cache_salt="y")
    assert err.value.param == "cache_salt"
