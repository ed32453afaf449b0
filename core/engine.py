"""EngineCore: schedule -> execute -> update. Backends implement `Executor`."""
from __future__ import annotations

import itertools
from typing import Callable, Protocol

from core.request import Request
from core.outputs import ModelRunnerOutput, SchedulerOutput, StepResult
from core.scheduler import Scheduler


class Executor(Protocol):
    """What a backend implements. The simulator's executor charges modelled time; the
    real one runs the model (uniproc, multiproc tensor-parallel or Ray workers)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """Drives one step at a time. It knows no clock: `clock()` is the caller's (SimPy's
    `env.now`, or `time.monotonic` in the server); the default counts steps."""

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Callable[[], float] | None = None):
        self.scheduler = scheduler
        self.executor = executor
        if clock is None:
            steps = itertools.count()
            clock = lambda: float(next(steps))  # noqa: E731
        self.clock = clock

    def add_request(self, request: Request) -> Request:
        return self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepResult:
        out = self.scheduler.schedule(self.clock())
        result = self.executor.execute_model(out) if not out.is_empty else ModelRunnerOutput(token_ids={})
        return self.scheduler.update(out, result, self.clock())

    def run_until_done(self, max_steps: int | None = None) -> list[Request]:
        """Step until every request has left the engine; returns them in finish order."""
        finished: list[Request] = []
        steps = 0
        while self.scheduler.has_unfinished_requests() or self.scheduler.has_unreported_finishes:
            finished.extend(self.step().finished)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"engine did not drain within {max_steps} steps")
        return finished
