"""Executors: how the engine reaches its workers. Implements core.engine.Executor.

Every executor turns the scheduler's output into a step message (core.step_message) and
hands that message to its workers; every other worker call goes through
`collective_rpc(method, args, kwargs)`, which runs the method on every worker and returns
their results in rank order. Three transports, one worker code path:
  * `UniprocExecutor` (`uni`): one worker in this process, the message passed as is;
  * `MultiprocExecutor` (`mp`, realexec/mp_executor.py): one process per tensor-parallel
    rank on this machine, the message encoded once and written to each rank's pipe;
  * `RayExecutor` (`ray`, realexec/ray_executor.py): one Ray actor per rank, the message
    put once in Ray's object store.
Only the driver rank (0) returns sampled tokens. A worker that dies or stops answering
raises `WorkerError` naming its rank and the cause; the executor is then dead (every
later call raises the same error) and has stopped its workers.
"""
from __future__ import annotations

import time

from core.step_message import ModelRunnerOutput, StepMessage, StepMessageBuilder
from realexec.config import EngineArgs


class WorkerError(RuntimeError):
    """A worker failed: died, hung, or raised. `rank` is the failing rank (None: unknown)."""

    def __init__(self, rank: int | None, cause: str):
        self.rank = rank
        self.cause = cause
        where = f"worker rank {rank}" if rank is not None else "a worker"
        super().__init__(f"{where} failed: {cause}")


class ExecutorBase:
    backend = "?"

    def __init__(self, args: EngineArgs):
        self.args = args
        self.world_size = args.tensor_parallel_size
        self.execute_time = 0.0          # wall seconds inside execute_model (swaps, forward, sampling)
        self.num_steps = 0
        self.message_bytes = 0           # encoded step-message bytes sent (per rank), all steps
        self.builder = StepMessageBuilder()
        self.error: WorkerError | None = None
        self._init_workers()
        try:
            self.collective_rpc("init_device")
            self.model_config = self.collective_rpc("load_model")[0]
        except BaseException:
            self.shutdown()
            raise

    # -- what a transport provides ------------------------------------------------------
    def _init_workers(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        raise NotImplementedError

    def _execute(self, msg: StepMessage) -> ModelRunnerOutput:
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

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        if self.error is not None:
            raise self.error
        t0 = time.perf_counter()
        result = self._execute(self.builder.build(scheduler_output))
        self.execute_time += time.perf_counter() - t0
        self.num_steps += 1
        return result

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


class UniprocExecutor(ExecutorBase):
    """One worker in this process."""
    backend = "uni"

    def _init_workers(self) -> None:
        from realexec.worker import Worker
        if self.world_size != 1:
            raise ValueError(f"the uni backend runs one worker; tensor-parallel-size {self.world_size} "
                             f"needs --distributed-executor-backend mp or ray")
        self.driver = Worker(self.args, rank=0)
        self.workers = [self.driver]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def _execute(self, msg: StepMessage) -> ModelRunnerOutput:
        return self.driver.execute_model(msg)

    @property
    def tokenizer(self):
        return self.driver.tokenizer


def load_engine_tokenizer(args: EngineArgs):
    """The tokenizer, for executors whose workers live elsewhere."""
    from realexec.loader import load_tokenizer, resolve_model_dir
    return load_tokenizer(resolve_model_dir(args.model))
