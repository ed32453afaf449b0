"""Async scheduling in the simulator: the host's per-step work overlaps the device's.

    python -m sim run TRACE --async-scheduling

The engine (`--async-scheduling` on the real engine, vLLM's async scheduling) schedules
step N+1 while step N computes, so a step's host work (scheduling, input preparation,
output processing) no longer adds to the device's: the core keeps 2 batches in flight and
its scheduler decodes, for a request in flight, the token its batch samples (core.sched.
scheduler). Here a step is priced as two parts on two FIFO servers, the host and the
device: the cost model's `host_time(batch)` (the roofline's per-step overhead; a fitted
profile's overhead part), then the rest of its step time on the device, which starts once
the host has prepared the step and the device has finished the step before. With host
work h and device work d per step, steps complete every max(h, d) instead of h + d.

This assumes the host has a core of its own (a GPU box). On a CPU-only engine the host
and the model share the cores: the real engine measured no gain there (the real-engine
guide), and a twin fitted on it would price one that is not there.

The loop is the pipelined engine's (`sim.cluster.pipeline_parallel`, a batch queue of 2):
`EngineCore.fill()` / `land_oldest()`, every step one by one (no event skipping).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import simpy

from core import SchedulerOutput
from sim.cluster.pipeline_parallel import PipelineSimEngine, batch_shape
from sim.engine import ResolvedConfig, SimEngine, SimResult
from sim.executor import SimExecutor


class AsyncSchedulingExecutor(SimExecutor):
    """`execute_model_async` through a host server, then a device server, each one step at a
    time in submission order; a step's future completes with its tokens at once (a pure
    function of its frozen inputs) and its SimPy event when the device finishes it."""

    def __init__(self, cost_model, block_bytes: int, env: simpy.Environment, seed: int = 0):
        super().__init__(cost_model, block_bytes, seed=seed)
        self.env = env
        self._host_time = getattr(cost_model, "host_time", None)
        self.host_free = self.device_free = 0.0    # when each server finishes what it was given
        self.host_busy = self.device_busy = 0.0
        self.done: deque[simpy.Event] = deque()    # per batch in flight, oldest first

    def split(self, out: SchedulerOutput) -> tuple[float, float]:
        """(host, device) seconds of a step: its step time, the host's share first (swaps on
        the device)."""
        host = device = 0.0
        if out.scheduled:
            shape = batch_shape(out)
            device = self._step_time(shape)
            if self._host_time is not None:
                host = min(device, self._host_time(shape))
                device -= host
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            device += self._swaps(out)
        return host, device

    def execute_model_async(self, out: SchedulerOutput) -> Future:
        host, device = self.split(out)
        now = self.env.now
        self.host_free = max(self.host_free, now) + host
        self.device_free = max(self.device_free, self.host_free) + device
        self.host_busy += host
        self.device_busy += device
        future: Future = Future()
        future.set_result(self.execute_model(out))
        self.done.append(self.env.timeout(self.device_free - now))
        return future


class AsyncSimEngine(PipelineSimEngine):
    """SimEngine's requests, arrivals, records and results; the batch queue of 2 of the
    pipelined loop over a host and a device instead of P stages."""

    def __init__(self, resolved: ResolvedConfig, trace, *, progress: bool = False):
        SimEngine.__init__(self, resolved, trace, progress=progress)
        self._queue_batches(AsyncSchedulingExecutor(self.executor.cost_model, resolved.block_bytes, self.env,
                                                    seed=resolved.config.seed), 2)

    def build_result(self, records, requested_output_lens) -> SimResult:
        result = SimEngine.build_result(self, records, requested_output_lens)
        total, ex = self.clock, self.executor
        result.async_scheduling = {
            "host_busy": ex.host_busy / total if total > 0 else 0.0,
            "device_busy": ex.device_busy / total if total > 0 else 0.0,
            "host_s": ex.host_busy, "device_s": ex.device_busy,
            "batches_in_flight_mean": self._w_in_flight / total if total > 0 else 0.0,
        }
        return result
