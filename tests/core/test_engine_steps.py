"""EngineCore hands the executor every step that has work for it."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from core import EngineCore, ModelRunnerOutput, SchedulerOutput, StepResult


class _Scripted:
    """A scheduler stand-in that returns the given outputs, then empty ones."""

    def __init__(self, outs: list[SchedulerOutput]):
        self.outs = list(outs)
        self.updated: list[SchedulerOutput] = []

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        return self.outs.pop(0) if self.outs else SchedulerOutput()

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput, now: float = 0.0) -> StepResult:
        self.updated.append(out)
        return StepResult(updated=[], finished=[])


class _Recorder:
    def __init__(self):
        self.executed: list[SchedulerOutput] = []

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.executed.append(out)
        return ModelRunnerOutput(token_ids={})

    def execute_model_async(self, out: SchedulerOutput) -> Future:
        f = Future()
        f.set_result(self.execute_model(out))
        return f


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("work", ["blocks_to_swap_in", "blocks_to_copy", "blocks_to_swap_out"])
def test_a_step_that_only_moves_blocks_is_executed(pp, work):
    """A swap-in whose request could not also compute this step (the pool is short, e.g.
    while other requests fly) still has blocks to copy: the workers must run it, or the
    request later reads KV that never arrived."""
    out = SchedulerOutput(**{work: [(3, 7)]})
    assert not out.is_empty
    ex = _Recorder()
    EngineCore(_Scripted([out]), ex, max_concurrent_batches=pp).step()
    assert ex.executed == [out]


def test_finished_ids_reach_the_executor_with_nothing_else_to_run():
    """With one batch at a time, requests that left (e.g. the last one aborted) reach the
    runner, which drops their state, even when no slice runs."""
    out = SchedulerOutput(finished_request_ids=["r0"])
    assert out.is_empty
    ex = _Recorder()
    EngineCore(_Scripted([out]), ex).step()
    assert ex.executed == [out]


def test_an_empty_step_is_not_executed():
    ex = _Recorder()
    EngineCore(_Scripted([]), ex).step()
    assert ex.executed == []
