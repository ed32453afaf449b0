"""The step as a message: what workers rebuild from the messages is exactly what the
scheduler decided, the message survives serialization, carries O(changes) per step, and
no worker-side module can reach scheduler objects."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from core import CacheConfig, EngineCore, Request, SamplingParams, Scheduler, SchedulerConfig
from core.step_message import StepMessageBuilder
from policies import PolicySet
from realexec.worker.model_runner import ModelRunner
from realexec.executor.serialization import (decode_step, decode_step_map, decode_step_pickle, encode_step, encode_step_map,
                                    encode_step_pickle)
from tests.core.toy_executor import VOCAB, ToyExecutor

ROOT = Path(__file__).resolve().parents[2]
BS = 4


def same_message(msg, wire) -> bool:
    """Every field of the dataclass message equals the decoded wire record's (recursively)."""
    if dataclasses.is_dataclass(msg):
        return all(same_message(getattr(msg, f.name), getattr(wire, f.name)) for f in dataclasses.fields(msg))
    if isinstance(msg, list):
        return len(msg) == len(wire) and all(same_message(a, b) for a, b in zip(msg, wire))
    return msg == wire and type(msg) is type(wire)


class MirroringExecutor(ToyExecutor):
    """The toy executor, plus a worker-side state fed only with encoded messages; every
    step checks that the state the worker would compute from equals the scheduler's."""

    def __init__(self, sched=None):
        super().__init__()
        self.builder = StepMessageBuilder()
        self.runner = ModelRunner(None, "cpu", BS, None)
        self.bytes = []
        self.sched = sched              # given: also check the workers hold exactly its live sequences
        self.ever_sent: set[int] = set()

    def execute_model(self, out):
        msg = self.builder.build(out)
        data = encode_step(msg)
        self.bytes.append(len(data))
        decoded = decode_step(data)
        assert same_message(msg, decoded) and encode_step(decoded) == data
        assert decode_step_pickle(encode_step_pickle(msg)) == msg
        assert decode_step_map(encode_step_map(msg)) == msg
        self.runner.update_states(decoded)
        for s in out.scheduled:
            mine = self.runner.seqs[s.seq_id]
            end = s.start + s.num_tokens
            assert mine.token_ids[:end] == s.seq.token_ids[:end], s
            assert mine.block_ids == s.block_table, s
            assert mine.request.params == s.seq.request.params
        # The workers hold exactly the live sequences they were ever sent.
        assert set(self.runner.seqs) == set(self.builder._sent)
        if self.sched is not None:
            self.ever_sent.update(s.seq_id for s in out.scheduled)
            check_mirror(self.runner, self.sched, self.ever_sent)
        return super().execute_model(out)


def check_mirror(runner, sched, ever_sent: set[int]) -> None:
    """The workers' state, rebuilt from the messages alone, against the scheduler's, read
    without the builder: they hold exactly the live sequences of live requests that were
    ever scheduled (no finished, aborted or pruned one), each under its own request with
    that request's sampling params and EOS id, and exactly the live requests of those."""
    live = {seq.seq_id: seq for r in sched.requests.values() if not r.is_finished
            for seq in r.seqs if not seq.is_finished and seq.seq_id in ever_sent}
    assert set(runner.seqs) == set(live), (f"workers hold {sorted(runner.seqs)}, "
                                            f"the scheduler's live sent sequences are {sorted(live)}")
    requests = {r.request_id: r for r in sched.requests.values() if not r.is_finished
                and any(seq.seq_id in ever_sent for seq in r.all_seqs())}
    assert set(runner.requests) == set(requests)
    for sid, seq in live.items():
        assert runner.seqs[sid].request is runner.requests[seq.request.request_id]
    for rid, r in requests.items():
        mine = runner.requests[rid]
        assert mine.params == r.params, f"workers sample {rid!r} with {mine.params}, not {r.params}"
        assert mine.eos_token_id == r.eos_token_id


def add_mixed_workload(engine, lengths, outs, ns, beam) -> None:
    """Requests r0.. with a common 8-token prefix (prefix-cache hits), prompts of `lengths`
    (cut at 36), `outs` tokens each, n = `ns` samples; r0 a width-2 beam search if `beam`."""
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    for i, n in enumerate(lengths):
        prompt = (shared + [(i * 5 + j) % VOCAB for j in range(n)])[:36]
        params = (SamplingParams(beam_width=2, max_tokens=outs[i], temperature=0.0) if beam and i == 0 else
                  SamplingParams(n=ns[i], max_tokens=outs[i]))
        engine.add_request(Request(f"r{i}", prompt, params, eos_token_id=None))


@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    outs=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    ns=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=8, max_size=8),
    beam=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    blocks=st.integers(10, 30),
    budget=st.integers(4, 40),
    abort_at=st.integers(0, 30),
)
def test_workers_rebuild_the_schedulers_view(lengths, outs, ns, beam, preemption, caching, blocks, budget,
                                             abort_at):
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=40),
                      CacheConfig(block_size=BS, num_gpu_blocks=blocks, num_cpu_blocks=16,
                                  enable_prefix_caching=caching, watermark=0.0),
                      PolicySet.from_names(preemption=preemption))
    ex = MirroringExecutor()
    engine = EngineCore(sched, ex)
    add_mixed_workload(engine, lengths, outs, ns, beam)
    steps = 0
    while sched.has_unfinished_requests() or sched._finished:
        engine.step()
        steps += 1
        if steps == abort_at:
            sched.abort("r1")
        assert steps < 2000
    engine.step()                                       # an empty step still drops nothing
    # After the last departures reach the workers, nothing is left behind.
    ex.runner.update_states(ex.builder.build(type("Empty", (), {"scheduled": [], "blocks_to_swap_out": [],
                                                                "blocks_to_swap_in": [], "blocks_to_copy": []})()))
    assert not ex.runner.seqs and not ex.runner.requests and not ex.builder._sent


PARAMS = st.builds(
    lambda kind, n, temperature, seed, max_tokens: (
        SamplingParams(beam_width=2, temperature=0.0, max_tokens=max_tokens) if kind == "beam" else
        SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens)),
    kind=st.sampled_from(["sample", "sample", "beam"]), n=st.sampled_from([1, 1, 2, 3]),
    temperature=st.sampled_from([0.0, 0.7, 1.0]), seed=st.none() | st.integers(0, 9),
    max_tokens=st.integers(1, 10))
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from("abc"), st.integers(1, 20), PARAMS, st.sampled_from([None, 3])),
    st.tuples(st.just("abort"), st.sampled_from("abc")),
    st.tuples(st.just("step"), st.integers(1, 4))), max_size=40)


@given(ops=OPS, preemption=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       blocks=st.integers(10, 24), budget=st.integers(4, 40))
def test_workers_mirror_the_scheduler_with_request_ids_reused(ops, preemption, caching, blocks, budget):
    """After every message the workers hold exactly the scheduler's live sequences with
    their own request's params, while ids "a", "b", "c" come back with other params
    (sampled, seeded, greedy, n > 1, beams) after finishing or being aborted, and a small
    pool preempts (recompute or swap)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=40),
                      CacheConfig(block_size=BS, num_gpu_blocks=blocks, num_cpu_blocks=16,
                                  enable_prefix_caching=caching, watermark=0.0),
                      PolicySet.from_names(preemption=preemption))
    ex = MirroringExecutor(sched)
    engine = EngineCore(sched, ex)
    for op in ops + [("drain",)]:
        if op[0] == "add":
            _, rid, length, params, eos = op
            if rid in sched.requests:
                with pytest.raises(ValueError, match="duplicate request id"):
                    engine.add_request(Request(rid, [1] * length, params))
                continue
            engine.add_request(Request(rid, [(ord(rid) + j) % VOCAB for j in range(length)], params,
                                       eos_token_id=eos))
        elif op[0] == "abort":
            engine.abort_request(op[1])
        else:
            for _ in range(op[1] if op[0] == "step" else 2000):
                if op[0] == "drain" and not (sched.has_unfinished_requests() or sched.has_unreported_finishes):
                    break
                engine.step()
    assert not sched.has_unfinished_requests()
    # The last departures reach the workers with the next message: then nothing is left.
    ex.execute_model(sched.schedule())
    assert not ex.runner.seqs and not ex.runner.requests


def roomy_mirrored_engine():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40),
                      CacheConfig(block_size=BS, num_gpu_blocks=64), PolicySet())
    ex = MirroringExecutor(sched)
    return EngineCore(sched, ex), sched, ex


def test_a_reused_request_id_arrives_with_its_new_params():
    """Defect: the workers kept the finished request's params for the new one (its
    departure was sent after, not before, the arrival that reused the id)."""
    engine, sched, ex = roomy_mirrored_engine()
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=3)
    engine.add_request(Request("a", [1, 2, 3], greedy))
    engine.run_until_done(100)
    engine.add_request(Request("a", [1, 2, 3], seeded))
    engine.step()                                # the old "a" leaves and the new one arrives in one message
    assert ex.runner.requests["a"].params == seeded
    engine.run_until_done(100)


def test_a_pruned_beam_leaves_the_workers_with_the_next_message():
    engine, sched, ex = roomy_mirrored_engine()
    req = engine.add_request(Request("beam", [5, 6, 7], SamplingParams(beam_width=2, temperature=0.0,
                                                                        max_tokens=12)))
    pruned_while_live = 0
    sent_before: set[int] = set()
    while sched.has_unfinished_requests():
        engine.step()                            # MirroringExecutor checks every message
        live = {seq.seq_id for seq in req.seqs}
        if not req.is_finished:
            pruned_while_live += len(sent_before - live - {seq.seq_id for seq in req.finished_seqs})
        sent_before = set(ex.runner.seqs)
    assert pruned_while_live > 0                 # the workload did prune beams mid-request


def test_message_size_is_o_changes_not_o_context():
    """A steady decode step costs the same bytes at context 12 and at context 300."""
    def decode_bytes(prompt_len):
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=1024),
                          CacheConfig(block_size=16, num_gpu_blocks=400), PolicySet())
        ex = MirroringExecutor()
        ex.runner.block_size = 16
        engine = EngineCore(sched, ex)
        for i in range(8):
            engine.add_request(Request(f"r{i}", [(i + j) % VOCAB for j in range(prompt_len)],
                                       SamplingParams(max_tokens=6, ignore_eos=True)))
        for _ in range(4):
            engine.step()
        return ex.bytes

    short, long = decode_bytes(13), decode_bytes(301)
    assert long[0] - short[0] >= 8 * (301 - 13)         # the prefill step carries the prompts once
    assert all(abs(a - b) <= 8 * 3 for a, b in zip(short[2:], long[2:]))   # decode: a few bytes per int
    # A few ints per sequence, each at most 5 bytes in MessagePack: the ids come from a
    # process-wide counter, so later in a long test session they take more bytes.
    assert short[2] < 8 * 24


# Modules that run inside workers (in-process, worker processes, Ray actors).
WORKER_MODULES = ["realexec/worker/worker.py", "realexec/worker/model_runner.py", "realexec/worker/sampler.py", "realexec/distributed.py",
                  "realexec/executor/serialization.py", "realexec/executor/multiproc.py", "realexec/executor/ray_executor.py",
                  "realexec/models/loader.py", *[str(p.relative_to(ROOT)) for p in (ROOT / "realexec/models").glob("*.py")],
                  *[str(p.relative_to(ROOT)) for p in (ROOT / "realexec/attention").glob("*.py")]]
FORBIDDEN_MODULES = {"core.sched.scheduler", "core.sched.request", "core.engine", "core.kv.kv_cache_manager", "core.kv.block_pool"}
FORBIDDEN_NAMES = {"Scheduler", "SchedulerOutput", "ScheduledSeq", "Sequence", "Request", "EngineCore",
                   "KVCacheManager"}


def scheduler_imports(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in FORBIDDEN_MODULES:
                bad.append(node.module)
            elif node.module == "core":
                bad += [f"core.{a.name}" for a in node.names if a.name in FORBIDDEN_NAMES | {"scheduler"}]
    return bad


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_no_worker_module_imports_the_scheduler(module):
    path = ROOT / module
    if not path.exists():
        pytest.fail(f"{module} is listed as a worker module but does not exist")
    assert scheduler_imports(path) == []
