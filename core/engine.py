"""EngineCore: schedule -> execute -> update. Backends implement `Executor`.

With pipeline parallelism (P stages) the engine keeps up to P batches in flight, so that
stage k works on batch i while stage k+1 works on batch i-1: vLLM v1's batch queue. We
chose it over v0's virtual engines (P schedulers, each owning a share of the requests and
the KV pool) because one scheduler keeps one KV pool, one queue order and one place that
decides; the scheduler's in-flight rule (see core.sched.scheduler) is all it takes.
"""
from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future
from typing import Callable, Protocol

from core.sched.request import Request
from core.outputs import ModelRunnerOutput, SchedulerOutput, StepResult
from core.sched.scheduler import Scheduler

_EMPTY = ModelRunnerOutput(token_ids={})


class Executor(Protocol):
    """What a backend implements. The simulator's executor charges modelled time; the
    real one runs the model (uniproc, multiproc tensor-parallel or Ray workers).

    For more than one batch in flight it also offers
    `execute_model_async(scheduler_output) -> concurrent.futures.Future[ModelRunnerOutput]`,
    which must not wait for the batch to finish."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """Drives the scheduler and the executor. It knows no clock: `clock()` is the caller's
    (SimPy's `env.now`, or `time.monotonic` in the server); the default counts steps.

    max_concurrent_batches (P): batches in flight at once. P = 1 is schedule ->
    execute_model -> update. P > 1 needs `executor.execute_model_async`; each `step()`
    submits new batches while fewer than P fly and the scheduler finds work, then waits
    for the oldest, updates the scheduler with it and returns its StepResult."""

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Callable[[], float] | None = None,
                 max_concurrent_batches: int = 1):
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        if max_concurrent_batches > 1 and not callable(getattr(executor, "execute_model_async", None)):
            raise TypeError(f"{type(executor).__name__} has no execute_model_async(); it is needed for "
                            f"max_concurrent_batches={max_concurrent_batches} (pipeline parallelism)")
        self.scheduler = scheduler
        self.executor = executor
        if clock is None:
            steps = itertools.count()
            clock = lambda: float(next(steps))  # noqa: E731
        self.clock = clock
        self.max_concurrent_batches = max_concurrent_batches
        self._batches: deque[tuple[SchedulerOutput, Future]] = deque()   # in flight, oldest first

    def add_request(self, request: Request) -> Request:
        return self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_in_flight(self) -> int:
        return len(self._batches)

    @property
    def in_flight(self) -> list[SchedulerOutput]:
        """The batches submitted and not yet landed, oldest first."""
        return [out for out, _ in self._batches]

    def step(self) -> StepResult:
        if self.max_concurrent_batches == 1:
            out = self.scheduler.schedule(self.clock())
            # Requests that left since the last step reach the executor too (its runner drops
            # their state), even when nothing else runs.
            result = self.executor.execute_model(out) if not out.is_empty or out.finished_request_ids else _EMPTY
            return self.scheduler.update(out, result, self.clock())
        return self._pipelined_step()

    def _pipelined_step(self) -> StepResult:
        empty = self.fill()
        return empty if empty is not None else self.land_oldest()

    def fill(self) -> StepResult | None:
        """Schedule and submit batches while fewer than P fly and the scheduler finds work.
        If nothing flies and nothing could be scheduled, that was an empty step: it is
        applied and its StepResult returned (as `step()` would); otherwise None.
        (`step()` is fill + land_oldest; a driver that must not block, like the simulator,
        calls them apart and lands the oldest once its future is done.)"""
        scheduler, batches = self.scheduler, self._batches
        while len(batches) < self.max_concurrent_batches:
            out = scheduler.schedule(self.clock())
            if out.is_empty:
                if not batches:         # nothing flies: an empty step, as with P = 1
                    return scheduler.update(out, _EMPTY, self.clock())
                break                   # no batch: nothing new runs until the oldest returns
            batches.append((out, self.executor.execute_model_async(out)))
        return None

    def land_oldest(self) -> StepResult:
        """Wait for the oldest batch in flight and update the scheduler with its output."""
        out, future = self._batches.popleft()
        try:
            result = future.result()
        except BaseException:
            self._batches.appendleft((out, future))   # still in flight for the scheduler too
            raise
        return self.scheduler.update(out, result, self.clock())

    def run_until_done(self, max_steps: int | None = None) -> list[Request]:
        """Step until every request has left the engine; returns them in finish order."""
        finished: list[Request] = []
        steps = 0
        while self.scheduler.has_unfinished_requests() or self.scheduler.has_unreported_finishes or self._batches:
            finished.extend(self.step().finished)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"engine did not drain within {max_steps} steps")
        return finished
