"""Pipeline parallelism: layers split over stages, batches in flight, on mp and Ray (CPU).

A tiny random GQA Llama with 4 layers and tied embeddings (the last stage then keeps its
own copy of the embedding as the LM head) runs the distributed tests' workload (prefix-
cache hits, chunked prefill, n=2, swap and recompute preemptions) with P = 2 stages on
`mp`, on `ray` (an uneven 1,3 split) and with P = 2 x TP = 2 on `mp`; greedy tokens must
equal a single rank's while two batches really are in flight. Killing a stage's process
fails the engine with the same clear WorkerError as tensor parallelism. Engines and the
Ray cluster are created once per module (worker start-up dominates).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from core import SamplingParams
from core.kv.kv_capacity import kv_blocks_per_pipeline, kv_blocks_per_rank
from realexec import LLM
from realexec.executor.base import WorkerError
from realexec.models.linear import packed_parameter, resolve_cpu_gemm
# Imported here, not inside the hypothesis test below: importing a module that defines
# @given tests from within a running @given test fails hypothesis' nested-test health check.
from tests.core.test_step_message import add_mixed_workload
from tests.realexec.executor.test_distributed import (GREEDY, PARAMS, PROMPTS, TIGHT, assert_gone, kill_actor_mid_run,
                                             run_workload, tokens)
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pp-llama")
    save_tiny_llama(path, vocab_size=255, initializer_range=0.15, num_hidden_layers=LAYERS,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(model=tiny, **TIGHT)
    out = run_workload(llm)
    _, swaps, recomputes, hits = out
    assert swaps > 0 and recomputes > 0 and hits > 0       # the workload exercises every path
    return out[0]


class InFlightProbe:
    """Wraps an executor's execute_model_async: how many batches were out at most, and how
    many step messages were mid-prefill chunks (a sequence computing tokens it does not sample)."""

    def __init__(self, executor):
        self.max_in_flight = 0
        self.chunks = 0
        inner = executor.execute_model_async

        def probe(out):
            future = inner(out)
            self.max_in_flight = max(self.max_in_flight, executor.num_in_flight)
            self.chunks += sum(1 for s in out.scheduled if s.num_tokens > 1 and not s.num_samples)
            return future
        executor.execute_model_async = probe


def run_pipelined(llm: LLM):
    """(tokens, preemptions, max batches in flight, mid-prefill chunks) of the shared workload."""
    probe = InFlightProbe(llm.engine.executor)
    preemptions = llm.engine.scheduler.num_preemptions
    out = run_workload(llm)[0]
    return out, llm.engine.scheduler.num_preemptions - preemptions, probe.max_in_flight, probe.chunks


@pytest.fixture(scope="module")
def mp_llm(tiny):
    llm = LLM(model=tiny, pipeline_parallel_size=2, distributed_executor_backend="mp", **TIGHT)
    yield llm
    llm.shutdown()


# ----------------------------------------------------------------------------- stages in one process

def _stage_models(path, pp: int, partition=None):
    from realexec.models.loader import load_model
    from realexec.distributed import PPGroup, stage_layer_ranges
    from realexec.models.loader import read_model_config
    ranges = stage_layer_ranges(read_model_config(path).num_hidden_layers, pp, partition)
    return [load_model(path, torch.float32, pp=PPGroup(k, pp, ranges[k]), with_tokenizer=False)[0]
            for k in range(pp)]


@pytest.mark.parametrize("tied", [True, False])
def test_stages_chained_by_hand_equal_the_whole_model(tmp_path, tied):
    """Stage k's output fed to stage k+1 gives the whole model's logits; each stage holds
    only its layers (plus the embedding on the first, norm and head on the last)."""
    from realexec.models.loader import load_model
    from tests.realexec.models.test_model import make_metadata

    save_tiny_llama(tmp_path, vocab_size=255, initializer_range=0.15, num_hidden_layers=5, tie_word_embeddings=tied)
    whole = load_model(tmp_path, torch.float32, with_tokenizer=False)[0]
    stages = _stage_models(tmp_path, 3, "1,3,1")
    prompt = [5, 17, 3, 99, 42, 7, 8]
    md = make_metadata([([0, 1], 0, len(prompt))], block_size=4)
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        h = None
        for stage in stages:
            h = stage(ids, pos, None, md, h)
        torch.testing.assert_close(stages[-1].compute_logits(h), whole.compute_logits(whole(ids, pos, None, md)),
                                   rtol=0, atol=0)
    names = [set(dict(s.named_parameters())) for s in stages]
    assert [len(s.layers) for s in stages] == [1, 3, 1]
    assert "embed_tokens.weight" in names[0] and not any("embed_tokens" in n for n in names[1] | names[2])
    assert "norm.weight" in names[2] and "lm_head.weight" in names[2] and "lm_head.weight" not in names[0]
    torch.testing.assert_close(stages[2].lm_head.weight, (whole.embed_tokens if tied else whole.lm_head).weight)
    torch.testing.assert_close(stages[1].layers[2].mlp.gate_up_proj.weight, whole.layers[3].mlp.gate_up_proj.weight)
    with pytest.raises(RuntimeError, match="stage 0 has no LM head"):
        stages[0].compute_logits(h)


def test_stage_reads_only_its_checkpoint_tensors(tmp_path, monkeypatch):
    """A stage never reads other stages' tensors from the checkpoint (not loaded, not kept)."""
    import realexec.models.loader as loader

    save_tiny_llama(tmp_path, vocab_size=255, num_hidden_layers=4, tie_word_embeddings=True)
    read: list[str] = []
    original = loader.iter_safetensors

    def spy(path, keep=None):
        for name, tensor in original(path, keep):
            read.append(name)
            yield name, tensor
    monkeypatch.setattr(loader, "iter_safetensors", spy)
    layer_names = [f"model.layers.{i}.{p}" for i in range(4) for p in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    _stage_models(tmp_path, 2, "1,3")
    first = sorted(layer_names[:9] + ["model.embed_tokens.weight"])
    last = sorted(layer_names[9:] + ["model.norm.weight", "model.embed_tokens.weight"])   # tied: head copy
    assert sorted(read[:len(first)]) == first and sorted(read[len(first):]) == last


# ----------------------------------------------------------------------------- messages in flight

class PipelinedMirror:
    """An async executor whose 'workers' are a ModelRunner's per-sequence state fed only
    with encoded step messages, built and applied in submission order while earlier batches
    are still out (as every pipeline stage applies them). At each submission the state a
    stage computes from must equal the scheduler's decision."""

    def __init__(self):
        from core.step_message import StepMessageBuilder
        from realexec.worker.model_runner import ModelRunner
        from tests.core.toy_executor import AsyncToyExecutor
        self.toy = AsyncToyExecutor()
        self.builder = StepMessageBuilder()
        self.runner = ModelRunner(None, "cpu", 4, None)

    def execute_model(self, out):
        return self.execute_model_async(out).result()

    def execute_model_async(self, out):
        from realexec.executor.serialization import decode_step, encode_step
        self.runner.update_states(decode_step(encode_step(self.builder.build(out))))
        for s in out.scheduled:
            mine = self.runner.seqs[s.seq_id]
            end = s.start + s.num_tokens
            assert mine.token_ids[:end] == s.seq.token_ids[:end], s
            assert mine.block_ids == s.block_table, s
        assert set(self.runner.seqs) == set(self.builder._sent)
        return self.toy.execute_model_async(out)


@settings(max_examples=min(400, settings.default.max_examples))   # the core's own machine runs 2,000
@given(lengths=st.lists(st.integers(1, 20), min_size=2, max_size=8),
       outs=st.lists(st.integers(1, 12), min_size=8, max_size=8),
       ns=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=8, max_size=8),
       beam=st.booleans(), preemption=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       blocks=st.integers(12, 30), budget=st.integers(4, 40), seats=st.integers(1, 4), pp=st.integers(2, 3),
       abort_at=st.integers(0, 30))
def test_step_messages_stay_true_with_batches_in_flight(lengths, outs, ns, beam, preemption, caching, blocks,
                                                        budget, seats, pp, abort_at):
    """The message builder's assumptions (departures sent once a request has left; a
    replaced table sent whole as `resumed`) hold when P batches are out: what the workers
    rebuild always equals the scheduler's view, and after the last departure nothing is left."""
    from core import CacheConfig, EngineCore, Scheduler, SchedulerConfig
    from policies import PolicySet

    sched = Scheduler(SchedulerConfig(max_num_seqs=seats + 2, max_num_batched_tokens=budget, max_model_len=40,
                                      pipeline_parallel_size=pp),
                      CacheConfig(block_size=4, num_gpu_blocks=blocks, num_cpu_blocks=16,
                                  enable_prefix_caching=caching, watermark=0.0),
                      PolicySet.from_names(preemption=preemption))
    ex = PipelinedMirror()
    engine = EngineCore(sched, ex, max_concurrent_batches=pp)
    add_mixed_workload(engine, lengths, outs, ns, beam)
    steps = 0
    while sched.has_unfinished_requests() or sched.has_unreported_finishes or engine.num_in_flight:
        engine.step()
        steps += 1
        if steps == abort_at:
            sched.abort("r1")                 # possibly in flight: deferred by the core
        assert steps < 2000
    assert ex.toy.max_in_flight <= pp
    empty = type("Empty", (), {"scheduled": [], "blocks_to_swap_out": [], "blocks_to_swap_in": [],
                               "blocks_to_copy": []})()
    ex.runner.update_states(ex.builder.build(empty))
    assert not ex.runner.seqs and not ex.runner.requests and not ex.builder._sent


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, message", [
    (dict(pipeline_parallel_size=2, pp_layer_partition="1,2"), r"covers 3 layers; the model has 4"),
    (dict(pipeline_parallel_size=3, pp_layer_partition="2,2"), r"has 2 stages; pipeline-parallel size is 3"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="4,0"), r"every stage needs at least one layer"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="two,two"), r"expected comma-separated integers"),
    (dict(pipeline_parallel_size=5), r"4 layers cannot be split over 5 pipeline stages"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"), r"uni runs one worker"),
    (dict(pipeline_parallel_size=0), r"pipeline-parallel-size must be >= 1"),
])
def test_bad_pipeline_config_refused_before_any_worker_starts(tiny, kwargs, message):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny, distributed_executor_backend=kwargs.pop("distributed_executor_backend", "mp"), **kwargs)
    assert time.monotonic() - t0 < 2.0               # no worker process was started


def test_step_log_refused_with_batches_in_flight(tiny, tmp_path):
    with pytest.raises(ValueError, match="step-log records one batch per step"):
        LLM(model=tiny, pipeline_parallel_size=2, step_log=str(tmp_path / "steps.jsonl"))


# ----------------------------------------------------------------------------- equality, mp

def test_pp2_mp_matches_single_rank_with_two_batches_in_flight(mp_llm, reference):
    out, preemptions, in_flight, chunks = run_pipelined(mp_llm)
    assert out == reference
    assert preemptions > 0 and chunks > 0 and in_flight == 2


def test_rpcs_and_an_abort_while_batches_are_in_flight(mp_llm, reference):
    """An RPC sent while batches are out is answered after them, by every rank, and the
    steps' replies still reach the right batches; a request aborted while in flight stops
    (the core defers it until its batch returns) and the others' tokens are unchanged;
    every stage ends up tracking exactly the sequences the engine believes it sent."""
    engine, ex = mp_llm.engine, mp_llm.engine.executor
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS)]
    final, rpcs_in_flight, aborted = {}, 0, None
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        rpcs_in_flight += engine.core.num_in_flight > 0
        assert ex.collective_rpc("ping") == [0, 1]
        in_flight = {s.seq.request.request_id for out in engine.core.in_flight for s in out.scheduled}
        flying = [rid for rid in ids[1:] if rid in in_flight]
        if aborted is None and flying:
            aborted = flying[0]
            assert engine.abort_request(aborted)
    assert rpcs_in_flight > 3 and aborted is not None and aborted not in final
    kept = [i for i, rid in enumerate(ids) if rid != aborted]
    assert tokens([final[ids[i]] for i in kept]) == [reference[i] for i in kept]
    assert ex.collective_rpc("num_tracked_seqs") == [ex.builder.num_tracked_seqs] * 2


def test_each_stage_holds_its_layers_and_their_kv_only(mp_llm):
    ex = mp_llm.engine.executor
    stages = ex.collective_rpc("stage")
    assert [(s["pp_rank"], s["layers"], s["has_embedding"], s["has_head"]) for s in stages] == [
        (0, [0, 2], True, False), (1, [2, 4], False, True)]
    # The KV budget of a rank counts its stage's 2 layers, not the model's 4.
    blocks = ex.collective_rpc("determine_num_available_blocks")
    per_stage = kv_blocks_per_rank(2**30, 4, num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4)
    assert [b[0] for b in blocks] == [per_stage, per_stage]
    mem = ex.collective_rpc("memory_bytes")
    num_blocks = mp_llm.engine.scheduler.kv.gpu.num_blocks
    assert [m["kv_cache"] for m in mem] == [num_blocks * 2 * 2 * (4 * 2 * 16 * 4)] * 2    # blocks, layers, K+V
    # Layers split evenly; the embedding on stage 0 and its copy as head on stage 1 are equal.
    # The last stage also holds the final norm and, in the CPU's default weight format, the
    # head's packed copy (realexec.models.linear: oneDNN's as large as the head, MKL's larger).
    head_packed = packed_parameter(torch.zeros(255, 64), 1, resolve_cpu_gemm("auto"))
    assert mem[1]["weights"] - mem[0]["weights"] == 64 * 4 + head_packed.numel() * head_packed.element_size()


def test_sleep_level2_and_wake_reload_each_stage(mp_llm, reference):
    """Level 2 drops every stage's weights and KV; wake-up reloads each stage's own layers
    from the checkpoint; the workload's greedy tokens are unchanged."""
    ex = mp_llm.engine.executor
    held = ex.collective_rpc("memory_bytes")
    assert mp_llm.sleep(2) == sum(m["weights"] + m["kv_cache"] for m in held)
    assert all(m == {"weights": 0, "kv_cache": 0} for m in ex.collective_rpc("memory_bytes"))
    mp_llm.wake_up()
    assert ex.collective_rpc("memory_bytes") == held
    assert run_pipelined(mp_llm)[0] == reference


# ----------------------------------------------------------------------------- ray, TP x PP

def test_pp2_ray_uneven_split_matches_single_rank_then_stage_kill(tiny, reference, ray_cluster):
    """Ray actors, layers split 1,3 (stage 1 holds 3 layers: it bounds the KV blocks); then
    killing stage 0's actor mid-run fails the engine naming rank 0, and no actor is left."""
    llm = LLM(model=tiny, pipeline_parallel_size=2, pp_layer_partition="1,3", distributed_executor_backend="ray",
              **TIGHT)
    ex = llm.engine.executor
    try:
        blocks = [b[0] for b in ex.collective_rpc("determine_num_available_blocks")]
        geometry = dict(num_kv_heads=2, head_dim=16, dtype_bytes=4)
        assert blocks == [kv_blocks_per_rank(2**30, 4, num_layers=1, **geometry),
                          kv_blocks_per_rank(2**30, 4, num_layers=3, **geometry)]
        # The engine's budget: the minimum over stages, as the core (and the simulator) price it.
        assert ex.determine_num_available_blocks()[0] == kv_blocks_per_pipeline(2**30, 4, [1, 3], **geometry)
        out, preemptions, in_flight, _ = run_pipelined(llm)
        assert out == reference and preemptions > 0 and in_flight == 2
        llm.engine.add_request(PROMPTS[2], SamplingParams(max_tokens=20, **GREEDY))
        llm.engine.add_request(PROMPTS[3], SamplingParams(max_tokens=20, **GREEDY))
        llm.engine.step()
        assert ex.collective_rpc("ping") == [0, 1]          # in ticket order behind the steps out
        kill_actor_mid_run(llm, 0)
    finally:
        llm.shutdown()


def test_pp2_tp2_mp_matches_single_rank(tiny, reference):
    llm = LLM(model=tiny, pipeline_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="mp",
              **TIGHT)
    try:
        stages = llm.engine.executor.collective_rpc("stage")
        assert [(s["rank"], s["pp_rank"], s["tp_rank"]) for s in stages] == [
            (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
        out, preemptions, in_flight, _ = run_pipelined(llm)
        assert out == reference and preemptions > 0 and in_flight == 2
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- faults (last mp user)

def test_mp_stage_killed_mid_run_named_then_all_stopped(mp_llm):
    """SIGKILL the first stage's process with two batches in flight: the step fails with a
    WorkerError naming rank 0 and the signal (not the stage that merely lost its peer),
    every worker process is gone, and the executor stays failed."""
    ex = mp_llm.engine.executor
    pids = ex.pids
    for prompt in PROMPTS[:4]:
        mp_llm.engine.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY))
    mp_llm.engine.step()
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 0 failed: process \d+ died during step \d+ "
                                          r"\(killed by signal SIGKILL\)") as info:
        while True:
            mp_llm.engine.step()
    assert info.value.rank == 0 and time.monotonic() - t0 < 15
    assert_gone(pids)
    with pytest.raises(WorkerError):
        mp_llm.engine.step()


def test_pp2_server_answers_like_a_single_rank_then_stage_kill_is_503(tiny):
    """Behind the OpenAI server: two concurrent completions (max_num_seqs=1: two batches in
    flight) get a single rank's greedy tokens; killing stage 0 mid-stream ends the stream
    with an error naming rank 0, /health turns 503 and no worker process is left."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from realexec.engine.llm_engine import LLMEngine
    from realexec.server.app import create_app
    from tests.realexec.server.test_server import serve

    prompts = [PROMPTS[0], PROMPTS[2]]
    single = tokens(LLM(model=tiny, block_size=4, num_gpu_blocks=64).generate(
        prompts, SamplingParams(max_tokens=12, **GREEDY)))
    engine = LLMEngine(model=tiny, pipeline_parallel_size=2, distributed_executor_backend="mp", block_size=4,
                       num_gpu_blocks=64, max_num_seqs=1)
    pids = engine.executor.pids
    body = {"model": "m", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    try:
        with serve(create_app(engine, served_model_name="m")) as url, httpx.Client(timeout=60) as client:
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda p: client.post(f"{url}/v1/completions", json={**body, "prompt": p}),
                                        prompts))
            got = [[[int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]] for r in answers]
            assert got == single
            stream = {**body, "prompt": PROMPTS[1], "max_tokens": 200, "stream": True}
            with client.stream("POST", f"{url}/v1/completions", json=stream) as r:
                lines = r.iter_lines()
                assert r.status_code == 200 and next(lines).startswith("data: ")
                os.kill(pids[0], signal.SIGKILL)
                rest = "\n".join(lines)
            assert re.search(r"worker rank 0 failed: process \d+ died during step \d+ \(killed by signal SIGKILL\)",
                             rest), rest[-500:]
            assert client.get(f"{url}/health").status_code == 503
        assert_gone(pids)
    finally:
        engine.shutdown()


# ----------------------------------------------------------------------------- SmolLM2

def test_smollm2_pp2_15_15_generate_cli_answers_like_a_single_rank(capsys):
    """`python -m realexec generate --pipeline-parallel-size 2 --distributed-executor-backend mp`
    on the real SmolLM2-135M (30 layers split 15/15, tied embeddings): the greedy answer of
    one rank, word for word."""
    from realexec.cli import finish_line, main

    question = "What is the capital of France?"
    kw = dict(block_size=16, kv_cache_memory=0.05, swap_space=0.01)
    (one,) = LLM(**kw).chat([{"role": "user", "content": question}], SamplingParams(max_tokens=12, temperature=0.0))
    argv = ["generate", "--chat", "--prompt", question, "--max-tokens", "12", "--block-size", "16",
            "--kv-cache-memory", "0.05", "--swap-space", "0.01",
            "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed == f"{one.outputs[0].text}\n{finish_line(one.outputs[0])}\n"
    assert "Paris" in printed
