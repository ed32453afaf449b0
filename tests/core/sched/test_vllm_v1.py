"""`--scheduler vllm-v1`: the core takes vLLM v1's scheduling decisions step for step.

Two kinds of evidence:
  * step logs written by vLLM 0.32's own Scheduler (tests/core/sched/vllm_v1/, made by
    vllm_scheduler_driver.py: see the README there) replayed through our core: every
    step must be identical (which requests, token ranges, samples, block-table lengths,
    preemptions, blocks in use), and the twinserve rules must differ on the logs built
    to exercise a vLLM rule (so the replay is not blind to it);
  * one small hand-built scenario per rule, with vLLM's decision stated (each was also
    checked against vLLM's Scheduler with the driver).
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from core import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from core.outputs import ModelRunnerOutput
from policies import PolicySet
from policies.scheduling import VLLM_V1, check_vllm_v1, scheduling_rules
from sim.twin.replay import replay

HERE = os.path.join(os.path.dirname(__file__), "vllm_v1")
LOGS = ["light_threshold", "preempt_small", "prefix_hits", "preempt_prefix_cache", "queueing_preempt",
        "full_sequence_admission", "priority_preempt", "sharegpt_queueing", "duplicate_blocks"]
# the logs on which twinserve's own rules decide differently (first differing step)
TWINSERVE_DIFFERS = {"light_threshold": 0, "full_sequence_admission": 5, "queueing_preempt": 103,
                     "preempt_prefix_cache": 14, "priority_preempt": 14}


def _log(name: str) -> str:
    return os.path.join(HERE, name + ".jsonl")


@pytest.mark.parametrize("name", LOGS)
def test_replay_of_vllm_scheduler_logs_is_identical_at_every_step(name):
    report = replay(_log(name), scheduler="vllm-v1")
    assert report.num_replayed_steps == report.num_logged_steps
    assert report.num_equal_steps == report.num_logged_steps, report.first_divergence
    assert report.equal


# The same scenarios through vLLM's AsyncScheduler, driven as its engine core's batch queue
# drives it (2 batches: step N+1 scheduled before step N's output lands): our core with
# async scheduling and the vllm-v1 rules must take every decision it takes.
@pytest.mark.parametrize("name", LOGS)
def test_replay_of_vllm_async_scheduler_logs_is_identical_at_every_step(name):
    import json
    with open(_log(name + "_async")) as f:
        config = json.loads(f.readline())
    assert config["scheduler"]["async_scheduling"] is True
    report = replay(_log(name + "_async"), scheduler="vllm-v1")
    assert report.num_replayed_steps == report.num_logged_steps > 0
    assert report.num_equal_steps == report.num_logged_steps, report.first_divergence


def test_the_async_logs_are_not_replayed_by_the_synchronous_scheduler(tmp_path):
    """The replay is not blind to async scheduling: the same logs with the flag off in their
    config diverge (8 of the 9; full_sequence_admission's waits make both agree)."""
    import json
    diverged = []
    for name in LOGS:
        with open(_log(name + "_async")) as f:
            config, *rest = f.read().splitlines()
        config = json.loads(config)
        config["scheduler"]["async_scheduling"] = False
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join([json.dumps(config), *rest]) + "\n")
        if not replay(str(path), scheduler="vllm-v1").equal:
            diverged.append(name)
    assert len(diverged) >= 8, diverged


@pytest.mark.parametrize("name", sorted(TWINSERVE_DIFFERS))
def test_twinserve_rules_diverge_where_vllm_rules_matter(name):
    report = replay(_log(name), scheduler="twinserve")
    assert not report.equal
    assert report.first_divergence["step"] == TWINSERVE_DIFFERS[name]


# -- one rule at a time, on hand-built scenarios -----------------------------------------------
def _sched(rules="vllm-v1", *, blocks=64, bs=4, seqs=8, budget=64, thr=0, caching=False, queue="fcfs",
           max_len=64):
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                                     long_prefill_token_threshold=thr),
                     CacheConfig(block_size=bs, num_gpu_blocks=blocks, enable_prefix_caching=caching, watermark=0.0),
                     PolicySet.from_names(queue=queue, scheduler=rules))


def _req(rid, n, max_tokens=50, base=0, priority=0):
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   priority=priority)


def _step(sched):
    out = sched.schedule()
    toks = {s.seq.seq_id: [1] for s in out.scheduled if s.num_samples}
    sched.update(out, ModelRunnerOutput(token_ids=toks))
    return [(s.seq.request.request_id, s.start, s.num_tokens) for s in out.scheduled], \
        [r.request_id for r in out.preempted]


def test_long_prefill_threshold_is_lifted_for_a_lone_request():
    """vLLM: `long_prefill_token_threshold if num_running + num_waiting > 1 else 0`. A lone
    30-token prompt with threshold 8 computes all 30 at once; with a second request
    waiting, each prefill is capped at 8."""
    alone = _sched(thr=8)
    alone.add_request(_req("a", 30))
    assert _step(alone)[0] == [("a", 0, 30)]
    two = _sched(thr=8)
    two.add_request(_req("a", 30))
    two.add_request(_req("b", 20, base=100))
    assert _step(two)[0] == [("a", 0, 8), ("b", 0, 8)]
    # twinserve caps even the lone request
    own = _sched("twinserve", thr=8)
    own.add_request(_req("a", 30))
    assert _step(own)[0] == [("a", 0, 8)]


def test_admission_needs_blocks_for_the_whole_prompt():
    """vLLM (scheduler_reserve_full_isl): a 44-token prompt (11 blocks of 4) is not admitted
    while 10 blocks are free, even though its first 8-token chunk needs only 2; twinserve
    admits the chunk."""
    for rules, admitted in (("vllm-v1", False), ("twinserve", True)):
        sched = _sched(rules, blocks=12, budget=9, max_len=48)
        sched.add_request(_req("a", 7, max_tokens=30))     # 2 blocks, then 1 decode token per step
        _step(sched)
        sched.add_request(_req("b", 44, base=100))
        batch, _ = _step(sched)                             # a decodes (budget 8 left), 10 blocks free
        assert ("b" in [rid for rid, *_ in batch]) is admitted, (rules, batch)


def test_victim_is_the_tail_of_running_not_the_newest_arrival():
    """vLLM FCFS preempts `running.pop()`: the request admitted last. Under FCFS with one
    batch in flight the running list stays in arrival order (a victim is always the tail,
    and victims go back to the front of waiting in age order), so the tail is also the
    newest arrival; the rule is vLLM's all the same, and this builds the order where the
    two differ directly: `a` (oldest) at the tail is the victim, although `c` arrived later."""
    sched = _sched(blocks=9, bs=4, budget=64, max_len=36)
    for i, rid in enumerate("abc"):
        sched.add_request(_req(rid, 8, max_tokens=40, base=100 * i))
    order = sched.running
    _step(sched)
    assert [r.request_id for r in order] == ["a", "b", "c"]
    # move a to the tail as a readmitted request would be
    a = sched.running.pop(0)
    sched.running.append(a)
    victims = []
    for _ in range(12):
        victims += _step(sched)[1]
        if victims:
            break
    assert victims[0] == "a"
    newest = Scheduler(sched.config, sched.cache_config, PolicySet.from_names(victim="newest"))
    assert newest.policies.victim.select(list(sched.running) + [a]).request_id != "a"


def test_preempted_request_goes_to_the_front_of_waiting_and_recomputes_from_zero():
    """vLLM: `waiting.prepend_request(victim)`, num_computed_tokens = 0; on readmission it
    recomputes prompt + generated tokens (here without prefix caching: from 0)."""
    sched = _sched(blocks=6, bs=4, budget=64, seqs=2, max_len=24)
    sched.add_request(_req("a", 8, max_tokens=30))
    sched.add_request(_req("b", 8, max_tokens=30, base=100))
    sched.add_request(_req("c", 4, max_tokens=30, base=200))       # waits: 2 sequences at most
    victims = []
    while not victims:
        _, victims = _step(sched)
    assert victims == ["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    b = sched.waiting.peek()
    assert b.seqs[0].num_computed_tokens == 0 and len(b.seqs[0].token_ids) > 8


def test_whole_prompt_hit_recomputes_the_last_block():
    """vLLM caps a prefix hit at num_tokens - 1 and hits whole blocks: an 8-token prompt
    cached in 2 blocks of 4 hits 1 block and computes 4 tokens."""
    sched = _sched(caching=True, bs=4)
    sched.add_request(_req("a", 8, max_tokens=3))
    _step(sched)
    sched.add_request(_req("b", 8, max_tokens=3))
    batch, _ = _step(sched)
    assert ("b", 4, 4) in batch


def test_priority_victim_may_be_already_scheduled_and_gives_its_slice_back():
    """vLLM (priority policy): the victim is max(running, key=(priority, arrival)) even when
    the step already scheduled it; its tokens return to the budget and it leaves the batch."""
    sched = _sched(blocks=4, bs=4, budget=64, queue="priority", max_len=16)
    sched.add_request(_req("low", 3, max_tokens=30, priority=5))       # 1 block, admitted alone
    _step(sched)
    sched.add_request(_req("high", 7, max_tokens=30, base=100, priority=0))   # 2 blocks
    batch, _ = _step(sched)
    assert [r for r, *_ in batch] == ["low", "high"]
    # running order: low (scheduled first each step), then high. Grow until the pool is short.
    seen = None
    for _ in range(10):
        batch, victims = _step(sched)
        if victims:
            seen = (batch, victims)
            break
    assert seen is not None
    batch, victims = seen
    assert victims == ["low"] and [r for r, *_ in batch] == ["high"]


# -- the preset ----------------------------------------------------------------------------------
def test_vllm_v1_preset_picks_vllms_victim_and_keeps_an_explicit_one():
    assert PolicySet.from_names(scheduler="vllm-v1").victim.name == "tail"
    assert PolicySet.from_names(scheduler="vllm-v1", queue="priority").victim.name == "lowest-priority"
    assert PolicySet.from_names(scheduler="vllm-v1", victim="least-computed").victim.name == "least-computed"
    assert PolicySet.from_names().victim.name == "newest"
    assert PolicySet.from_names(scheduler="vllm-v1").rules is VLLM_V1


def test_unknown_scheduler_and_unsupported_settings_are_clear_errors():
    with pytest.raises(ValueError, match="unknown scheduler 'vllm-v2'.*twinserve, vllm-v1"):
        scheduling_rules("vllm-v2")
    with pytest.raises(ValueError, match="always chunks prefills"):
        check_vllm_v1(chunked_prefill=False, preemption="recompute")
    with pytest.raises(ValueError, match="recompute only"):
        check_vllm_v1(chunked_prefill=True, preemption="swap")


def test_sim_config_takes_vllm_defaults_for_flags_not_given():
    from sim.config import SimConfig, with_scheduler_defaults
    from sim.engine import resolve
    c = with_scheduler_defaults(SimConfig(scheduler="vllm-v1", hardware="cpu-2core", model="SmolLM2-135M"),
                                explicit={"scheduler", "hardware", "model"})
    assert (c.watermark, c.enable_prefix_caching, c.block_size, c.victim_policy) == (0.0, True, 128, "tail")
    kept = with_scheduler_defaults(SimConfig(scheduler="vllm-v1", watermark=0.05, block_size=16,
                                             victim_policy="least-computed"),
                                   explicit={"scheduler", "watermark", "block_size", "victim_policy"})
    assert (kept.watermark, kept.block_size, kept.enable_prefix_caching) == (0.05, 16, True)
    assert kept.victim_policy == "least-computed"
    assert with_scheduler_defaults(SimConfig(), None) == SimConfig()
    mode = next(f.name for f in dataclasses.fields(SimConfig) if f.name.startswith("preemption"))
    with pytest.raises(ValueError, match="recompute only"):
        resolve(dataclasses.replace(c, **{mode: "swap"}))
    resolved = resolve(c)
    assert resolved.policies().rules is VLLM_V1 and resolved.policies().victim.name == "tail"


# -- the flag on the real engine -------------------------------------------------------------------
def test_realexec_flag_validates_and_reaches_the_step_log(tmp_path):
    """`--scheduler vllm-v1` on the real engine: bad combinations are one clear error; a
    run under the priority policy with preemptions writes the rules in its step log, and
    `sim replay` (taking them from the log) decides the same at every step."""
    from core.cost.step_log import load_log
    from realexec.config import EngineArgs
    from realexec.engine.llm_engine import LLMEngine
    from tests.tiny_models import save_tiny_llama

    with pytest.raises(ValueError, match="always chunks prefills"):
        EngineArgs(scheduler="vllm-v1", enable_chunked_prefill=False).validate()
    with pytest.raises(ValueError, match="unknown scheduler"):
        EngineArgs(scheduler="vllm").validate()
    save_tiny_llama(tmp_path / "m", vocab_size=256)
    log = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineArgs(model=str(tmp_path / "m"), block_size=4, num_gpu_blocks=16, max_model_len=64,
                                  max_num_batched_tokens=24, swap_space=0, watermark=0.0, enable_prefix_caching=True,
                                  queue_policy="priority", scheduler="vllm-v1", step_log=str(log)))
    try:
        for i in range(5):
            engine.add_request([10 + 9 * i + j for j in range(10 + 3 * i)],
                               SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                               request_id=f"r{i}", priority=(i * 2) % 3)
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    config, _, steps, _ = load_log(str(log))
    assert config["policies"]["scheduler"] == "vllm-v1" and config["policies"]["victim"] == "newest"
    assert sum(len(s["decision"]["preempted"]) for s in steps) >= 1
    report = replay(str(log))
    assert report.equal, report.first_divergence


def test_a_slice_taken_back_leaves_no_uncomputed_block_in_the_prefix_cache():
    """A slice the scheduler takes back (an already scheduled priority victim) published
    its blocks at schedule time; their KV is never written, so `retract` drops them from
    the cache index (vLLM 0.32 keeps them cached: a later hit would read KV never
    computed). Blocks computed by earlier steps stay."""
    from core.kv.kv_cache_manager import KVCacheManager
    from policies.eviction import LRUEvictor
    kv = KVCacheManager(4, 8, enable_prefix_caching=True, evictor=LRUEvictor())
    seq = _req("v", 14).seqs[0]
    assert kv.allocate_slots(seq, 4)            # step 1 computes block 0
    seq.num_computed_tokens = 4
    assert kv.allocate_slots(seq, 8)            # step 2 schedules blocks 1 and 2 ... then is taken back
    assert kv.gpu.lookup(seq.block_hashes[2]) is not None
    kv.retract(seq)                             # (num_computed_tokens is still 4)
    assert [kv.gpu.lookup(h) is not None for h in seq.block_hashes[:3]] == [True, False, False]
    kv.free(seq)
    again = _req("w", 14).seqs[0]
    assert len(kv.find_cached_prefix(again)) == 1
