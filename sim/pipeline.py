"""Pipeline parallelism in the simulator: P stages of tp GPUs each, up to P batches in flight.

    python -m sim run TRACE --model Llama-2-70B --hardware A100-80G --tp 4 --pp 2

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

The loop. Stages and links are FIFO servers of one batch at a time (`PipelineExecutor`:
the recurrence SimPy resources of capacity 1 would follow), so batch i on stage k
overlaps batch i-1 on stage k+1. Which batches fly is the core's decision, not the simulator's: the
loop drives `core.EngineCore` (max_concurrent_batches = P) through `fill()` (schedule and
submit while fewer than P fly) and `land_oldest()` (update with the oldest batch once its
process has left the last stage); the scheduler's in-flight rule keeps a request out of a
second batch. While fewer than P batches fly, an arrival wakes the loop to schedule it
(vLLM v1's batch queue does the same). Event skipping is off for P > 1: every batch is
simulated one by one.

P = 1 never comes here: `sim.engine.simulate` runs the one-batch engine, bit for bit as
before this module existed.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import simpy

from core import EngineCore, SchedulerOutput
from core.config import pipeline_stage_layers
from core.kv_capacity import kv_block_bytes_per_rank, kv_blocks_per_pipeline
from sim.cost_model import BatchShape, RooflineCostModel, activation_peak_bytes, check_tp
from sim.engine import ResolvedConfig, SimEngine, SimResult
from sim.executor import SimExecutor
from sim.memory import sample as memory_sample
from sim.specs import GiB, HardwareSpec, ModelSpec

GPUS_PER_NODE = 8
INTER_NODE_BANDWIDTH = 25e9        # bytes/s per direction: one 200 Gb/s InfiniBand NIC per GPU
INTER_STAGE_LATENCY_S = 10e-6      # one point-to-point send/recv (NCCL, small-message regime)


@dataclass(frozen=True)
class PipelineLayout:
    """How a model is split: P stages of tp ranks, layers per stage, the stage-to-stage link."""
    pp: int
    tp: int
    stage_layers: tuple[int, ...]
    link_bandwidth: float                  # bytes/s per direction
    link_latency_s: float = INTER_STAGE_LATENCY_S

    @property
    def gpus(self) -> int:
        return self.pp * self.tp

    @classmethod
    def of(cls, model: ModelSpec, hw: HardwareSpec, tp: int, pp: int, partition: str | None = None,
           link_gbps: float | None = None) -> PipelineLayout:
        check_tp(model, tp)
        layers = pipeline_stage_layers(model.num_layers, pp, partition)
        if link_gbps is not None:
            bandwidth = link_gbps * 1e9
        else:
            bandwidth = hw.interconnect_bandwidth if pp * tp <= GPUS_PER_NODE else INTER_NODE_BANDWIDTH
        return cls(pp, tp, tuple(layers), bandwidth)

    def activation_bytes(self, model: ModelSpec, num_tokens: int) -> int:
        """What one stage sends the next for a batch: hidden state + residual per token."""
        return 2 * model.hidden_size * model.dtype_bytes * num_tokens

    def transfer_time(self, model: ModelSpec, num_tokens: int) -> float:
        return self.link_latency_s + self.activation_bytes(model, num_tokens) / self.link_bandwidth


# -- memory -------------------------------------------------------------------------------------

def stage_weight_bytes(model: ModelSpec, layers: int, first: bool, last: bool, tp: int) -> float:
    """Weights one rank of a stage holds: its layers, the embedding on the first stage, the
    final norm and LM head on the last (a tied LM head is a second copy of the embedding)."""
    if first and last:
        return model.weight_bytes() / tp
    h = model.hidden_size
    params = layers * model.params_per_layer()
    if first:
        params += model.vocab_size * h + model.learned_pos_embeddings * h
    if last:
        params += (2 * h if model.linear_bias else h) + model.lm_head_params()
    return params * model.dtype_bytes / tp


def pipeline_kv_capacity_blocks(model: ModelSpec, hw: HardwareSpec, block_size: int, gpu_memory_utilization: float,
                                layout: PipelineLayout, max_num_batched_tokens: int) -> int:
    """KV blocks of the pipeline: the minimum over stages of (memory * utilization - the
    stage's weights - activation peak) // the stage's block bytes per rank. Raises
    ValueError naming the stage whose weights do not fit."""
    budget = hw.mem_bytes * gpu_memory_utilization
    act = activation_peak_bytes(model, max_num_batched_tokens, layout.tp)
    free = []
    last = layout.pp - 1
    for k, layers in enumerate(layout.stage_layers):
        weights = stage_weight_bytes(model, layers, k == 0, k == last, layout.tp)
        if weights > budget:
            raise ValueError(f"stage {k} of {model.name} ({layers} layers) needs {weights / GiB:.1f} GiB of weights "
                             f"per rank at tp={layout.tp}, but {hw.name} offers {budget / GiB:.1f} GiB at "
                             f"gpu_memory_utilization={gpu_memory_utilization}; raise tp or pp")
        free.append(budget - weights - act)
    return kv_blocks_per_pipeline(free, block_size, list(layout.stage_layers), model.num_kv_heads, model.head_dim,
                                  model.dtype_bytes, layout.tp)


def pipeline_block_bytes(model: ModelSpec, block_size: int, layout: PipelineLayout) -> int:
    """Bytes of one KV block on a rank of the largest stage (what that stage swaps per block)."""
    return kv_block_bytes_per_rank(block_size, max(layout.stage_layers), model.num_kv_heads, model.head_dim,
                                   model.dtype_bytes, layout.tp)


# -- time ---------------------------------------------------------------------------------------

class PipelineCostModel:
    """Per-stage step times and the inter-stage transfer. `step_time` (the CostModel
    protocol) is one batch's latency through the whole pipeline with nothing else in it."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, layout: PipelineLayout):
        self.model, self.layout = model, layout
        last = layout.pp - 1
        self.stages = [RooflineCostModel(model, hw, layout.tp, num_layers=layers, last_stage=k == last,
                                         **({} if k == 0 else {"step_overhead_s": 0.0}))
                       for k, layers in enumerate(layout.stage_layers)]

    def stage_times(self, batch: BatchShape) -> list[float]:
        return [stage.step_time(batch) for stage in self.stages]

    def transfer_time(self, num_tokens: int) -> float:
        return self.layout.transfer_time(self.model, num_tokens)

    def step_time(self, batch: BatchShape) -> float:
        if batch.num_seqs == 0:
            return 0.0
        return sum(self.stage_times(batch)) + (self.layout.pp - 1) * self.transfer_time(batch.num_new_tokens)

    def swap_time(self, num_blocks: int, block_bytes: int) -> float:
        return self.stages[0].swap_time(num_blocks, block_bytes)


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
        self.layout = PipelineLayout.of(resolved.model, resolved.hardware, cfg.tp, cfg.pp, cfg.pp_layer_partition,
                                        cfg.pp_link_bandwidth)
        fast = self.executor.fast_tokens
        self.executor = PipelineExecutor(PipelineCostModel(resolved.model, resolved.hardware, self.layout),
                                         resolved.block_bytes, self.env, seed=cfg.seed)
        self.executor.fast_tokens = fast
        self.event_skipping = False
        self.max_batches = max_batches_in_flight or self.layout.pp
        self.core = EngineCore(self.scheduler, self.executor, clock=lambda: self.clock,
                               max_concurrent_batches=self.max_batches)
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
        self.timeseries.append((self._mark, dt, landed, used, running, waiting, swapped, seqs, tokens, preempted,
                                *mem[:4]))
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
