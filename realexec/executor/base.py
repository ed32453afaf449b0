"""Executors: how the engine reaches its workers. Implements core.engine.Executor.

Every executor turns the scheduler's output into a step message (core.step_message) and
hands that message to its workers; every other worker call goes through
`collective_rpc(method, args, kwargs)`, which runs the method (a Worker method's name, or
a function called with the worker) on every worker and returns their results in rank
order. Three transports, one worker code path:
  * `UniprocExecutor` (`uni`): one worker in this process, the message passed as is;
  * `MultiprocExecutor` (`mp`, realexec/executor/multiproc.py): one process per rank on this
    machine, the message encoded once and written to each rank's pipe;
  * `RayExecutor` (`ray`, realexec/executor/ray_executor.py): one Ray actor per rank, the message
    inline with each actor call (or put once in Ray's object store when large).
Ranks = pipeline stages x tensor-parallel ranks (realexec/distributed.py); only the output
rank (the last stage's TP driver) returns sampled tokens.

Batches in flight (pipeline parallelism): `execute_model_async` sends a step's message to
every rank at once and returns a concurrent.futures.Future; the engine may send the next
step before this one's tokens are back. Messages are built and sent in schedule order;
one reader thread (`InOrderReplies`) collects the replies of every call, steps and RPCs
alike, in the order they were sent, so the workers' per-sequence state and the replies'
order never diverge. `execute_model` is the same call, waited for.

A worker that dies or stops answering raises `WorkerError` naming its rank and the cause
(from the call that is collected, and from every call still out); the executor is then
dead (every later call raises the same error) and has stopped its workers.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

from core.step_message import ModelRunnerOutput, StepMessage, StepMessageBuilder
from realexec.config import EngineArgs
from realexec.distributed import ParallelLayout


class WorkerError(RuntimeError):
    """A worker failed: died, hung, or raised. `rank` is the failing rank (None: unknown)."""

    def __init__(self, rank: int | None, cause: str):
        self.rank = rank
        self.cause = cause
        where = f"worker rank {rank}" if rank is not None else "a worker"
        super().__init__(f"{where} failed: {cause}")


class InOrderReplies:
    """Calls already sent to the workers, collected in the order they were sent.

    `submit(collect)` queues a blocking function that waits for one call's reply (on the
    transport: pipes, Ray references) and returns a Future of its value; one daemon thread
    runs the collectors one after another and resolves their futures. A collector that
    raises fails its own future; the next ones run (and raise the executor's error)."""

    def __init__(self, name: str):
        self._queue: deque[tuple[Future, Callable[[], object]]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.num_outstanding = 0          # submitted, future not resolved yet
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, collect: Callable[[], object], future: Future | None = None) -> Future:
        future = Future() if future is None else future
        future.set_running_or_notify_cancel()     # not cancellable: its reply must be read anyway
        with self._cond:
            if self._closed:
                raise RuntimeError("the executor is shut down")
            self._queue.append((future, collect))
            self.num_outstanding += 1
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                future, collect = self._queue.popleft()
            try:
                value = collect()
            except BaseException as e:        # noqa: BLE001 - handed to whoever waits on it
                with self._cond:
                    self.num_outstanding -= 1
                future.set_exception(e)
            else:
                with self._cond:
                    self.num_outstanding -= 1
                future.set_result(value)

    def close(self) -> None:
        """No more calls; the reader collects those already queued (they fail fast once the
        workers are gone) and exits."""
        with self._cond:
            self._closed = True
            self._cond.notify()


class _WaitTimedFuture(Future):
    """A step's Future that adds the time its caller blocks in result() to the executor's
    execute_time: with batches in flight that wait, not the batch's lifetime, is what the
    engine's step spends on the workers."""

    def __init__(self, executor: "ExecutorBase"):
        super().__init__()
        self._executor = executor

    def result(self, timeout=None):
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._executor._execute_time += time.perf_counter() - t0


class ExecutorBase:
    backend = "?"

    def __init__(self, args: EngineArgs):
        self.args = args
        self.layout = ParallelLayout(args.pipeline_parallel_size, args.tensor_parallel_size)
        self.world_size = self.layout.world_size
        self.output_rank = self.layout.output_rank     # the rank whose reply carries the tokens
        self.num_steps = 0
        self.message_bytes = 0           # encoded step-message bytes sent (per rank), all steps
        self._execute_time = 0.0
        self.builder = StepMessageBuilder()
        self.error: WorkerError | None = None
        self._submit_lock = threading.Lock()   # build + send + queue: one call at a time, in order
        self._replies: InOrderReplies | None = None
        self._init_workers()
        try:
            self.collective_rpc("init_device")
            self.model_config = self.collective_rpc("load_model")[0]
        except BaseException:
            self.shutdown()
            raise

    # -- what a transport provides ------------------------------------------------------
    def _init_workers(self) -> None:
        """Start the workers (and, for remote ones, `self._replies = InOrderReplies(...)`)."""
        raise NotImplementedError

    def _send_step(self, msg: StepMessage):
        """Send a step's message to every rank without waiting; -> a handle for `_collect`."""
        raise NotImplementedError

    def _send_rpc(self, method, args: tuple, kwargs: dict):
        """Send an RPC to every rank without waiting; -> a handle for `_collect`."""
        raise NotImplementedError

    def _collect(self, handle):
        """Wait for the replies of one call (run by the reader thread, in sending order):
        the output rank's ModelRunnerOutput for a step, every rank's value for an RPC."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""

    @property
    def tokenizer(self):
        raise NotImplementedError

    # -- the engine's calls -------------------------------------------------------------
    def determine_num_available_blocks(self) -> tuple[int, int]:
        """The smallest (gpu, cpu) block counts over workers: every worker holds every block id."""
        counts = self.collective_rpc("determine_num_available_blocks")
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_gpu_blocks, num_cpu_blocks))

    @property
    def execute_time(self) -> float:
        """Seconds the engine spent on steps: building and sending them, and blocked waiting
        for their results (with batches in flight the workers' time that overlaps the
        engine's own work is not in it)."""
        return self._execute_time

    def execute_model_async(self, scheduler_output) -> Future:
        """Send the step to every rank now; the Future resolves to its ModelRunnerOutput once
        the output rank answers. Call in schedule order: messages are deltas."""
        with self._submit_lock:
            if self.error is not None:
                raise self.error
            t0 = time.perf_counter()
            msg = self.builder.build(scheduler_output)
            handle = self._send_step(msg)
            self.num_steps += 1
            future = self._replies.submit(lambda: self._collect(handle), _WaitTimedFuture(self))
            self._execute_time += time.perf_counter() - t0
            return future

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run `method` on every rank (after the steps already sent); -> results in rank order."""
        with self._submit_lock:
            if self.error is not None:
                raise self.error
            handle = self._send_rpc(method, tuple(args), kwargs or {})
            future = self._replies.submit(lambda: self._collect(handle))
        return future.result()

    @property
    def num_in_flight(self) -> int:
        """Calls sent whose replies have not been collected yet."""
        return self._replies.num_outstanding if self._replies is not None else 0

    def sleep(self, level: int = 1) -> int:
        """Release device memory on every rank; -> bytes released (summed over ranks).
        The workers forget every sequence: so does the message builder."""
        released = sum(self.collective_rpc("sleep", (level,)))
        self.builder = StepMessageBuilder()
        return released

    def wake_up(self) -> None:
        self.collective_rpc("wake_up")

    def _fail(self, error: WorkerError) -> WorkerError:
        """Record the first failure, stop all workers, and return the error to raise."""
        if self.error is None:
            self.error = error
        self.shutdown()
        return self.error

    def _close_replies(self) -> None:
        if self._replies is not None:
            self._replies.close()


class UniprocExecutor(ExecutorBase):
    """One worker in this process. Calls run inline in the caller's thread (the device and
    torch's thread-local settings belong to it), so nothing is ever in flight; except under
    --async-scheduling, where every worker call, from init_device on, runs on one model
    thread of its own, in submission order: `execute_model_async` builds the step's message
    on the caller's thread (a snapshot of the scheduler's decision), queues it, and returns
    at once, so the engine schedules the next step and processes outputs while this one
    computes (torch releases the GIL inside its kernels)."""
    backend = "uni"
    _model_thread = None        # (subclasses that run no worker, like the simulated one, have none)

    def _init_workers(self) -> None:
        from realexec.worker.worker import Worker
        if self.world_size != 1:
            raise ValueError(f"the uni backend runs one worker; {self.layout.pp} pipeline stage(s) x "
                             f"{self.layout.tp} tensor-parallel rank(s) need --distributed-executor-backend "
                             f"mp or ray")
        self._model_thread = None
        if self.args.async_scheduling:
            from concurrent.futures import ThreadPoolExecutor
            self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinserve-model")
        self.driver = Worker(self.args, rank=0)
        self.workers = [self.driver]

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        from realexec.worker.worker import call_on_worker
        if self._model_thread is not None:      # after the steps already queued
            return [self._model_thread.submit(call_on_worker, w, method, args, kwargs).result()
                    for w in self.workers]
        return [call_on_worker(w, method, args, kwargs) for w in self.workers]

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        if self._model_thread is not None:
            return self.execute_model_async(scheduler_output).result()
        t0 = time.perf_counter()
        result = self._execute(self.builder.build(scheduler_output))
        self._execute_time += time.perf_counter() - t0
        self.num_steps += 1
        return result

    def _execute(self, msg: StepMessage) -> ModelRunnerOutput:
        return self.driver.execute_model(msg)

    def execute_model_async(self, scheduler_output) -> Future:
        if self._model_thread is None:
            future: Future = Future()
            future.set_result(self.execute_model(scheduler_output))
            return future
        t0 = time.perf_counter()
        msg = self.builder.build(scheduler_output)
        future = _WaitTimedFuture(self)

        def run() -> None:
            try:
                future.set_result(self._execute(msg))
            except BaseException as e:  # noqa: BLE001  (handed to the engine through the future)
                future.set_exception(e)

        self._model_thread.submit(run)
        self.num_steps += 1
        self._execute_time += time.perf_counter() - t0
        return future

    def shutdown(self) -> None:
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=True)

    @property
    def tokenizer(self):
        return self.driver.tokenizer


def load_engine_tokenizer(args: EngineArgs):
    """The tokenizer, for executors whose workers live elsewhere."""
    from realexec.models.loader import load_tokenizer, resolve_model_dir
    return load_tokenizer(resolve_model_dir(args.model))
