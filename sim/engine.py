"""The SimPy driver: the core's scheduler and block manager, a simulated clock.

One engine process loops the core step (schedule -> SimExecutor -> update) on its own
clock; an arrival process walks the trace in simulated time and wakes the engine when it
is idle (SimPy's clock catches up with the engine's only then). Nothing of the scheduling
logic lives here: every decision is the core's (`core.Scheduler`, `core.KVCacheManager`,
`policies`).

Clock. The engine keeps its own float clock, advanced exactly as `clock + dt` per step,
and uses SimPy only to pace processes. Requests enter the scheduler at step
boundaries: an arrival at time t is added before the first `schedule()` at or after t
(so equal timestamps never depend on SimPy's event order). A later turn of a
conversation (`sim.workloads.ConversationTrace`) enters once its previous turn has
finished: at max(its traced arrival, that finish + think time), with the previous
turn's tokens prepended to its prompt.

Memory. Each step's KV memory breakdown (token states / reservation / internal and
external fragmentation / free, plus physical vs logical blocks for the sharing saving)
is sampled from the core and weighted by the step's duration (`sim.memory`).

Event skipping. After every normal step the engine asks the core for its steady-decode
horizon h (steps that would each decode one token for every running sequence with no
admission, swap, preemption or copy-on-write; the last may be the step in which the first
sequences reach their length limit). It runs k <= h of them in bulk with
`core.sched.event_skipping.fast_forward`, where k stops before the first step that would start at
or after the next arrival; a span that ends in finishes is followed at once by the next span
(no normal step: the next horizon re-checks admission against the freed blocks). Per-step durations come from the same cost-model call the
step-by-step mode makes, summed in the same order, and each skipped step's memory
sample follows in closed form from the state before the span (`sim.memory.SpanModel`,
checked against the core after the span), so both modes produce identical per-request
metrics, time-weighted statistics and memory breakdowns (tested).
"""
from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import os
import sys
from array import array
from contextlib import contextmanager
from itertools import chain
from dataclasses import asdict, dataclass, field

import simpy

from core import (CacheConfig, ModelRunnerOutput, Request, RequestStatus, SamplingParams, Scheduler,
                  SchedulerConfig, SchedulerOutput)
from core.config import default_max_model_len, default_max_num_batched_tokens
from core.kv.kv_cache_manager import KVCacheManager
from core.sched.event_skipping import (describe_steady_decode, fast_forward, renew_steady_plan, schedule_steady_step,
                                 update_steady_step)
from core.metrics import RequestRecord
from policies import PolicySet
from sim.config import DEFAULT_HARDWARE, SimConfig
from core.cost.model import RooflineCostModel, kv_block_bytes, kv_cache_capacity_blocks
from core.cost.fitted import FittedCostModel
from sim.executor import SIM_EOS_TOKEN_ID, SimExecutor
from sim.memory import MemoryAccumulator, MemorySample, SpanModel, blocks_at_finish, growth_from_offsets, sample as memory_sample
from core.cost.specs import HARDWARE, GiB, HardwareSpec, ModelSpec, get_hardware, get_model
from sim.timeseries import COLUMNS as TIMESERIES_COLUMNS, Timeseries, TimeseriesRow
from sim.cluster.pipeline_stages import PipelineLayout, pipeline_block_bytes, pipeline_kv_capacity_blocks
from traces import HashedBlockTokens, Trace

# Synthetic prompts (traces without token ids): request i's prompt is the id
# PROMPT_ID_BASE + i followed by 1, 1, 1, ... Chained block hashes cover everything
# before a block, so a unique first token makes every block of the prompt unique
# (no false prefix-cache hits). The tail is one cached small int repeated: building and
# copying a prompt costs no per-token Python work and touches no per-token object.
# Never the EOS id (0).
PROMPT_ID_BASE = 1 << 24
_REJECTED = RequestStatus.FINISHED_REJECTED
# Re-derive the memory breakdown from the core after every skipped span and compare (an
# O(running) self-check; on in the test suite, off by default for speed).
CHECK_SPANS = bool(os.environ.get("TWINSERVE_SIM_CHECK"))
_EMPTY_RESULT = ModelRunnerOutput(token_ids={})


@dataclass
class ResolvedConfig:
    """A SimConfig with every derived number filled in (what a run actually used)."""
    config: SimConfig
    model: ModelSpec
    hardware: HardwareSpec
    scheduler: SchedulerConfig
    cache: CacheConfig
    block_bytes: int

    def policies(self) -> PolicySet:
        c = self.config
        return PolicySet.from_names(queue=c.queue_policy, preemption=c.preemption_mode, victim=c.victim_policy, eviction=c.eviction_policy,
                                    allocation=c.allocation, scheduler=c.scheduler)

    def echo(self) -> dict:
        """The configuration as it ran (for summary.json)."""
        c = asdict(self.config)
        c.update(model=self.model.name, hardware=self.hardware.name,
                 num_gpu_blocks=self.cache.num_gpu_blocks, num_cpu_blocks=self.cache.num_cpu_blocks,
                 max_model_len=self.scheduler.max_model_len,
                 max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
                 kv_block_bytes=self.block_bytes)
        return c


def resolve(config: SimConfig) -> ResolvedConfig:
    """Look up specs and size the KV cache; raises ValueError on any bad setting."""
    c = config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size", "max_num_seqs"):
        if getattr(c, name) < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(c, name)}")
    if c.n < 1:
        raise ValueError(f"n must be >= 1, got {c.n}")
    if c.beam_width < 0:
        raise ValueError(f"beam-width must be >= 0, got {c.beam_width}")
    if c.beam_width and c.n != 1:
        raise ValueError("beam search returns beam-width sequences; use --n 1 with --beam-width")
    if not c.swap_space >= 0:
        raise ValueError(f"swap-space must be >= 0 GiB, got {c.swap_space}")
    if not 0.0 <= c.watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {c.watermark}")
    if c.max_num_batched_tokens is not None and c.max_num_batched_tokens < 1:
        raise ValueError(f"max-num-batched-tokens must be >= 1, got {c.max_num_batched_tokens}")
    if c.max_model_len is not None and c.max_model_len < 2:
        raise ValueError(f"max-model-len must be >= 2, got {c.max_model_len}")
    model, hw = get_model(c.model), get_hardware(c.hardware)
    PolicySet.from_names(queue=c.queue_policy, preemption=c.preemption_mode, victim=c.victim_policy, eviction=c.eviction_policy,
                         allocation=c.allocation, scheduler=c.scheduler)
    if c.scheduler.lower() == "vllm-v1":
        from policies.scheduling import check_vllm_v1
        check_vllm_v1(chunked_prefill=c.enable_chunked_prefill, preemption=c.preemption_mode, allocation=c.allocation,
                      pipeline_parallel_size=c.pipeline_parallel_size)
    if c.allocation.lower() != "paged" and c.enable_prefix_caching:
        raise ValueError(f"allocation {c.allocation} has no prefix cache (a contiguous region per sequence, "
                         f"nothing shared): drop --enable-prefix-caching or use --allocation paged")
    if c.enable_expert_parallel and c.pipeline_parallel_size > 1:
        raise ValueError("--enable-expert-parallel prices one GPU group; drop it or --pipeline-parallel-size")
    RooflineCostModel(model, hw, c.tensor_parallel_size, ep=c.tensor_parallel_size if c.enable_expert_parallel else 1)   # validates tp (and EP)
    layout = None
    if c.pp_layer_partition:
        from core.config import pipeline_stage_layers
        pipeline_stage_layers(model.num_layers, c.pipeline_parallel_size, c.pp_layer_partition)     # names what is wrong
    if c.pipeline_parallel_size > 1:
        layout = PipelineLayout.of(model, hw, c.tensor_parallel_size, c.pipeline_parallel_size, c.pp_layer_partition, c.pp_link_bandwidth)
        if c.cost_model is not None:
            raise ValueError("--cost-model prices a whole model on one GPU group; with --pipeline-parallel-size the "
                             "roofline prices each stage: drop --cost-model or --pipeline-parallel-size")
    if c.cost_model is not None:
        FittedCostModel.from_file(c.cost_model, RooflineCostModel(model, hw, c.tensor_parallel_size), c.jitter_seed)   # fails early
    elif c.jitter_seed is not None:
        raise ValueError("--jitter-seed draws noise from a calibrated cost model's jitter section: add --cost-model")

    if c.max_model_len is not None and c.max_model_len > model.max_model_len:
        raise ValueError(f"max-model-len {c.max_model_len} exceeds {model.name}'s context of "
                         f"{model.max_model_len} tokens")
    want_len = c.max_model_len or model.max_model_len
    batched = c.max_num_batched_tokens
    if batched is None:     # for sizing the activation memory; final below
        batched = default_max_num_batched_tokens(c.enable_chunked_prefill, want_len)
    if c.num_gpu_blocks is not None:
        if c.num_gpu_blocks < 1:
            raise ValueError(f"num-gpu-blocks must be >= 1, got {c.num_gpu_blocks}")
        num_gpu_blocks = c.num_gpu_blocks
    elif layout is not None:
        num_gpu_blocks = pipeline_kv_capacity_blocks(model, hw, c.block_size, c.gpu_memory_utilization, layout,
                                                     batched)
        if num_gpu_blocks < 1:
            raise ValueError(f"{model.name} on {layout.gpus}x {hw.name} (tp={c.tensor_parallel_size}, pp={c.pipeline_parallel_size}) leaves no memory "
                             f"for the KV cache at gpu-memory-utilization={c.gpu_memory_utilization}")
    else:
        num_gpu_blocks = kv_cache_capacity_blocks(model, hw, c.block_size, c.gpu_memory_utilization, c.tensor_parallel_size,
                                                  max_num_batched_tokens=batched)
        if num_gpu_blocks < 1:
            raise ValueError(f"{model.name} on {c.tensor_parallel_size}x {hw.name} leaves no memory for the KV cache at "
                             f"gpu-memory-utilization={c.gpu_memory_utilization}; raise tp or pick "
                             f"larger hardware")
    max_model_len = c.max_model_len or default_max_model_len(model.max_model_len, num_gpu_blocks, c.block_size)
    if c.max_num_batched_tokens is None:
        batched = default_max_num_batched_tokens(c.enable_chunked_prefill, max_model_len)
    block_bytes = kv_block_bytes(model, c.block_size, c.tensor_parallel_size)
    if layout is not None:
        block_bytes = pipeline_block_bytes(model, c.block_size, layout)
    num_cpu_blocks = int(c.swap_space * GiB) // block_bytes
    sched = SchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=batched,
                            max_model_len=max_model_len, enable_chunked_prefill=c.enable_chunked_prefill,
                            long_prefill_token_threshold=c.long_prefill_token_threshold, pipeline_parallel_size=c.pipeline_parallel_size,
                            async_scheduling=c.async_scheduling)
    cache = CacheConfig(block_size=c.block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                        enable_prefix_caching=c.enable_prefix_caching, watermark=c.watermark)
    cache.validate()
    sched.validate(cache)
    return ResolvedConfig(c, model, hw, sched, cache, block_bytes)


def with_fitting_hardware(config: SimConfig, explicit: set[str] | None, warn=None) -> SimConfig:
    """`config` on a GPU its model fits, when --hardware was not given: the default
    (A100-40G) where the weights leave room for KV blocks at --tp, else the first built-in GPU
    that does (A100-80G, H100, H200), named in a note on stderr; MoE models such as
    Qwen3-30B-A3B (57 GiB of bf16 weights) or Mixtral-8x7B (87 GiB) need one. A given
    --hardware is kept (resolve() then says why it does not fit). `explicit` as for
    `with_measured_engine`."""
    given = config.hardware != DEFAULT_HARDWARE if explicit is None else "hardware" in explicit
    if given:
        return config
    def fits(name: str) -> bool:
        try:
            resolve(dataclasses.replace(config, hardware=name))
        except ValueError:
            return False
        return True

    if fits(config.hardware):
        return config
    for name in HARDWARE:
        if name != config.hardware and not name.lower().startswith("cpu") and fits(name):
            (warn or (lambda m: print(m, file=sys.stderr)))(
                f"note: {config.model} does not fit {config.hardware} at tensor-parallel-size {config.tensor_parallel_size}; simulating {name} "
                f"(give --hardware to choose)")
            return dataclasses.replace(config, hardware=name)
    return config


@dataclass
class SimResult:
    """What one run produced (written out by `sim.results`)."""
    config: ResolvedConfig
    trace_source: str
    records: list[RequestRecord]           # trace order
    requested_output_lens: list[int]       # max_tokens per request, trace order
    sim_time: float                        # clock when the last request left
    num_steps: int                         # engine iterations (skipped ones included)
    num_normal_steps: int                  # iterations run one by one (mode-dependent)
    num_preemptions: int
    num_swaps: int
    swap_time: float                       # seconds of PCIe copies charged (in the sim time)
    num_swapped_blocks: int                # blocks copied out + in
    kv_stats: dict
    time_weighted: dict                    # kv_usage_mean/max, running/waiting/swapped means
    timeseries: list[TimeseriesRow] = field(repr=False, default_factory=list)
    memory_breakdown: dict = field(default_factory=dict)   # sim.memory: Figure 2 shares, slot-seconds
    kv_sharing: dict = field(default_factory=dict)         # sim.memory: physical vs logical blocks
    pipeline: dict = field(default_factory=dict)           # sim.cluster.pipeline_parallel: stages, busy fractions (P > 1)
    async_scheduling: dict = field(default_factory=dict)   # sim.async_scheduling: host / device busy fractions

    TIMESERIES_COLUMNS = TIMESERIES_COLUMNS             # sim.timeseries: the file's columns and units


def _check_renewed(plan, fresh) -> None:
    """TWINSERVE_SIM_CHECK: a plan carried across spans equals one made by a full pass."""
    def view(p):
        return None if p is None else (p.horizon, p.seqs, p.lefts, p.offsets, p.context_sum, p.num_requests, p.applied)
    if view(plan) != view(fresh):
        raise RuntimeError(f"event skipping: renewed plan {view(plan)} != fresh plan {view(fresh)}")


def synthetic_prompt(index: int, length: int) -> list[int]:
    """The prompt ids the simulator uses for trace request `index` when the trace has none."""
    prompt = [1] * length                  # -> [PROMPT_ID_BASE + index, 1, ..., 1]
    prompt[0] = PROMPT_ID_BASE + index
    return prompt


_gc_depth = 0


@contextmanager
def gc_tuned_for_run(replicas: int = 1):
    """Garbage-collector settings for one simulation run (re-entrant: a fleet runs engines).

    - What exists when the run starts (the trace, the block pools' per-block lists, a
      fleet's replicas) is frozen out of the cyclic collector's view for the run: otherwise
      every full collection walks it again (16 replicas hold 16 x 6 lists of ~29k entries).
    - A fleet of N replicas allocates N times faster per simulated second than one engine,
      so with the default young-generation threshold a request's prompt and token lists are
      still alive at a young collection N times as often (10.2M list entries walked vs 1.4M
      for the same 6,000 requests run one replica at a time): the threshold is scaled by N,
      so each request lives through as many young collections as under a single engine.
    Objects made during the run are collected as usual; reference counting still frees
    acyclic garbage at once."""
    global _gc_depth
    saved = gc.get_threshold()
    if _gc_depth == 0:
        gc.freeze()
    if replicas > 1:
        gc.set_threshold(saved[0] * replicas, *saved[1:])
    _gc_depth += 1
    try:
        yield
    finally:
        _gc_depth -= 1
        gc.set_threshold(*saved)
        if _gc_depth == 0:
            gc.unfreeze()


class SimEngine:
    """Runs one trace through the core scheduler on a simulated clock."""

    def __init__(self, resolved: ResolvedConfig, trace: Trace, *, progress: bool = False):
        self.resolved = resolved
        cfg = resolved.config
        self.trace = trace
        self.scheduler = Scheduler(resolved.scheduler, resolved.cache, resolved.policies())
        cost_model = RooflineCostModel(resolved.model, resolved.hardware, cfg.tensor_parallel_size,
                                       ep=cfg.tensor_parallel_size if cfg.enable_expert_parallel else 1)
        if cfg.cost_model is not None:
            cost_model = FittedCostModel.from_file(cfg.cost_model, swap_fallback=cost_model,
                                                   jitter_seed=cfg.jitter_seed)
        self.executor = SimExecutor(cost_model, resolved.block_bytes, seed=cfg.seed)
        self.executor.fast_tokens = cfg.n == 1 and not cfg.beam_width
        # jittered step times are drawn in step order (core.cost.fitted)
        self.event_skipping = cfg.event_skipping and cfg.jitter_seed is None
        self.progress = progress
        self.env = simpy.Environment()
        n = len(trace.requests)
        self.arrivals = [r.arrival_time for r in trace.requests]
        self.records: list[RequestRecord | None] = [None] * n
        self.max_tokens = [max(1, r.output_len) for r in trace.requests]
        self._next = 0                 # trace index of the next request to enter the scheduler
        self._released = 0             # arrivals the arrival process has reached (SimPy time)
        self._wake: simpy.Event | None = None
        self._params: dict[int, SamplingParams] = {}
        # Conversations (sim.workloads.ConversationTrace): a later turn enters when the
        # previous one has finished; its prompt is built from that turn's tokens then.
        parents = getattr(trace, "parents", None)
        self._parents: list[int] | None = parents if parents and any(p >= 0 for p in parents) else None
        self._think_time = float(getattr(trace, "think_time", 0.0))
        self._has_next_turn = set(p for p in parents if p >= 0) if self._parents else set()
        self._blocked: dict[int, int] = {}                     # unfinished turn -> next turn (arrived)
        self._finished_turns: dict[int, tuple[float, list[int]]] = {}  # turn -> (finish time, tokens)
        self._contexts: dict[int, list[int]] = {}             # next turn -> conversation so far
        self._ready: list[tuple[float, int]] = []             # heap of (effective arrival, trace index)
        # time-weighted accumulators (sum of value * duration, in step order)
        # (block-seconds in use are the memory integral's "physical": `_w_used`)
        self._w_running = self._w_waiting = self._w_swapped = 0.0
        self._max_used = 0
        self.memory = MemoryAccumulator(resolved.cache.num_gpu_blocks, resolved.cache.block_size)
        self.timeseries = Timeseries(resolved.cache.num_gpu_blocks, resolved.cache.block_size)
        self.num_steps = 0
        self.num_normal_steps = 0
        self._steady = None            # the running set as a SteadyDecode plan (event skipping), or None
        # Spans may go on past finishes (core.sched.event_skipping._horizon's past_finishes) when
        # a finish frees exactly its sequence's blocks (paged, no prefix cache, one sequence
        # per request: the span's memory accounting follows in closed form) and creates no
        # event (no conversation turn follows it).
        self._past_finishes = (type(self.scheduler.kv) is KVCacheManager and not resolved.cache.enable_prefix_caching
                               and cfg.n == 1 and not cfg.beam_width and self._parents is None)
        self.clock = 0.0
        self._pbar = None

    # -- requests ---------------------------------------------------------------------------
    def _make_request(self, i: int, arrival: float | None = None, context: list[int] | None = None) -> Request:
        tr = self.trace.requests[i]
        cfg = self.resolved.config
        max_tokens = self.max_tokens[i]
        params = self._params.get(max_tokens)
        if params is None:
            params = self._params[max_tokens] = SamplingParams(
                n=cfg.n, beam_width=cfg.beam_width, max_tokens=max_tokens, ignore_eos=True)
        ids = tr.prompt_token_ids
        if ids is not None and len(ids):
            prompt = list(chain.from_iterable(ids.blocks())) if isinstance(ids, HashedBlockTokens) else ids
        else:
            prompt = synthetic_prompt(i, max(1, tr.prompt_len))
        if context is not None:
            prompt = context + prompt
        request = Request(tr.request_id, prompt, params, arrival_time=tr.arrival_time if arrival is None else arrival,
                          eos_token_id=SIM_EOS_TOKEN_ID, user_data=i)
        # Step end times go straight into a compact array (runs keep every record), while
        # each span's times are fresh in the cache.
        request.metrics.token_times = array("d")
        return request

    def _intake(self, clock: float) -> None:
        """Add every request that has arrived by `clock` (trace order; then conversation
        turns that became ready, by effective arrival)."""
        arrivals, i, n = self.arrivals, self._next, len(self.arrivals)
        parents = self._parents
        while i < n and arrivals[i] <= clock:
            if parents is not None and parents[i] >= 0:
                self._turn_arrived(i)
            else:
                self._add(self._make_request(i))
            i += 1
        self._next = i
        ready = self._ready
        while ready and ready[0][0] <= clock:
            t, i = heapq.heappop(ready)
            self._add(self._make_request(i, t, self._contexts.pop(i)))

    def _add(self, request: Request) -> None:
        if request.user_data == 0:
            self.executor.seq_id_base = request.seqs[0].seq_id
        self.scheduler.add_request(request)
        if request.status is _REJECTED:
            # Rejected on arrival: it never runs; it left the engine when it came.
            request.metrics.finished_time = request.arrival_time
            self._finish([request])

    # -- conversations ------------------------------------------------------------------------
    def _turn_arrived(self, i: int) -> None:
        """A later turn's traced arrival: it enters once its previous turn has finished."""
        p = self._parents[i]
        done = self._finished_turns.pop(p, None)
        if done is None:
            self._blocked[p] = i
        else:
            self._schedule_turn(i, *done)

    def _schedule_turn(self, i: int, prev_finish: float, context: list[int]) -> None:
        self._contexts[i] = context
        heapq.heappush(self._ready, (max(self.arrivals[i], prev_finish + self._think_time), i))

    def _turn_finished(self, request: Request) -> None:
        """Keep a finished turn's tokens (prompt + output of its first returned sequence:
        the best beam, or the first sample to finish) for the conversation's next turn."""
        i = request.user_data
        seq = request.finished_seqs[0] if request.finished_seqs else request.seqs[0]
        done = (request.metrics.finished_time, list(seq.token_ids))
        nxt = self._blocked.pop(i, None)
        if nxt is None:
            self._finished_turns[i] = done
        else:
            self._schedule_turn(nxt, *done)

    def _next_event(self) -> float:
        """Time of the next arrival: traced, or a conversation turn becoming ready."""
        t = self.arrivals[self._next] if self._next < len(self.arrivals) else math.inf
        if self._ready and self._ready[0][0] < t:
            t = self._ready[0][0]
        return t

    def _record(self, request: Request) -> bool:
        """Keep the request's record (once); True if it was new."""
        i = request.user_data
        if self.records[i] is not None:      # a rejection, already recorded on arrival
            return False
        rec = RequestRecord.from_request(request)
        if type(rec.token_times) is not array:          # (made as one: see _make_request)
            rec.token_times = array("d", rec.token_times)    # compact: runs keep every record
        self.records[i] = rec
        return True

    def _finish(self, finished: list[Request]) -> None:
        new = 0
        for request in finished:
            if self._record(request):
                new += 1
                if request.user_data in self._has_next_turn:
                    self._turn_finished(request)
                # A request and its sequences refer to each other; cut the cycle so that
                # reference counting frees them once the caller drops the request, and the
                # cyclic GC (slow with many long token lists alive) finds nothing to do.
                for seq in request.seqs:
                    seq.request = None
                for seq in request.finished_seqs:
                    seq.request = None
        if new and self._pbar is not None:
            self._pbar.update(new)

    # -- processes -------------------------------------------------------------------------
    def _arrival_process(self):
        """Walks the trace in simulated time; wakes the engine when it is idle."""
        env, arrivals = self.env, self.arrivals
        for i, t in enumerate(arrivals):
            if t > env.now:
                yield env.timeout(t - env.now)
            self._released = i + 1
            wake = self._wake
            if wake is not None and not wake.triggered:
                wake.succeed()

    @property
    def _w_used(self) -> float:
        """Block-seconds in use: the memory integral's physical blocks (sim.memory), which
        every step and gap adds as used * dt."""
        return self.memory.physical

    def _account(self, dt: float, used: int, running: int, waiting: int, swapped: int) -> None:
        """Time-weighted request counts (the caller adds the memory sample, used blocks included)."""
        self._w_running += running * dt
        self._w_waiting += waiting * dt
        self._w_swapped += swapped * dt
        if used > self._max_used:
            self._max_used = used

    def _idle_until(self, t: float):
        """Wait (engine idle) until the arrival at time t (`_next_event()`)."""
        sched, clock = self.scheduler, self.clock
        self.executor.engine_idle()
        used = sched.kv.gpu.num_used
        dt = t - clock
        self._account(dt, used, len(sched.running), len(sched.waiting), len(sched.swapped))
        mem = memory_sample(sched)
        self.memory.add(dt, mem)
        self.timeseries.idle(clock, dt, used, len(sched.running), len(sched.waiting), len(sched.swapped), mem)
        if self._next < len(self.arrivals) and self.arrivals[self._next] <= t:
            if self._released <= self._next:       # the arrival process has not reached it yet
                self._wake = self.env.event()
                yield self._wake
                self._wake = None
        else:                                      # a conversation turn becomes ready
            yield self.env.timeout(max(0.0, t - self.env.now))
        self.clock = t

    def _engine_process(self):
        sched, ex = self.scheduler, self.executor
        gpu = sched.kv.gpu
        arrivals, n_total = self.arrivals, len(self.arrivals)
        skipping = self.event_skipping
        step_time, execute, update, schedule = ex.step_time, ex.execute_model, sched.update, sched.schedule
        token_ids, extend_tokens = ex.token_ids, ex.extend_tokens
        account, timeseries = self._account, self.timeseries
        mem_add = self.memory.add
        pbar = self._pbar
        ready = self._ready
        while True:
            clock = self.clock
            if (self._next < n_total and arrivals[self._next] <= clock) or (ready and ready[0][0] <= clock):
                self._intake(clock)
            if not sched.requests:
                if self._next >= n_total and not ready:
                    break
                yield from self._idle_until(self._next_event())
                continue
            # A span that stopped for arrivals leaves its plan: the step that admits them
            # then takes the plan's decodes in bulk (core.sched.event_skipping.schedule_steady_step).
            steady = self._steady
            step = schedule_steady_step(sched, steady, clock) if steady is not None else None
            if step is None:
                self._steady = None
                out: SchedulerOutput = schedule(clock)   # stamps preempted requests' queue time itself
                dt = step_time(out)
                if dt <= 0.0:
                    # Nothing runnable now (should not happen with an empty-enough pool).
                    self._finish(update(out, _EMPTY_RESULT, clock).finished)
                    if sched.requests and (self._next < n_total or ready):
                        yield from self._idle_until(self._next_event())
                        continue
                    if sched.requests:
                        raise RuntimeError(f"the scheduler made no progress at t={clock:.6f} with "
                                           f"{len(sched.requests)} unfinished requests")
                    continue
                num_seqs, num_tokens = len(out.scheduled), out.num_batched_tokens
            else:
                out = step.out
                dt = step_time(out, step.num_decodes, step.decode_context_sum)
                num_seqs, num_tokens = step.num_seqs, step.num_batched_tokens
            result = execute(out)
            used = gpu.num_used
            running, waiting, swapped = len(sched.running), len(sched.waiting), len(sched.swapped)
            account(dt, used, running, waiting, swapped)
            mem = memory_sample(sched)                 # the state during the step
            mem_add(dt, mem)
            timeseries.step(clock, dt, used, running, waiting, swapped, num_seqs, num_tokens, len(out.preempted), mem)
            # No SimPy wait per step: nothing else runs while the engine is busy (arrivals
            # enter at step boundaries by the engine's own clock), so SimPy's clock only
            # catches up when the engine idles (`_idle_until`).
            end = clock + dt
            self.clock = end
            self.num_steps += 1
            self.num_normal_steps += 1
            if step is None:
                self._finish(update(out, result, end).finished)
            else:
                self._finish(update_steady_step(sched, step, result, end, token_ids, extend_tokens).finished)
                self._steady = renew_steady_plan(sched, step.plan, True, step.out.admitted, self._past_finishes)
            if skipping and sched.requests and not self.executor.waking:
                self._skip()
            if pbar is not None and not (self.num_normal_steps & 1023):
                pbar.set_postfix_str(f"sim {self.clock:,.0f}s", refresh=False)

    def _skip(self) -> None:
        """Fast-forward through steady decode steps that start before the next event; a
        span may end with requests finishing (nothing waits), and then the next one starts
        without a normal step in between."""
        while self._span() and self.scheduler.requests:
            pass

    def _span_plan(self):
        """The running set as a plan for a span starting now: kept from the last span or
        steady step (renewed: no pass over every sequence), else from a pass; kept in
        `_steady`. None when not every running sequence is a plain decode."""
        sched = self.scheduler
        plan = self._steady
        if plan is None:
            plan = describe_steady_decode(sched, True, self._past_finishes)
        elif plan.applied:
            plan = renew_steady_plan(sched, plan, True, past_finishes=self._past_finishes)
        if CHECK_SPANS:
            _check_renewed(plan, describe_steady_decode(sched, True, self._past_finishes))
        self._steady = plan
        return plan

    def _span(self) -> bool:
        """Apply one span of steady decode steps (the clock moves to its end); True when it
        ran to its horizon and sequences finished there (a next span may follow at once).

        A span that goes on past finishes (`_past_finishes`) runs in phases: after a step in
        which sequences finish, the survivors' steps are priced and accounted without them
        (each phase is the span the step-by-step engine would see; one timeseries row each)."""
        sched = self.scheduler
        t = start = self.clock
        limit = self._next_event()
        if limit <= t:
            return False
        plan = self._span_plan()
        if plan is None or plan.horizon <= 0:
            return False
        horizon, num_seqs, context_sum = plan.horizon, plan.num_seqs, plan.context_sum
        step_times = self.executor.decode_step_times
        bs = self.resolved.cache.block_size
        # Steps in which sequences finish before the horizon's last one (past_finishes):
        # after step f those sequences leave; step f + 1 starts a phase.
        bounds: list[int] = []
        if horizon > plan.first_finish:
            leaving: dict[int, list[int]] = {}
            for idx, left in enumerate(plan.lefts):
                if left < horizon:
                    leaving.setdefault(left - 1, []).append(idx)
            bounds = sorted(leaving, reverse=True)          # popped from the end
        phase_end = bounds[-1] + 1 if bounds else horizon
        # Step times never shrink as contexts grow, so at most (limit - t) / d0 + 1 steps
        # start before the arrival: price only those (the loop below extends if needed).
        if limit == math.inf:
            want = phase_end
        else:
            want = min(phase_end, int((limit - t) / step_times(num_seqs, context_sum, 1)[0]) + 2)
        durations = step_times(num_seqs, context_sum, want)
        # KV usage per step: a sequence with c cached tokens and a table of b blocks takes
        # a new block at steps j0 = b * block_size - c, j0 + block_size, ... (paged: j0 < block
        # size; a contiguous region covers the sequence's whole life, so j0 lies past the span).
        starts, late = growth_from_offsets(plan.offsets, bs)
        used = used0 = sched.kv.gpu.num_used
        # Each step's memory sample follows from the state before the span (sim.memory.SpanModel);
        # one loop adds it and the time-weighted counts to the integrals, in step order.
        span_model = SpanModel(sched, num_seqs, starts, late, plan.offsets)
        tok0, res0, ext, free0, logical0, total = (span_model.tok, span_model.res, span_model.ext, span_model.free,
                                                   span_model.logical, span_model.total)
        res_step = num_seqs if span_model.reserves else 0
        memory = self.memory
        token_s, reserved_s, internal_s, external_s, free_s, physical_s, logical_s = memory.integrals()
        in_use_before = (token_s, reserved_s, internal_s, external_s)
        running, waiting, swapped = len(sched.running), len(sched.waiting), len(sched.swapped)
        w_run, w_wait, w_swap = self._w_running, self._w_waiting, self._w_swapped
        used_before = physical_s                       # block-seconds in use (`_w_used`)
        ends = array("d")               # each request's token_times extends by a memcpy
        append = ends.append
        i = 0
        tok, res = tok0, res0
        # Terms that are 0 throughout the span add nothing (x + 0.0 == x for these sums of
        # non-negative products): the common case (paged, nothing waiting) skips them.
        lean = not (waiting or swapped or res0 or res_step or ext or late)
        if bounds and not (lean and num_seqs == running):
            raise RuntimeError("event skipping: a span past finishes needs paged, exclusive blocks and no queue")
        g = used0 - logical0                           # logical blocks = used - g
        phase_start, phase_i = start, 0
        while True:
            if lean:
                # free = free0 - bs * (used - used0) and used - g kept as they change (the
                # same integers, so the same products and sums). Paged: no late growth, and
                # step i's growth is starts[i % bs] (zipped in, rotated to this chunk's start).
                free, used_g = free0 - bs * (used - used0), used - g
                r = i % bs
                growth = starts[r:] + starts[:r]
                if len(durations) > bs:
                    growth *= -(-len(durations) // bs)
                for dt, grow in zip(durations, growth):
                    if t >= limit:
                        break
                    if grow:
                        used += grow
                        free -= bs * grow
                        used_g += grow
                    used_dt = used * dt
                    w_run += running * dt
                    tok += num_seqs
                    token_s += tok * dt
                    internal_s += (total - tok - free) * dt
                    free_s += free * dt
                    physical_s += used_dt
                    logical_s += used_g * dt
                    t = t + dt
                    append(t)
                i = len(ends)
            else:
                for dt in durations:
                    if t >= limit:
                        break
                    if late and i in late:
                        starts[i % bs] += late.pop(i)
                    used += starts[i % bs]
                    used_dt = used * dt
                    w_run += running * dt
                    w_wait += waiting * dt
                    w_swap += swapped * dt
                    tok += num_seqs
                    res -= res_step
                    free = free0 - bs * (used - used0)
                    token_s += tok * dt
                    reserved_s += res * dt
                    internal_s += (total - tok - res - ext - free) * dt
                    external_s += ext * dt
                    free_s += free * dt
                    physical_s += used_dt
                    logical_s += (used - g) * dt
                    t = t + dt
                    append(t)
                    i += 1
            if t >= limit or i >= horizon:
                break
            if i < phase_end:                  # every priced step started before the limit: price more
                durations = step_times(num_seqs, context_sum + i * num_seqs, min(phase_end - i, 64))
                continue
            # Step i - 1 finished sequences: close the phase (a row, as the span it was), and
            # go on without them (their blocks freed, their tokens gone from the pool).
            self._span_row(phase_start, t, i - phase_i, physical_s - used_before, running, waiting, swapped,
                           num_seqs, (token_s, reserved_s, internal_s, external_s), in_use_before)
            if used > self._max_used:
                self._max_used = used
            f = bounds.pop()
            for idx in leaving[f]:
                c, j0 = plan.seqs[idx].num_computed_tokens, plan.offsets[idx]
                used -= blocks_at_finish(c, j0, f, bs)
                tok -= c + f + 1                       # its token states during step f
                context_sum -= c
                starts[j0] -= 1
            num_seqs -= len(leaving[f])
            running = num_seqs
            phase_start, phase_i, used_before, in_use_before = t, i, physical_s, (token_s, reserved_s, internal_s, external_s)
            phase_end = bounds[-1] + 1 if bounds else horizon
            n_price = phase_end - i
            if limit != math.inf:
                n_price = min(n_price, int((limit - t) / durations[-1]) + 2)
            durations = step_times(num_seqs, context_sum + i * num_seqs, n_price)
        k = i
        memory.set(MemorySample(token_s, reserved_s, internal_s, external_s, free_s, physical_s, logical_s))
        self._span_row(phase_start, t, i - phase_i, physical_s - used_before, running, waiting, swapped, num_seqs,
                       (token_s, reserved_s, internal_s, external_s), in_use_before)
        self._w_running, self._w_waiting, self._w_swapped = w_run, w_wait, w_swap
        if used > self._max_used:
            self._max_used = used
        finished = fast_forward(sched, k, ends, self.executor.token_ids, plan, self.executor.extend_tokens).finished
        # Sequences that finished at the span's last step gave their blocks back: the state
        # is then past it (`used` counts what finished at earlier steps as gone).
        shrunk = k >= plan.first_finish
        gpu = sched.kv.gpu
        if gpu.num_used != used and not (shrunk and gpu.num_used < used):
            raise RuntimeError(f"event skipping: KV usage {gpu.num_used} after {k} steps, expected {used}")
        if CHECK_SPANS and k not in plan.lefts:
            expected = span_model.at(k - 1, used) if phase_i == 0 else \
                (tok, 0, total - tok - (free0 - bs * (used - used0)), 0, free0 - bs * (used - used0), used, used - g)
            if memory_sample(sched) != expected:
                raise RuntimeError(f"event skipping: memory breakdown {memory_sample(sched)} after {k} steps, "
                                   f"expected {expected}")   # the state now = the span's last step
        self.clock = t
        self.num_steps += k
        self._finish(finished)
        if shrunk:                            # the finished sequences leave the plan
            self._steady = renew_steady_plan(sched, plan, True, past_finishes=self._past_finishes)
        return shrunk and k == horizon

    def _span_row(self, start: float, end: float, steps: int, block_seconds: float, running: int, waiting: int,
                  swapped: int, num_seqs: int, in_use: tuple, in_use_before: tuple) -> None:
        """The timeseries row of a span (or a phase of one): its time means."""
        self.timeseries.span(start, end, steps, block_seconds, running, waiting, swapped, num_seqs, in_use,
                             in_use_before)

    # -- run --------------------------------------------------------------------------------
    def run(self) -> SimResult:
        with gc_tuned_for_run():
            return self._run()

    def _run(self) -> SimResult:
        n = len(self.arrivals)
        if self.progress:
            from tqdm import tqdm
            self._pbar = tqdm(total=n, unit="req", file=sys.stderr, delay=0.5, mininterval=0.5,
                              dynamic_ncols=True, desc="sim")
        try:
            self.env.process(self._arrival_process())
            engine = self.env.process(self._engine_process())
            self.env.run(until=engine)
        finally:
            if self._pbar is not None:
                self._pbar.set_postfix_str(f"sim {self.clock:,.0f}s", refresh=False)
                self._pbar.close()
        lost = [self.trace.requests[i].request_id for i, r in enumerate(self.records) if r is None]
        if lost:
            raise RuntimeError(f"{len(lost)} requests never finished (first: {lost[:5]})")
        return self.build_result(self.records, self.max_tokens)

    def build_result(self, records: list[RequestRecord], requested_output_lens: list[int]) -> SimResult:
        """This engine's SimResult over `records` (a fleet replica passes the ones it served)."""
        sched = self.scheduler
        stats = sched.kv.stats()
        num_blocks = self.resolved.cache.num_gpu_blocks
        total = self.clock
        tw = {
            "kv_usage_mean": self._w_used / (total * num_blocks) if total > 0 else 0.0,
            "kv_usage_max": self._max_used / num_blocks,
            "running_mean": self._w_running / total if total > 0 else 0.0,
            "waiting_mean": self._w_waiting / total if total > 0 else 0.0,
            "swapped_mean": self._w_swapped / total if total > 0 else 0.0,
        }
        kv = {
            "num_gpu_blocks": stats.num_gpu_blocks,
            "num_cpu_blocks": stats.num_cpu_blocks,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prefix_cache_hit_rate": stats.prefix_hit_rate,
            "num_evictions": stats.num_evictions,
        }
        breakdown, sharing = self.memory.summary(total)
        return SimResult(self.resolved, self.trace.source, records, requested_output_lens, total, self.num_steps,
                         self.num_normal_steps, sched.num_preemptions, sched.num_swaps, self.executor.swap_seconds,
                         self.executor.num_swapped_blocks, kv, tw, self.timeseries.rows, breakdown, sharing)
