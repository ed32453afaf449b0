"""Tensor parallelism through the multiprocess and Ray executors, sleep/wake, faults (CPU).

A tiny random GQA Llama (4 query / 2 KV heads, an odd vocabulary so the vocab-parallel
shards are padded) runs one workload that exercises prefix-cache hits, chunked prefill,
n=2 and both kinds of preemption (`auto`: the n=2 group is swapped, single sequences
recomputed) under TP=2 with `mp` and with `ray`; greedy tokens must equal TP=1's.
Engines and the Ray cluster are created once per module (worker start-up dominates).
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from core import SamplingParams
from realexec import LLM
from realexec.executor.base import WorkerError
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)
SHARED = list(range(40, 56))                        # 4 full blocks of 4: prefix-cache hits
PROMPTS = [SHARED + [3, 4, 5], SHARED + [6, 7], list(range(100, 131)), [9, 8, 7, 6, 5], SHARED + [200] * 9]
PARAMS = [SamplingParams(max_tokens=24, **GREEDY)] * 4 + [SamplingParams(n=2, max_tokens=24, **GREEDY)]
# A pool too small for everything at once (preemptions), chunks of 16 tokens, prefix caching.
TIGHT = dict(block_size=4, num_gpu_blocks=34, swap_space=0.002, max_num_batched_tokens=16,
             enable_prefix_caching=True, preemption_mode="auto", max_num_seqs=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gqa-llama")
    save_tiny_llama(path, vocab_size=255, initializer_range=0.15, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2)
    return str(path)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def run_workload(llm: LLM):
    """(tokens, swaps, recompute preemptions, prefix-hit tokens) of the shared workload."""
    sched = llm.engine.scheduler
    swaps0, pre0 = sched.num_swaps, sched.num_preemptions
    hits0 = sched.kv.stats().prefix_cache_hits
    out = tokens(llm.generate(PROMPTS, PARAMS))
    swaps = sched.num_swaps - swaps0
    return out, swaps, sched.num_preemptions - pre0 - swaps, sched.kv.stats().prefix_cache_hits - hits0


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(model=tiny, **TIGHT)
    out = run_workload(llm)
    roomy = tokens(LLM(model=tiny, block_size=4, num_gpu_blocks=256).generate(PROMPTS, PARAMS))
    assert out[0] == roomy                      # preemption does not change greedy tokens
    return out


@pytest.fixture(scope="module")
def mp_llm(tiny):
    llm = LLM(model=tiny, tensor_parallel_size=2, distributed_executor_backend="mp", **TIGHT)
    yield llm
    llm.shutdown()


def kill_actor_mid_run(llm: LLM, rank: int) -> None:
    """SIGKILL rank's Ray actor while requests run: the next steps fail within 30 s with a
    WorkerError naming that rank, and every actor is gone afterwards."""
    ex = llm.engine.executor
    os.kill(ex.pids[rank], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"worker rank {rank} failed: its actor died") as info:
        while True:
            llm.engine.step()
    assert info.value.rank == rank and time.monotonic() - t0 < 30
    assert_gone(ex.pids)


def assert_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    assert not alive, f"worker processes left behind: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"     # a zombie is dead
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------- equality

def test_reference_exercises_every_path(reference):
    _, swaps, recomputes, hits = reference
    assert swaps > 0 and recomputes > 0 and hits > 0


def test_tp2_mp_matches_tp1(mp_llm, reference):
    out, swaps, recomputes, hits = run_workload(mp_llm)
    assert out == reference[0]
    assert (swaps, recomputes, hits) == reference[1:]       # the same schedule, not just the same tokens


@pytest.mark.parametrize("backend,tp", [("uni", 1), ("mp", 1), ("mp", 2)])
def test_async_scheduling_matches_tp1(tiny, reference, backend, tp):
    """One worker in this process (on its model thread), one in a worker process, or two
    tensor-parallel ranks (the driver broadcasts the tokens it samples): the workload's greedy
    tokens (chunks, n = 2, prefix hits, preemptions in flight) are unchanged."""
    llm = LLM(model=tiny, distributed_executor_backend=backend, tensor_parallel_size=tp, async_scheduling=True,
              **TIGHT)
    try:
        out, swaps, recomputes, hits = run_workload(llm)
        assert out == reference[0]
        assert recomputes + swaps > 0 and hits > 0
    finally:
        llm.shutdown()


def test_per_rank_kv_capacity_is_one_function_for_sim_and_workers(mp_llm, tiny, monkeypatch):
    """Each rank budgets its own KV heads (half of them at TP=2: twice the blocks), through
    core.kv.kv_capacity, the function `python -m sim run --tp N` sizes its cache with."""
    import core.kv.kv_capacity as kvc
    from core.cost.model import kv_block_bytes
    from core.cost.specs import get_model

    per_rank = mp_llm.engine.executor.collective_rpc("determine_num_available_blocks")
    one_rank = kvc.kv_blocks_per_rank(2**30, 4, num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4)
    assert per_rank == [(2 * one_rank, per_rank[0][1])] * 2
    worker = LLM(model=tiny, block_size=4, num_gpu_blocks=16).engine.executor.driver
    llama = get_model("Llama-2-13B")
    before = kv_block_bytes(llama, 16, 2)
    monkeypatch.setattr(kvc, "kv_heads_per_rank", lambda heads, tp: 1000)   # both must follow
    assert kv_block_bytes(llama, 16, 2) == before * 1000 // -(-llama.num_kv_heads // 2)
    assert worker.bytes_per_block() == 2 * 2 * 1000 * 16 * 4 * 4           # K+V, layers, heads, dim, fp32, bs


def test_tp2_ray_matches_tp1(tiny, reference, ray_cluster):
    llm = LLM(model=tiny, tensor_parallel_size=2, distributed_executor_backend="ray", **TIGHT)
    try:
        assert run_workload(llm)[0] == reference[0]
        # Kill rank 1's actor mid-run: a clear error naming it, then no actor is left.
        llm.engine.add_request(PROMPTS[2], SamplingParams(max_tokens=20, **GREEDY))
        llm.engine.step()
        kill_actor_mid_run(llm, 1)
        # Actors killed and the placement group removed: every CPU of the cluster is free again.
        ray = ray_cluster
        deadline = time.monotonic() + 10
        while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
    finally:
        llm.shutdown()


def test_ray_hung_actor_named(tiny, ray_cluster):
    """A stopped actor (SIGSTOP) is found by the liveness probe once worker_timeout passes."""
    llm = LLM(model=tiny, tensor_parallel_size=2, distributed_executor_backend="ray", block_size=4,
              num_gpu_blocks=64)
    ex = llm.engine.executor
    ex.args.worker_timeout = 3.0              # after start-up (loading may take longer here)
    try:
        llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, **GREEDY))
        llm.engine.step()
        os.kill(ex.pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker rank 1 failed: hung during step \d+.*"
                                              r"not answering a liveness probe: \[1\]"):
            while True:
                llm.engine.step()
        assert time.monotonic() - t0 < 20
        assert_gone(ex.pids)
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- sleep / wake

def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_same_tokens_and_memory_released(tiny, level):
    llm = LLM(model=tiny, block_size=16, kv_cache_memory=0.125, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=16, **GREEDY)
    before = tokens(llm.generate(PROMPTS[:3], params))
    worker = llm.engine.executor.driver
    held = worker.memory_bytes()
    rss = _rss_bytes()
    released = llm.sleep(level)
    asleep = worker.memory_bytes()
    rss_asleep = _rss_bytes()
    assert asleep["kv_cache"] == 0 and held["kv_cache"] >= 0.125 * 2**30 * 0.99
    assert asleep["weights"] == (0 if level == 2 else held["weights"])      # level 1 on CPU: weights stay
    assert released == held["kv_cache"] + (held["weights"] if level == 2 else 0)
    assert rss - rss_asleep >= 0.9 * held["kv_cache"], (rss, rss_asleep)   # given back to the OS
    assert llm.engine.scheduler.kv.gpu.num_cached == 0                      # prefix cache reset
    # Offline: a request added while asleep waits; generate() refuses instead of hanging.
    rid = llm.engine.add_request(PROMPTS[3], params)
    assert llm.engine.step() == [] and llm.engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS[0], params)
    llm.wake_up()
    assert worker.memory_bytes() == held
    finals = []
    while llm.engine.has_unfinished_requests():
        finals += [o for o in llm.engine.step() if o.finished and o.request_id == rid]
    assert len(finals[0].outputs[0].token_ids) == 16
    assert tokens(llm.generate(PROMPTS[:3], params)) == before


def test_sleep_refused_while_requests_run(tiny):
    llm = LLM(model=tiny, block_size=4, num_gpu_blocks=64)
    llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, **GREEDY))
    llm.engine.step()
    with pytest.raises(RuntimeError, match="1 running"):
        llm.sleep(1)


def test_sleep_wake_through_mp_ranks(mp_llm, reference):
    released = mp_llm.sleep(1)
    mem = mp_llm.engine.executor.collective_rpc("memory_bytes")
    assert released > 0 and all(m["kv_cache"] == 0 for m in mem) and len(mem) == 2
    mp_llm.wake_up()
    assert run_workload(mp_llm)[0] == reference[0]


# ----------------------------------------------------------------------------- faults

def test_mp_hung_worker_named_then_killed(mp_llm):
    """A stopped rank (SIGSTOP: no heartbeat) fails the step within the bound; then every
    worker process is gone. (Last user of the module's mp engine.)"""
    ex = mp_llm.engine.executor
    ex.args.worker_timeout = 4.0
    pids = ex.pids
    mp_llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, **GREEDY))
    mp_llm.engine.step()
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1 failed: hung during step \d+: no heartbeat") as info:
        while True:
            mp_llm.engine.step()
    assert info.value.rank == 1 and time.monotonic() - t0 < 15
    assert_gone(pids)
    with pytest.raises(WorkerError):          # the executor stays failed
        mp_llm.engine.step()


def test_mp_killed_worker_server_503_and_unhealthy(tiny):
    """Kill rank 1 while the server streams a completion: the request fails with a 503 that
    names the rank and the signal, /health turns 503, and no worker process is left."""
    import httpx

    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.app import create_app
    from tests.realexec.server.test_server import serve

    engine = LLMEngine(model=tiny, tensor_parallel_size=2, distributed_executor_backend="mp", block_size=4,
                       num_gpu_blocks=64)
    pids = engine.executor.pids
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 1}          # logprobs: one event per token (no tokenizer, no text)
    try:
        with serve(create_app(engine, served_model_name="m")) as url, httpx.Client(timeout=60) as client:
            assert client.get(f"{url}/health").status_code == 200
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert r.status_code == 200 and next(lines).startswith("data: ")
                os.kill(pids[1], signal.SIGKILL)
                t0 = time.monotonic()
                rest = "\n".join(lines)
            assert time.monotonic() - t0 < 10
            assert re.search(r"worker rank 1 failed: process \d+ died during step \d+ \(killed by signal SIGKILL\)",
                             rest), rest[-500:]
            assert client.get(f"{url}/health").status_code == 503
            again = client.post(f"{url}/v1/completions", json={**body, "stream": False})
            assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
        assert_gone(pids)
    finally:
        engine.shutdown()


def test_server_sleep_endpoints(tiny):
    import httpx

    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.app import create_app
    from tests.realexec.server.test_server import serve

    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = create_app(LLMEngine(model=tiny, block_size=4, num_gpu_blocks=64), served_model_name="m")
    with serve(plain) as url, httpx.Client(timeout=60) as client:
        assert client.post(f"{url}/sleep").status_code == 404           # dev endpoints off by default
    engine = LLMEngine(model=tiny, block_size=4, num_gpu_blocks=64, enable_sleep_mode=True)
    with serve(create_app(engine, served_model_name="m")) as url, httpx.Client(timeout=60) as client:
        before = client.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        assert client.post(f"{url}/sleep", params={"level": 3}).status_code == 400
        r = client.post(f"{url}/sleep", params={"level": 1})
        assert r.status_code == 200 and r.json()["released_bytes"] > 0
        assert client.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        asleep = client.post(f"{url}/v1/completions", json=body)
        assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "engine_sleeping"
        assert client.post(f"{url}/wake_up").status_code == 200
        assert client.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        assert client.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"] == before


def test_tp_refused_when_heads_do_not_split(tiny):
    with pytest.raises(ValueError, match=r"tensor-parallel-size 3 must divide the model's 4 query heads "
                                         r"and 2 KV heads.*valid sizes: 1, 2"):
        LLM(model=tiny, tensor_parallel_size=3, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="uni runs one worker"):
        LLM(model=tiny, tensor_parallel_size=2, distributed_executor_backend="uni")


def test_smollm2_tp3_matches_tp1():
    """The real SmolLM2-135M (9 query / 3 KV heads) split over 3 ranks: the same greedy tokens
    as one rank; the chosen tokens' logprobs differ only by all-reduce summation order."""
    convs = [[{"role": "user", "content": q}] for q in ("Write a short poem about the sea.",
                                                          "Explain what a hash table is.")]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    one = LLM(block_size=16, kv_cache_memory=0.05, swap_space=0.01).chat(convs, params)
    tp3 = LLM(block_size=16, kv_cache_memory=0.05, swap_space=0.01, tensor_parallel_size=3,
              distributed_executor_backend="mp")
    try:
        three = tp3.chat(convs, params)
    finally:
        tp3.shutdown()
    for a, b in zip(one, three):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        gap = max(abs(p[t] - q[t]) for p, q, t in zip(a.logprobs, b.logprobs, a.token_ids))
        assert gap < 1e-4, gap
