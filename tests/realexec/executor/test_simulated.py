"""The simulated executor (`--simulate`): steps take what the cost model prices (a fake
clock: exactly), tokens are seeded and from the tokenizer's vocabulary, KV capacity comes
from the priced deployment, and bad flags are refused with what and where."""
from __future__ import annotations

import json

import pytest

from core import SamplingParams
from core.cost.model import BatchShape, RooflineCostModel, kv_block_bytes, kv_cache_capacity_blocks
from core.cost.specs import get_hardware, get_model
from core.step_message import StepMessage
from realexec.config import EngineArgs
from realexec.executor.simulated import FakeClock

LLAMA, H100 = get_model("Llama-3-8B"), get_hardware("H100")
ROOFLINE = RooflineCostModel(LLAMA, H100)


def sim_engine(clock: FakeClock | None = None, **kwargs):
    from realexec.engine.llm_engine import LLMEngine

    kwargs.setdefault("simulate", "roofline")
    kwargs.setdefault("sim_model", "Llama-3-8B")
    kwargs.setdefault("sim_hardware", "H100")
    engine = LLMEngine(EngineArgs(**kwargs))
    if clock is not None:
        engine.executor.clock = clock
    return engine


def run(engine, requests) -> dict[str, list[list[int]]]:
    """Add (prompt, params) pairs, step to the end; -> request id -> every choice's token ids."""
    ids = [engine.add_request(p, params) for p, params in requests]
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)]
    return {rid: out[rid] for rid in ids}


@pytest.fixture(scope="module")
def engine():
    return sim_engine(FakeClock())


# ----------------------------------------------------------------------------- time

def test_each_step_advances_the_fake_clock_by_exactly_its_price(engine):
    """One 10-token prompt, 3 outputs: a prefill of 10 tokens, then decodes over 10 and 11
    cached tokens; the clock moves by the roofline's price of each, bit for bit."""
    clock = engine.executor.clock
    t0, n0 = clock.t, len(clock.waits)
    run(engine, [(list(range(100, 110)), SamplingParams(max_tokens=3, ignore_eos=True))])
    expected = [ROOFLINE.step_time(BatchShape.prefill(10)), ROOFLINE.step_time(BatchShape.decode(1, 10)),
                ROOFLINE.step_time(BatchShape.decode(1, 11))]
    assert clock.waits[n0:] == expected
    assert clock.t == pytest.approx(t0 + sum(expected), rel=1e-12)


class BusyClock(FakeClock):
    """A fake clock on which the engine's own work between steps takes `gap` seconds."""

    def __init__(self, gap: float):
        super().__init__()
        self.gap = gap
        self.ends: list[float] = []

    def wait(self, start: float, seconds: float) -> float:
        end = super().wait(start, seconds)
        self.ends.append(end)
        self.t += self.gap              # then the engine updates, detokenizes, schedules the next step
        return end


def test_the_engines_own_work_between_steps_is_inside_the_price():
    """Steps of a busy engine end exactly their prices apart: the engine's 1 ms between
    steps is inside the price (the roofline's 2 ms per-step overhead). After an idle
    second, a step absorbs only that overhead, not the idle time."""
    clock = BusyClock(gap=0.001)
    engine = sim_engine(clock)
    run(engine, [(list(range(100, 110)), SamplingParams(max_tokens=4, ignore_eos=True))])
    prices = [ROOFLINE.step_time(BatchShape.prefill(10))] + [ROOFLINE.step_time(BatchShape.decode(1, c))
                                                            for c in (10, 11, 12)]
    assert [b - a for a, b in zip(clock.ends, clock.ends[1:])] == pytest.approx(prices[1:], rel=1e-9)
    clock.t += 1.0                                   # idle for a second
    run(engine, [(list(range(100, 110)), SamplingParams(max_tokens=1, ignore_eos=True))])
    overhead = ROOFLINE.step_overhead_s
    assert clock.ends[-1] - clock.ends[-2] == pytest.approx(0.001 + 1.0 - overhead + prices[0], rel=1e-9)


def test_chunked_prefill_and_mixed_batches_are_priced_by_their_slices():
    """A 40-token prompt in 16-token chunks (context = the chunk's start), then a batch that
    mixes its decode with a second prompt: each step is one BatchShape of all its slices.
    SmolLM2 on the 2-core CPU spec: compute-bound steps, so the causal pairs count too."""
    clock = FakeClock()
    engine = sim_engine(clock, max_num_batched_tokens=16, enable_chunked_prefill=True, sim_model="SmolLM2-135M",
                        sim_hardware="cpu-2core")
    roofline = RooflineCostModel(get_model("SmolLM2-135M"), get_hardware("cpu-2core"))
    a = engine.add_request(list(range(200, 240)), SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    b = engine.add_request(list(range(300, 305)), SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    shapes = [BatchShape.prefill(16, 0), BatchShape.prefill(16, 16), BatchShape.prefill(8, 32),
              BatchShape.from_pairs([(1, 40), (5, 0)])]       # a's decode + b's whole prompt
    assert clock.waits == [roofline.step_time(s) for s in shapes], (a, b)
    assert roofline.breakdown(shapes[1]).bound == "compute"


def test_swaps_are_priced_on_top_of_the_batch(engine):
    """A step's swap-outs and swap-ins each cost the cost model's swap time of their blocks."""
    worker = engine.executor.driver
    msg = StepMessage(blocks_to_swap_out=[(1, 0), (2, 1)], blocks_to_swap_in=[(5, 3)])
    block = kv_block_bytes(LLAMA, 16)
    assert worker.price(msg) == ROOFLINE.swap_time(2, block) + ROOFLINE.swap_time(1, block)


def linear_cost_model(engine: dict, prefill_per_token: float = 0.001, decode_per_token: float = 0.002) -> dict:
    """A made-up fitted cost model (`realexec profile` format) with linear prefill/decode
    lines: execute 10 ms + per token (prefill), 20 ms + per token (decode); overhead 1 ms
    (prefill), 0.5 ms (decode); `engine` is its engine section."""
    def part(one, per_token):
        return {"features": ["one", "tokens"], "coef": [one, per_token]}
    return {"format": "twinserve-step-cost", "version": 2, "features": ["one", "seqs", "tokens", "context", "pairs"],
            "parts": {"execute": {"prefill": part(0.010, prefill_per_token), "decode": part(0.020, decode_per_token)},
                      "overhead": {"prefill": part(0.001, 0.0), "decode": part(0.0005, 0.0)}},
            "profile": {"model": "SmolLM2-135M-Instruct"}, "engine": engine}


def test_a_fitted_cost_model_prices_the_steps(tmp_path):
    """A `realexec profile`-format file: the step costs its prefill/decode lines (execute +
    overhead), and the KV pool is the profiled engine's."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(linear_cost_model({"num_gpu_blocks": 77, "block_size": 16})))
    clock = FakeClock()
    engine = sim_engine(clock, simulate=str(path), sim_model=None, sim_hardware=None)
    assert engine.scheduler.cache_config.num_gpu_blocks == 77
    run(engine, [(list(range(100, 110)), SamplingParams(max_tokens=2, ignore_eos=True))])
    assert clock.waits == pytest.approx([0.010 + 0.001 * 10 + 0.001, 0.020 + 0.002 + 0.0005], abs=1e-12)
    with pytest.raises(ValueError, match="profiled with --block-size 16, not 32"):
        sim_engine(simulate=str(path), sim_model=None, sim_hardware=None, block_size=32)


def test_kv_capacity_is_the_priced_hardwares_unless_forced(engine):
    assert engine.scheduler.cache_config.num_gpu_blocks == kv_cache_capacity_blocks(LLAMA, H100, 16, 0.9)
    assert engine.executor.driver.determine_num_available_blocks()[1] == int((1 << 30) // kv_block_bytes(LLAMA, 16))
    forced = sim_engine(num_gpu_blocks=64)
    assert forced.scheduler.cache_config.num_gpu_blocks == 64


# ----------------------------------------------------------------------------- tokens

PROMPTS = [list(range(1000, 1012)), list(range(2000, 2030))]


def _params(**kw):
    kw.setdefault("max_tokens", 12)
    return SamplingParams(ignore_eos=True, **kw)


def test_tokens_are_deterministic_for_a_seed_and_differ_across_seeds(engine):
    seeded = [(p, _params(temperature=1.0, seed=7)) for p in PROMPTS]
    first, again = run(engine, seeded), run(sim_engine(seed=123), seeded)    # another server seed
    assert list(first.values()) == list(again.values())
    other = run(engine, [(p, _params(temperature=1.0, seed=8)) for p in PROMPTS])
    assert all(a != b for a, b in zip(first.values(), other.values()))
    # greedy ignores seeds; different prompts give different text
    greedy = [list(run(engine, [(p, _params(temperature=0.0, seed=s))]).values())[0] for p in PROMPTS for s in (1, 2)]
    assert greedy[0] == greedy[1] and greedy[2] == greedy[3] and greedy[0] != greedy[2]
    # unseeded random requests: a function of the server's --seed and their arrival order
    unseeded = [(p, _params(temperature=1.0)) for p in PROMPTS]
    x, y, z = (list(run(sim_engine(seed=s), unseeded).values()) for s in (5, 5, 6))
    assert x == y and x != z and x[0] != list(run(engine, seeded).values())[0]


def test_tokens_come_from_the_vocabulary_without_special_tokens(engine):
    tok = engine.tokenizer
    special = set(tok.all_special_ids) | {engine.eos_token_id}
    vocab = engine.executor.driver.vocab          # what every draw picks from
    assert set(vocab) == set(range(len(tok))) - special
    (out,) = run(engine, [(PROMPTS[0], _params(max_tokens=400, temperature=1.0, seed=3))]).values()
    tokens = out[0]
    assert len(tokens) == 400 and all(0 <= t < len(tok) and t not in special for t in tokens)
    assert len(set(tokens)) > 300                       # not a short cycle
    # without ignore_eos a request still runs to max_tokens: EOS is never drawn
    (out,) = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=50, temperature=1.0, seed=3))]).values()
    assert len(out[0]) == 50


def test_n_samples_differ_and_beams_and_logprobs_are_well_formed(engine):
    (choices,) = run(engine, [(PROMPTS[0], _params(n=3, temperature=1.0, seed=1))]).values()
    assert len(choices) == 3 and len({tuple(c) for c in choices}) == 3
    (beams,) = run(engine, [(PROMPTS[0], _params(beam_width=2, max_tokens=4))]).values()
    assert len(beams) == 2 and all(len(b) == 4 for b in beams) and beams[0] != beams[1]
    rid = engine.add_request(PROMPTS[1], _params(max_tokens=5, temperature=0.0, logprobs=3))
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == rid), last)
    out = last.outputs[0]
    assert len(out.logprobs) == 5
    for tok, top in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and top[tok] == max(top.values()) and all(v < 0 for v in top.values())


def test_min_tokens_holds_back_stop_token_ids(engine):
    (free,) = run(engine, [(PROMPTS[0], _params(max_tokens=6, temperature=0.0))]).values()
    stop = free[0][2]                       # the third token greedy decoding produces
    (held,) = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop],
                                                        min_tokens=4))]).values()
    assert stop not in held[0][:4] and len(held[0]) >= 4
    (stopped,) = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0,
                                                           stop_token_ids=[stop]))]).values()
    assert stopped[0] == free[0][:3]


def test_echo_repeats_the_prompt():
    engine = sim_engine(simulate_output="echo")
    prompt = [5000, 5001, 5002]
    (out,) = run(engine, [(prompt, _params(max_tokens=7, temperature=1.0))]).values()
    assert out[0] == [5000, 5001, 5002, 5000, 5001, 5002, 5000]


def test_sleep_forgets_sequences_and_a_step_while_asleep_is_refused(engine):
    worker = engine.executor.driver
    assert engine.sleep(1) == 0 and worker.num_tracked_seqs() == 0
    with pytest.raises(RuntimeError, match="asleep"):
        worker.execute_model(StepMessage())
    engine.wake_up()
    assert run(engine, [(PROMPTS[0], _params(max_tokens=2))])


# ----------------------------------------------------------------------------- bad flags

@pytest.mark.parametrize("kwargs, match", [
    (dict(simulate="missing.json"), r"--simulate 'missing.json': no such file .* or 'roofline'"),
    (dict(simulate="roofline", sim_model="GPT-5"), r"unknown model 'GPT-5'; choose one of: .*Llama-3-8B"),
    (dict(simulate="roofline", sim_hardware="TPU"), r"unknown hardware 'TPU'; choose one of: .*H100"),
    (dict(sim_model="Llama-3-8B"), r"--sim-model only applies with --simulate roofline"),
    (dict(simulate="roofline", pipeline_parallel_size=2), r"pipeline-parallel-size must be 1"),
    (dict(simulate="roofline", sim_model="Llama-3-8B", tensor_parallel_size=3), r"tp=3 does not split"),
    (dict(simulate="roofline", distributed_executor_backend="ray"), r"drop --distributed-executor-backend ray"),
    (dict(simulate="roofline", simulate_output="loud"), r"simulate-output must be one of random, echo"),
    (dict(simulate="roofline", sim_model="Llama-2-70B", sim_hardware="A100-40G"), r"weights need .* GiB"),
])
def test_bad_flags_are_refused_before_anything_loads(kwargs, match):
    from realexec.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineArgs(**kwargs))


def test_a_fitted_model_refuses_roofline_flags(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="--sim-model / --sim-hardware price a roofline"):
        EngineArgs(simulate=str(path), sim_model="Llama-3-8B").validate()
    with pytest.raises(ValueError, match="tensor-parallel-size 2 applies to roofline only"):
        EngineArgs(simulate=str(path), tensor_parallel_size=2).validate()
    from realexec.engine.llm_engine import LLMEngine
    with pytest.raises(ValueError, match=r"p.json: not a twinserve-step-cost file"):
        LLMEngine(EngineArgs(simulate=str(path)))
