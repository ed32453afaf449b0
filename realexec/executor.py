"""Executors: how the engine reaches its workers. Implements core.engine.Executor.

Every worker call goes through `collective_rpc(method, args, kwargs)`, which calls the
method on every worker and returns their results in rank order. `UniprocExecutor` has
one in-process worker; a multiprocess (tensor-parallel) or Ray executor only has to
provide another `collective_rpc` (and keep rank 0 in-process for the tokenizer).
"""
from __future__ import annotations

import time

from core import ModelRunnerOutput, SchedulerOutput
from realexec.config import EngineArgs
from realexec.worker import Worker


class ExecutorBase:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.execute_time = 0.0          # wall seconds inside execute_model (swaps, forward, sampling)
        self._init_workers()
        self.collective_rpc("init_device")
        self.model_config = self.collective_rpc("load_model")[0]

    def _init_workers(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        raise NotImplementedError

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """The smallest (gpu, cpu) block counts over workers: every worker holds every block id."""
        counts = self.collective_rpc("determine_num_available_blocks")
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_gpu_blocks, num_cpu_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        result = self.collective_rpc("execute_model", (scheduler_output,))[0]
        self.execute_time += time.perf_counter() - t0
        return result


class UniprocExecutor(ExecutorBase):
    """One worker in this process."""

    def _init_workers(self) -> None:
        self.driver = Worker(self.args, rank=0)
        self.workers = [self.driver]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    @property
    def tokenizer(self):
        return self.driver.tokenizer


EXECUTORS = {"uniproc": UniprocExecutor}
