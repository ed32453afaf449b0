"""LoopEngine: the simulated engine driven from the event loop (no engine thread).

Each test runs its own asyncio loop around one simulated engine (a made-up linear cost
model: a one-sequence decode step takes DECODE_S), so the step timings, the hand-over,
shutdown, faults and sleep are checked without HTTP; the OpenAI-client tests of
test_simulated_server.py run the same driver behind the server.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from core import SamplingParams
from realexec.server.async_engine import AsyncEngine, LoopEngine, make_async_engine
from realexec.server.errors import EngineDeadError
from tests.realexec.executor.test_simulated import linear_cost_model, sim_engine

PREFILL_S = 0.010 + 0.001 * 4 + 0.001            # a 4-token prompt: execute + per token + overhead
DECODE_S = 0.020 + 0.030 + 0.0005                # one sequence: execute + per token + overhead


@pytest.fixture
def cost_model(tmp_path) -> str:
    path = tmp_path / "linear.json"
    path.write_text(json.dumps(linear_cost_model({"num_gpu_blocks": 64, "block_size": 16},
                                                 decode_per_token=0.030)))
    return str(path)


def loop_engine(cost_model: str, **kw) -> LoopEngine:
    engine = sim_engine(simulate=cost_model, sim_model=None, sim_hardware=None, **kw)
    driver = make_async_engine(engine)
    assert isinstance(driver, LoopEngine)
    return driver


async def tokens_with_times(driver: LoopEngine, max_tokens: int) -> tuple[list[float], list]:
    """One request's outputs and when each arrived (loop time of the arrival, from the add)."""
    driver.start()
    t0 = time.monotonic()
    stream = await driver.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    times, outs = [], []
    async for _, out in stream:
        times.append(time.monotonic() - t0)
        outs.append(out)
    return times, outs


def test_the_simulated_engine_gets_the_loop_driver_others_the_thread(cost_model):
    """make_async_engine: a simulated executor on the wall clock -> LoopEngine; one on a
    FakeClock (tests) cannot defer its waits -> the engine thread."""
    from realexec.executor.simulated import FakeClock

    assert isinstance(loop_engine(cost_model), LoopEngine)
    faked = sim_engine(FakeClock(), simulate=cost_model, sim_model=None, sim_hardware=None)
    assert isinstance(make_async_engine(faked), AsyncEngine)
    with pytest.raises(RuntimeError, match="only a real-time one can be deferred"):
        LoopEngine(faked)


def test_tokens_arrive_on_the_cost_models_timeline_and_no_thread_runs(cost_model):
    """The first token after the prefill's price, each next one a decode step's price
    later: never ahead of that timeline (the outputs wait for the step's end), and not
    behind it beyond timer slack, with the steps anchored end to end (no drift). No
    engine thread is started."""
    driver = loop_engine(cost_model)
    threads_before = {t.name for t in threading.enumerate()}
    times, outs = asyncio.run(tokens_with_times(driver, 12))
    assert "twinserve-engine" not in {t.name for t in threading.enumerate()} - threads_before
    assert len(outs) == 12 and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
    schedule = [PREFILL_S + k * DECODE_S for k in range(12)]
    for k, (got, due) in enumerate(zip(times, schedule)):
        assert got >= due - 0.002, f"token {k} arrived {due - got:.4f} s before its step ended"
    assert times[-1] <= schedule[-1] * 1.10, (times, schedule)
    # the engine's own stamps (the server's TTFT/ITL histograms) are the steps' ends too
    m = outs[-1].metrics
    assert m.first_token_time - m.arrival_time == pytest.approx(PREFILL_S, abs=0.003)
    gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
    assert gaps == pytest.approx([DECODE_S] * 11, abs=1e-9)
    worker = driver.engine.executor.driver
    assert worker.num_steps == 12 and worker.priced_s == pytest.approx(schedule[-1], rel=1e-9)


def test_a_busy_loop_delays_hand_overs_not_the_deployments_timeline(cost_model):
    """Other work holds the loop (HTTP, other replicas: here 30 ms blocks, more than a
    step's overhead): each step still starts at the previous one's end, so the engine's
    token stamps keep the priced spacing exactly and the last token is not later than
    its priced time plus one block."""
    driver = loop_engine(cost_model)
    block = 0.030

    async def busy_neighbour():
        while True:
            await asyncio.sleep(0.011)
            time.sleep(block)                  # holds the loop, as a slow handler would

    async def main():
        neighbour = asyncio.ensure_future(busy_neighbour())
        try:
            return await tokens_with_times(driver, 12)
        finally:
            neighbour.cancel()

    times, outs = asyncio.run(main())
    m = outs[-1].metrics
    gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
    assert gaps == pytest.approx([DECODE_S] * 11, abs=1e-9)
    assert times[-1] <= PREFILL_S + 11 * DECODE_S + block + 0.015, times


def test_shutdown_from_another_thread_mid_step_ends_the_stream(cost_model):
    """shutdown() from a worker thread (the server's lifespan does so) while a step waits:
    the stream gets the outputs it had and then EngineDeadError; every KV block is freed
    and new requests are refused."""
    driver = loop_engine(cost_model)

    async def main():
        driver.start()
        stream = await driver.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=1000, ignore_eos=True))
        seen = 0
        with pytest.raises(EngineDeadError, match="the server shut down"):
            async for _ in stream:
                seen += 1
                if seen == 2:
                    await asyncio.to_thread(driver.shutdown, 5.0)
        assert seen >= 2
        with pytest.raises(EngineDeadError, match="not running"):
            await driver.generate([[1, 2]], SamplingParams(max_tokens=1))

    asyncio.run(asyncio.wait_for(main(), 30))
    assert driver.engine.scheduler.kv.stats().num_used_gpu_blocks == 0
    assert not driver.is_running


def test_shutdown_while_a_streams_last_step_waits_hands_that_step_over(cost_model):
    """The step in flight at shutdown finishes a request: its final output still reaches
    the stream (it left the engine's books, so no shutdown error would reach it: it must
    not hang)."""
    driver = loop_engine(cost_model)

    async def main():
        driver.start()
        stream = await driver.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=2, ignore_eos=True))
        outs = []
        async for _, out in stream:
            outs.append(out)
            if len(outs) == 1:                 # the second (last) token's step is waiting now
                driver.shutdown()
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 10))
    assert [o.finished for o in outs] == [False, True]


def test_a_failing_step_ends_every_stream_and_later_requests(cost_model):
    """A step that raises: every open stream and every queued add gets EngineDeadError
    naming the fault, and the driver stops stepping (no retry loop on the event loop)."""
    driver = loop_engine(cost_model, max_num_seqs=1)
    steps = [0]

    def before_step():
        steps[0] += 1
        if steps[0] == 3:
            raise RuntimeError("injected step failure")
    driver.before_step = before_step

    async def main():
        driver.start()
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        first = await driver.generate([[11, 12, 13]], params)

        async def second():          # added while a step waits; max_num_seqs=1: it would wait
            async for _ in await driver.generate([[21, 22, 23]], params):
                pass

        async def drain(stream):
            async for _ in stream:
                pass
        results = await asyncio.gather(drain(first), second(), return_exceptions=True)
        assert [type(r) for r in results] == [EngineDeadError] * 2, results
        assert all("injected step failure" in str(r) for r in results)
        await asyncio.sleep(3 * DECODE_S)
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await driver.generate([[1, 2]], params)

    asyncio.run(asyncio.wait_for(main(), 30))
    assert steps[0] == 3 and isinstance(driver.error, RuntimeError)


def test_a_sleeping_engine_holds_requests_until_it_wakes(cost_model):
    """/sleep then a request: it is accepted and waits without steps (the driver looks
    again every 10 ms, it does not spin); wake_up from another thread lets it run."""
    driver = loop_engine(cost_model)
    engine = driver.engine

    async def main():
        driver.start()
        engine.sleep(1)
        stream = await driver.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=3, ignore_eos=True))
        cpu0 = time.thread_time()              # this thread runs the loop, the driver's too
        await asyncio.sleep(0.3)
        assert time.thread_time() - cpu0 < 0.15, "the driver spins while the engine sleeps"
        assert engine.executor.driver.num_steps == 0 and engine.scheduler.num_waiting == 1
        await asyncio.to_thread(engine.wake_up)
        return [out async for _, out in stream]

    outs = asyncio.run(asyncio.wait_for(main(), 30))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
