"""Pipeline parallelism in the simulator: P stages of tp GPUs each, up to P batches in flight.

    python -m sim run TRACE --model Llama-2-70B --hardware A100-80G -tp 4 -pp 2

Stages. The decoder layers are split into P contiguous stages (`core.config.
pipeline_stage_layers`: even, or `--pp-layer-partition`). Each stage is priced by the
roofline over its own layers (`RooflineCostModel(num_layers=..., last_stage=...)`): the
LM head (and the sampled rows' FLOPs) on the last stage, the per-step CPU overhead
(scheduling, input preparation) on the first. Between stages the hidden state and the
residual (2 x hidden x tokens x dtype bytes) cross a link: NVLink of the hardware when
the P x tp GPUs fit one 8-GPU node, else a 200 Gb/s InfiniBand NIC (25 GB/s), or
`--pp-link-bandwidth`. Swaps run on every stage at once (each its own layers' blocks).

Memory. Each stage holds the KV of its layers only, with the same block ids on every
stage; the engine's block count is the minimum over stages of what a rank of that stage
affords after its weights (the first stage holds the embedding, the last the LM head).

The layout, the stages' prices and the KV capacity live in `sim.cluster.pipeline_stages`.

The loop. Stages and links are FIFO servers of one batch at a time (`PipelineExecutor`:
the recurrence SimPy resources of capacity 1 would follow), so batch i on stage k
overlaps batch i-1 on stage k+1. Which batches fly is the core's decision, not the simulator's: the
loop drives `core.EngineCore` (max_concurrent_batches = P) through `fill()` (schedule and
submit while fewer than P fly) and `land_oldest()` (update with the oldest batch once its
process has left the last stage); the scheduler's in-flight rule keeps a request out of a
second batch. While fewer than P batches fly, an arrival wakes the loop to schedule it
(vLLM v1's batch queue does the same). Event skipping is off for P > 1: every batch is
simulated one by one.

P = 1 never comes here: `sim.run.simulate` runs the one-batch engine, bit for bit as
before this module existed.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import simpy

from core import EngineCore, SchedulerOutput
from core.cost.model import BatchShape
from sim.engine import ResolvedConfig, SimEngine, SimResult
from sim.executor import SimExecutor
from sim.memory import sample as memory_sample
from sim.cluster.pipeline_stages import PipelineCostModel, PipelineLayout

def batch_shape(out: SchedulerOutput) -> BatchShape:
    """The scheduled slices reduced to the sums the roofline prices (as SimExecutor does)."""
    pairs = ctx = 0
    for s in out.scheduled:
        t, c = s.num_tokens, s.start
        ctx += c
        pairs += t * c + t * (t + 1) // 2
    return BatchShape(len(out.scheduled), out.num_batched_tokens, ctx, pairs)


class PipelineExecutor(SimExecutor):
    """`execute_model_async` over P stages and P - 1 links, each a FIFO server that takes
    one batch at a time: batch i starts stage k once it has crossed the link from stage
    k - 1 and batch i - 1 has left stage k. Batches are submitted in order, so each one's
    path is known when it is submitted (what SimPy resources of capacity 1 would give,
    without a process per stage); its future and SimPy event complete when it leaves
    the last stage."""

    def __init__(self, cost_model: PipelineCostModel, block_bytes: int, env: simpy.Environment, seed: int = 0):
        super().__init__(cost_model, block_bytes, seed=seed)
        self.pipeline = cost_model
        self.env = env
        pp = cost_model.layout.pp
        self.stage_free = [0.0] * pp          # when each stage finishes the batches it was given
        self.link_free = [0.0] * (pp - 1)
        self.stage_busy = [0.0] * pp          # seconds each stage computed (and swapped)
        self.link_busy = [0.0] * (pp - 1)
        self.done: deque[simpy.Event] = deque()   # per batch in flight, oldest first

    def execute_model_async(self, out: SchedulerOutput) -> Future:
        times = self.pipeline.stage_times(batch_shape(out)) if out.scheduled else [0.0] * len(self.stage_free)
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            swap = self._swaps(out)               # every stage swaps its own layers' blocks at once
            times = [t + swap for t in times]
        transfer = self.pipeline.transfer_time(out.num_batched_tokens) if out.scheduled else 0.0
        t = self.env.now
        last = len(times) - 1
        for k, dt in enumerate(times):
            start = self.stage_free[k] if self.stage_free[k] > t else t
            t = self.stage_free[k] = start + dt
            self.stage_busy[k] += dt
            if k < last:
                start = self.link_free[k] if self.link_free[k] > t else t
                t = self.link_free[k] = start + transfer
                self.link_busy[k] += transfer
        future: Future = Future()
        future.set_result(self.execute_model(out))    # tokens: a pure function of the (frozen) inputs
        self.done.append(self.env.timeout(t - self.env.now))
        return future


# -- the engine ---------------------------------------------------------------------------------

class PipelineSimEngine(SimEngine):
    """SimEngine's requests, arrivals, records and results, with P batches in flight.
    `max_batches_in_flight` (default P) lowers that number: 1 shows the idle pipeline
    that pipeline parallelism without a batch queue would be."""

    def __init__(self, resolved: ResolvedConfig, trace, *, progress: bool = False,
                 max_batches_in_flight: int | None = None):
        super().__init__(resolved, trace, progress=progress)
        cfg = resolved.config
        self.layout = PipelineLayout.of(resolved.model, resolved.hardware, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.pp_layer_partition,
                                        cfg.pp_link_bandwidth)
        self._queue_batches(PipelineExecutor(PipelineCostModel(resolved.model, resolved.hardware, self.layout),
                                             resolved.block_bytes, self.env, seed=cfg.seed),
                            max_batches_in_flight or self.layout.pp)

    def _queue_batches(self, executor, max_batches: int) -> None:
        """Run `executor` (an `execute_model_async` whose `done` events the loop waits on)
        with up to `max_batches` batches in flight, every step one by one."""
        executor.fast_tokens = self.executor.fast_tokens
        self.executor = executor
        self.event_skipping = False
        self.max_batches = max_batches
        self.core = EngineCore(self.scheduler, executor, clock=lambda: self.clock, max_concurrent_batches=max_batches)
        self._mark = 0.0              # start of the interval not yet accounted
        self._w_in_flight = 0.0       # time integral of batches in flight

    def _sample_state(self) -> tuple:
        sched = self.scheduler
        flying = self.core.in_flight
        return (sched.kv.gpu.num_used, len(sched.running), len(sched.waiting), len(sched.swapped),
                memory_sample(sched), len(flying), sum(len(o.scheduled) for o in flying),
                sum(o.num_batched_tokens for o in flying), sum(len(o.preempted) for o in flying))

    def _account_until(self, now: float, state: tuple, landed: int) -> None:
        """Weight the state held since the mark by the time until `now` (one timeseries row)."""
        dt = now - self._mark
        if dt <= 0.0:
            return
        used, running, waiting, swapped, mem, flying, seqs, tokens, preempted = state
        self._account(dt, used, running, waiting, swapped)
        self.memory.add(dt, mem)
        self._w_in_flight += flying * dt
        self.timeseries.step(self._mark, dt, used, running, waiting, swapped, seqs, tokens, preempted, mem,
                             steps=landed)
        self._mark = now

    def _engine_process(self):
        env, sched, core, ex = self.env, self.scheduler, self.core, self.executor
        arrivals, n_total, ready = self.arrivals, len(self.arrivals), self._ready
        pp = self.max_batches
        while True:
            clock = self.clock
            if (self._next < n_total and arrivals[self._next] <= clock) or (ready and ready[0][0] <= clock):
                self._intake(clock)
            if not core.num_in_flight:
                if not sched.requests:
                    if self._next >= n_total and not ready:
                        break
                    self._mark = clock
                    yield from self._idle_until(self._next_event())
                    self._mark = self.clock
                    continue
            empty = core.fill()
            if empty is not None:                   # nothing runnable now and nothing flies
                self._finish(empty.finished)
                if sched.requests and (self._next < n_total or ready):
                    self._mark = self.clock
                    yield from self._idle_until(self._next_event())
                    self._mark = self.clock
                    continue
                if sched.requests:
                    raise RuntimeError(f"the scheduler made no progress at t={clock:.6f} with "
                                       f"{len(sched.requests)} unfinished requests")
                continue
            state = self._sample_state()
            oldest = ex.done[0]
            more = self._next < n_total or ready
            if core.num_in_flight < pp and more:
                # Room in the pipeline: the next arrival may start a batch before the oldest lands.
                t = self._next_event()
                yield oldest | env.timeout(max(0.0, t - env.now))
                if not oldest.processed:
                    self._account_until(env.now, state, 0)
                    self.clock = max(self.clock, env.now, t)
                    continue
            else:
                yield oldest
            self._account_until(env.now, state, 1)
            self.clock = max(self.clock, env.now)
            ex.done.popleft()
            self._finish(core.land_oldest().finished)
            self.num_steps += 1
            self.num_normal_steps += 1

    def build_result(self, records, requested_output_lens) -> SimResult:
        result = super().build_result(records, requested_output_lens)
        total = self.clock
        layout, ex = self.layout, self.executor
        result.pipeline = {
            "pp": layout.pp, "tp": layout.tp, "max_batches_in_flight": self.max_batches, "gpus": layout.gpus, "stage_layers": list(layout.stage_layers),
            "link_bandwidth": layout.link_bandwidth,
            "stage_busy": [b / total if total > 0 else 0.0 for b in ex.stage_busy],
            "link_busy": [b / total if total > 0 else 0.0 for b in ex.link_busy],
            "batches_in_flight_mean": self._w_in_flight / total if total > 0 else 0.0,
        }
        return result
