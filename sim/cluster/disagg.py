"""Prefill/decode disaggregation (DistServe, Splitwise): P prefill replicas, D decode
replicas, the KV cache moved between them over a link.

    result = simulate_disagg(DisaggConfig(SimConfig(...), prefill=2, decode=2, link="nvlink"), trace)

Life of a request:
  1. the router (over the prefill replicas) sends it to a prefill replica, where it runs
     as a request with max_tokens = 1: its prefill produces the first token (TTFT);
  2. the prefill replica keeps the request's KV blocks (a reference taken just before the
     step's update frees them) until they have been sent;
  3. the decode replica with the most free blocks is chosen; the transfer waits there
     (FIFO) until the decode side can hold the prompt's blocks above its watermark, and
     reserves them (the transfer occupies blocks on both sides);
  4. the link of the prefill replica carries the transfers one at a time: seconds =
     latency + blocks x per-GPU block bytes / bandwidth (each of the TP ranks sends its
     shard over its own link in parallel);
  5. on arrival the reserved blocks are published in the decode replica's prefix cache
     under the prompt's block hashes and the request (prompt + first token, max_tokens
     = traced output - 1) enters the decode replica, whose admission finds the prompt
     cached and computes only the tail (< one block + the first token). From arrival on
     the blocks are cached but unreferenced: should the decode replica need memory
     before it admits the request, they are evicted (tail first) and the lost part of
     the prompt is recomputed there; holding them until admission can deadlock a full
     decode replica.
A request's record joins both halves: arrival, TTFT and first scheduling from the
prefill side, the remaining token times and finish from the decode side (so TPOT counts
the transfer and any wait for decode memory, as DistServe measures it).
Decode replicas always run with prefix caching (it is how the KV is handed over).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

import simpy

from core import Request, RequestStatus, SamplingParams
from core.sched.event_skipping import steady_decode_plan
from core.metrics import RequestRecord
from sim.engine import _EMPTY_RESULT, ResolvedConfig, SimConfig, resolve
from sim.executor import SIM_EOS_TOKEN_ID
from sim.cluster.fleet import MIN_CHUNK, Fleet, FleetConfig, FleetResult, Replica, Span
from sim.memory import sample as memory_sample
from traces import Trace

# Per-GPU, one direction, bytes/s; latency in seconds per transfer.
LINKS = {
    "nvlink": (450e9, 5e-6),         # NVLink 4 (H100 SXM): 900 GB/s bidirectional
    "infiniband": (50e9, 10e-6),     # NDR 400 Gb/s per GPU (one NIC per GPU)
    "pcie": (25e9, 10e-6),           # PCIe 4.0 x16, effective
}


# -- replicas paced by SimPy ------------------------------------------------------------------
# KV transfers are events between arrival instants that read and change replicas (the
# decode side's free blocks, the prefill side's held blocks), so disaggregated replicas
# run as SimPy processes: a normal step waits for its end on the shared clock, a decode
# span for the end of each planned chunk (cut short by an interrupt when a request or a
# transfer arrives). The routing-visibility rules are sim.cluster.fleet's.
FIRST_CHUNK = 32


class PacedReplica(Replica):
    """A fleet replica as a SimPy process (see above)."""

    def __init__(self, index: int, resolved: ResolvedConfig, trace: Trace, env: simpy.Environment,
                 fleet: "DisaggFleet"):
        super().__init__(index, resolved, trace, fleet)
        self._past_finishes = False           # a prefill's finish starts a KV transfer: an event
        self.env = env
        self.process: simpy.Process | None = None
        self.after_step = None                # callback(replica) after every step
        self.before_update = None             # callback(out, end) before a step's update
        self._woken_at = 0.0                  # exact time of the delivery that ended an idle wait

    def deliver(self, request: Request, now: float) -> None:
        """Take `request` at time `now` (the exact arrival time; SimPy's clock is `now` up to
        rounding): it enters at this replica's next step boundary."""
        self.sync(now, last=True)
        self.inbox.append(request)
        self.served.append(request.user_data)
        span = self._span
        if span is not None and span.cut is None:
            span.cut = span.steps_started_before(now)
            self.process.interrupt()
        else:
            self.wake(now)

    def interrupt_at(self, t: float) -> None:
        """Stop a pending span at the step boundary at or after t (something outside the
        replica is about to change its KV pool, e.g. a KV transfer)."""
        self.sync(t)
        span = self._span
        if span is not None and span.cut is None:
            span.cut = span.done
            self.process.interrupt()

    def wake(self, t: float) -> None:
        """End an idle or blocked wait at time t (exact)."""
        if self._wake is not None and not self._wake.triggered:
            self._woken_at = t
            self._wake.succeed()

    # -- the engine loop -----------------------------------------------------------------
    def _engine_process(self):
        env, sched, ex, fleet = self.env, self.scheduler, self.executor, self.fleet
        gpu = sched.kv.gpu
        skipping = self.event_skipping
        step_time, execute, update, schedule = ex.step_time, ex.execute_model, sched.update, sched.schedule
        account, timeseries, mem_add = self._account, self.timeseries, self.memory.add
        while True:
            clock = self.clock
            if fleet.arrival_pending(clock):       # route this instant's arrivals first
                yield fleet.after_routing()
                continue
            if self.inbox:
                self._intake_inbox()
            if not sched.requests:
                if not fleet.more_work_may_come(self):
                    break
                ex.engine_idle()
                yield from self._wait_for_delivery(clock)
                if not self.inbox and not sched.requests and not fleet.more_work_may_come(self):
                    break
                continue
            out = schedule(clock)
            dt = step_time(out)
            if dt <= 0.0:
                self._finish(update(out, _EMPTY_RESULT, clock).finished)
                if sched.requests:
                    # Nothing fits: blocks held for KV transfers (sim.cluster.disagg) come back
                    # when a transfer ends, which wakes this replica.
                    yield from self._wait_for_delivery(clock)
                continue
            result = execute(out)
            used = gpu.num_used
            running, waiting, swapped = len(sched.running), len(sched.waiting), len(sched.swapped)
            account(dt, used, running, waiting, swapped)
            mem = memory_sample(sched)
            mem_add(dt, mem)
            timeseries.step(clock, dt, used, running, waiting, swapped, len(out.scheduled), out.num_batched_tokens,
                            len(out.preempted), mem)
            end = clock + dt
            # Apply the step's results now: the router then sees this replica as it will
            # be at the step's end (see the module docstring); stamps use `end`.
            self.num_steps += 1
            self.num_normal_steps += 1
            if self.before_update is not None:
                self.before_update(out, end)
            self._finish(update(out, result, end).finished)
            yield env.timeout(max(0.0, end - env.now))
            self.clock = end
            if self.after_step is not None:
                self.after_step(self)
            if skipping and sched.requests and not ex.waking:
                yield from self._skip()

    def _wait_for_delivery(self, clock: float):
        """Idle (or blocked) until something is delivered or freed; account the gap."""
        sched, gpu = self.scheduler, self.scheduler.kv.gpu
        used = gpu.num_used
        counts = (len(sched.running), len(sched.waiting), len(sched.swapped))
        mem = memory_sample(sched)
        self._wake = self.env.event()
        yield self._wake
        self._wake = None
        woken = self._woken_at
        dt = woken - clock
        if dt > 0:
            self._account(dt, used, *counts)
            self.memory.add(dt, mem)
            self.timeseries.idle(clock, dt, used, *counts, mem)
            self.clock = woken

    def _skip(self):
        """Run steady-decode spans up to their horizon (planned in doubling chunks); commit
        each at its end, or up to the step in progress when a request is routed here first.
        A span may end with the step in which sequences reach their length limit; the next
        span then follows at once (its horizon re-checks admission against the freed blocks)."""
        sched, env, fleet = self.scheduler, self.env, self.fleet
        while sched.requests:
            if self.inbox or fleet.arrival_pending(self.clock):
                return                           # an arrival is due at this boundary
            plan = steady_decode_plan(sched, through_finishes=True)
            if plan is None:
                return
            horizon = plan.horizon
            span = Span(self, plan)
            nxt = fleet.next_arrival()
            if nxt == math.inf:
                span.extend(min(horizon, FIRST_CHUNK))
            else:
                span.extend(1)
                if horizon > 1:
                    est = int((nxt - span.start) / span.durations[0]) + 2
                    span.extend(min(horizon, max(MIN_CHUNK, est)) - 1)
            self._span = span
            while True:
                try:
                    yield env.timeout(max(0.0, span.ends[-1] - env.now))
                except simpy.Interrupt:
                    pass
                planned = len(span.ends)
                if span.cut is not None or planned >= horizon:
                    break
                span.extend(min(horizon - planned, planned))    # doubling chunks
            self._span = None
            k = len(span.ends) if span.cut is None else span.cut
            self._commit_span(span, k)
            # Wait for the end of the last committed step, also when it is the last planned
            # one: an interrupt (a KV transfer reserving blocks here) wakes this process before
            # that step ends, and what happens meanwhile (a delivery) must be seen at its end.
            end = span.end_of(k)
            if end > env.now:
                yield env.timeout(end - env.now)
            self.clock = end
            if self.after_step is not None:
                self.after_step(self)
            if k < horizon or not span.finishes:
                return


@dataclass
class DisaggConfig:
    replica: SimConfig = field(default_factory=SimConfig)
    prefill: int = 1
    decode: int = 1
    link: str = "nvlink"
    link_bandwidth_gbps: float | None = None     # GB/s; overrides the preset's bandwidth
    router: str = "round-robin"                  # routes arrivals over the prefill replicas

    def validate(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"--disaggregate P:D needs P >= 1 and D >= 1, got {self.prefill}:{self.decode}")
        if self.link not in LINKS:
            raise ValueError(f"unknown link {self.link!r}; choose from: {', '.join(LINKS)}")
        if self.link_bandwidth_gbps is not None and not self.link_bandwidth_gbps > 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.link_bandwidth_gbps}")
        if self.replica.n != 1 or self.replica.beam_width:
            raise ValueError("disaggregation runs one sequence per request (no --n / --beam-width)")
        FleetConfig(self.replica, self.prefill, self.router).validate()

    @property
    def bandwidth(self) -> float:
        return self.link_bandwidth_gbps * 1e9 if self.link_bandwidth_gbps else LINKS[self.link][0]

    @property
    def num_gpus(self) -> int:
        return (self.prefill + self.decode) * self.replica.tensor_parallel_size

    def fleet_config(self) -> FleetConfig:
        return FleetConfig(self.replica, self.prefill + self.decode, self.router)


def parse_split(text: str) -> tuple[int, int]:
    """'2:3' -> (2, 3)."""
    p, sep, d = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(p), int(d)
    except ValueError:
        raise ValueError(f"--disaggregate takes P:D (prefill and decode replica counts), got {text!r}") from None


@dataclass
class Transfer:
    index: int                      # trace index
    source: PacedReplica
    held: list[int]                 # prefill-side blocks (references taken before the free)
    prompt: list[int]               # prompt + first token
    ready: float                    # prefill finished: KV complete
    target: PacedReplica | None = None
    reserved: list[int] = field(default_factory=list)
    reserved_at: float = 0.0
    started: float = 0.0
    done: float = 0.0
    request: Request | None = None  # the decode-side request
    wakeup: object = None           # SimPy event: the decode side has reserved the blocks


class DisaggFleet(Fleet):
    def __init__(self, config: DisaggConfig, trace: Trace, *, progress: bool = False):
        config.validate()
        self.dconfig = config
        self.env = simpy.Environment()
        self._waiting_for_routing: list[simpy.Event] = []
        super().__init__(FleetConfig(config.replica, config.prefill, config.router), trace, progress=progress, resolved=resolve(config.replica))
        decode_resolved = resolve(replace(config.replica, enable_prefix_caching=True))
        P = config.prefill
        self.prefill = self.replicas[:P]
        self.decode = [PacedReplica(P + j, decode_resolved, trace, self.env, self) for j in range(config.decode)]
        self.replicas = self.prefill + self.decode
        n = len(trace.requests)
        self.first_half: list[RequestRecord | None] = [None] * n
        self.second_half: list[RequestRecord | None] = [None] * n
        out_lens = self.prefill[0].max_tokens
        for r in self.prefill:
            r.records = self.first_half
            r.max_tokens = [1] * n
            # A prefill replica never decodes, so a span there is never more than one step,
            # and only one kind: a prefill whose last chunk is one token looks like a decode
            # to the steady-decode plan. That step must run as a normal step: the KV hold
            # for the transfer is taken before a normal step's update (`before_update`).
            r.event_skipping = False
            r.before_update = self._prefill_before_update(r)
            r._finish = self._prefill_finish(r, r._finish)
        for r in self.decode:
            r.records = self.second_half
            r.max_tokens = [max(1, m - 1) for m in out_lens]
            r.after_step = self._decode_after_step
            r.queue = deque()                           # transfers waiting for this replica's memory
        self.out_lens = out_lens
        self._holds: dict[str, list[int]] = {}      # prefill request id -> blocks kept for sending
        self.transfers: list[Transfer] = []
        self._in_flight = 0
        self._link_free = {r.index: 0.0 for r in self.prefill}
        bb = self.prefill[0].resolved.block_bytes
        self._block_seconds = bb / config.bandwidth
        self._latency = LINKS[config.link][1]

    # -- routing: arrivals go to prefill replicas only -------------------------------------
    def route(self, request: Request, now: float) -> PacedReplica:
        replicas = self.prefill
        if len(replicas) > 1 and self.router.reads_kv:
            for r in replicas:
                r.sync(now)
        return replicas[self.router.choose(request, replicas) if len(replicas) > 1 else 0]

    # -- the SimPy fleet: replicas and transfers as processes, routing at each arrival -------
    def _make_replicas(self, resolved: ResolvedConfig) -> list:
        return [PacedReplica(i, resolved, self.trace, self.env, self) for i in range(self.config.replicas)]

    def arrival_pending(self, t: float) -> bool:
        """Is an arrival at or before t still to be routed?"""
        return self._next < len(self.arrivals) and self.arrivals[self._next] <= t

    def after_routing(self) -> simpy.Event:
        """An event the router triggers once it has routed the arrivals now due."""
        ev = self.env.event()
        self._waiting_for_routing.append(ev)
        return ev

    def _router_process(self):
        env, arrivals, n = self.env, self.arrivals, len(self.arrivals)
        while self._next < n:
            t = arrivals[self._next]        # exact: SimPy's now + (t - now) may round
            if t > env.now:
                yield env.timeout(t - env.now)
            self._route_instant(t)
            waiters, self._waiting_for_routing = self._waiting_for_routing, []
            for ev in waiters:
                ev.succeed()
        for r in self.replicas:              # no more arrivals: let idle replicas stop
            r.wake(t)

    def _drive(self) -> None:
        self.env.process(self._router_process())
        procs = []
        for r in self.replicas:
            r.process = self.env.process(r._engine_process())
            procs.append(r.process)
        self.env.run(until=simpy.AllOf(self.env, procs))

    def more_work_may_come(self, replica: PacedReplica) -> bool:
        if self._next < len(self.arrivals):
            return True
        # A decode replica waits while a transfer is on its way or a prefill still running
        # may start one.
        return replica.index >= len(self.prefill) and (self._in_flight > 0 or self._prefill_busy())

    def _prefill_busy(self) -> bool:
        return any(p.scheduler.requests or p.inbox for p in self.prefill)

    # -- prefill side -------------------------------------------------------------------------
    def _prefill_before_update(self, replica: PacedReplica):
        gpu = replica.scheduler.kv.gpu

        def hold(out, end):
            for s in out.scheduled:
                if s.num_samples and self.out_lens[s.seq.request.user_data] > 1:
                    blocks = list(s.block_table)
                    gpu.incref(blocks)
                    self._holds[s.seq.request.request_id] = blocks
        return hold

    def _prefill_finish(self, replica: PacedReplica, finish):
        def on_finish(requests):
            # The progress bar counts a request once, where it leaves the fleet: here only if
            # it ends here (rejected, one-token), else when its decode half finishes.
            pbar, replica._pbar = replica._pbar, None
            fresh = {id(r) for r in requests if self.first_half[r.user_data] is None} if pbar is not None else ()
            try:
                finish(requests)
            finally:
                replica._pbar = pbar
            for request in requests:
                blocks = self._holds.pop(request.request_id, None)
                if blocks is None:               # rejected, or a one-token request: done here
                    if request.status is not RequestStatus.FINISHED_REJECTED and \
                            self.out_lens[request.user_data] > 1:
                        raise RuntimeError(f"request {request.request_id} finished its prefill on replica "
                                           f"{replica.index} without its KV held for the transfer")
                    if id(request) in fresh:
                        pbar.update(1)
                    continue
                seq = request.finished_seqs[0]
                t = Transfer(request.user_data, replica, blocks, list(seq.token_ids), request.metrics.finished_time)
                self.transfers.append(t)
                self._in_flight += 1
                self.env.process(self._send(t))
            if not self._in_flight and self._next >= len(self.arrivals) and not self._prefill_busy():
                # The last prefill ended without a transfer: idle decode replicas may stop
                # (woken at their own clock: no idle time is added to them).
                for d in self.decode:
                    d.wake(d.clock)
        return on_finish

    # -- the transfer ---------------------------------------------------------------------------
    def _send(self, t: Transfer):
        env = self.env
        yield env.timeout(max(0.0, t.ready - env.now))
        for d in self.decode:
            d.sync(t.ready)                               # free blocks as of now, pending spans included
        target = max(self.decode, key=lambda d: (d.scheduler.kv.gpu.num_free - self._queued_blocks(d), -d.index))
        t.target = target
        target.queue.append(t)
        t.reserved_at = -1.0
        self._reserve(target, t.ready)
        while t.reserved_at < 0:
            t.wakeup = env.event()
            yield t.wakeup
        link = t.source.index
        t.started = max(t.reserved_at, self._link_free[link])
        t.done = t.started + self._latency + len(t.held) * self._block_seconds
        self._link_free[link] = t.done
        yield env.timeout(max(0.0, t.done - env.now))
        src = t.source
        src.interrupt_at(t.done)
        src.scheduler.kv.gpu.free(reversed(t.held))
        src.wake(t.done)                                 # it may have been blocked on these blocks
        self._arrive(t)

    def _queued_blocks(self, d: PacedReplica) -> int:
        bs = d.resolved.cache.block_size
        return sum(-(-(len(t.prompt) - 1) // bs) for t in d.queue)

    def _reserve(self, d: PacedReplica, now: float) -> None:
        """Start the queued transfers to `d` that its pool can now hold (FIFO)."""
        kv = d.scheduler.kv
        bs = d.resolved.cache.block_size
        d.sync(now)                                      # its pool as of now
        while d.queue:
            t = d.queue[0]
            need = -(-(len(t.prompt) - 1) // bs)         # the prompt's KV (the first token is computed there)
            if kv.gpu.num_free - need < kv.watermark_blocks:   # the decode side's admission rule
                break
            d.interrupt_at(now)                          # a pending span must not see the pool shrink
            d.queue.popleft()
            t.reserved = kv.gpu.allocate(need)
            t.reserved_at = now
            w = t.wakeup
            if w is not None and not w.triggered:
                w.succeed()

    def _arrive(self, t: Transfer) -> None:
        d = t.target
        d.interrupt_at(t.done)
        i = t.index
        kv = d.scheduler.kv
        params = SamplingParams(max_tokens=d.max_tokens[i], ignore_eos=True)
        tr = self.trace.requests[i]
        request = Request(tr.request_id, t.prompt, params, arrival_time=t.done, eos_token_id=SIM_EOS_TOKEN_ID,
                          user_data=i)
        seq = request.seqs[0]
        kv.find_cached_prefix(seq)                       # computes the prompt's block hashes
        for block, h in zip(t.reserved, seq.block_hashes):
            kv.gpu.register(block, h)
        kv.gpu.free(reversed(t.reserved))                # cached, evictable: the tail first
        t.request = request
        self._in_flight -= 1
        d.deliver(request, t.done)
        self._reserve(d, t.done)
        if self._in_flight == 0 and self._next >= len(self.arrivals):
            for r in self.decode:
                r.wake(t.done)

    def _decode_after_step(self, d: PacedReplica) -> None:
        """Start transfers that now fit."""
        if d.queue:
            self._reserve(d, d.clock)

    # -- result -----------------------------------------------------------------------------------
    def _result(self) -> FleetResult:
        n = len(self.trace.requests)
        records = []
        for i in range(n):
            a, b = self.first_half[i], self.second_half[i]
            if a is None:
                raise RuntimeError(f"request {self.trace.requests[i].request_id} never finished its prefill")
            if b is None:
                if self.out_lens[i] > 1 and a.status != "rejected":
                    raise RuntimeError(f"request {a.request_id} never finished its decode")
                records.append(a)
                continue
            records.append(RequestRecord(
                a.request_id, b.status, a.arrival_time, a.first_scheduled_time, a.first_token_time,
                b.finished_time, a.num_prompt_tokens, a.num_output_tokens + b.num_output_tokens,
                a.num_cached_prompt_tokens, a.num_preemptions + b.num_preemptions, a.num_swaps + b.num_swaps,
                a.queue_time + b.queue_time, type(b.token_times)("d", [a.first_token_time, *b.token_times]),
                b.reject_reason))
        self.records = records
        per = []
        for r in self.replicas:
            idx = sorted(r.served)
            halves = r.records
            per.append(r.build_result([halves[i] for i in idx], [r.max_tokens[i] for i in idx]))
        xs = self.transfers
        extra = {"disaggregation": {
            "prefill_replicas": self.dconfig.prefill, "decode_replicas": self.dconfig.decode,
            "link": self.dconfig.link, "link_bandwidth_gbps": self.dconfig.bandwidth / 1e9,
            "num_transfers": len(xs),
            "transfer_blocks": sum(len(t.held) for t in xs),
            "mean_transfer_time": sum(t.done - t.started for t in xs) / len(xs) if xs else 0.0,
            "mean_wait_for_decode_memory": sum(t.reserved_at - t.ready for t in xs) / len(xs) if xs else 0.0,
            "mean_wait_for_link": sum(t.started - t.reserved_at for t in xs) / len(xs) if xs else 0.0,
        }}
        cfg = FleetConfig(self.dconfig.replica, self.dconfig.prefill + self.dconfig.decode, self.dconfig.router)
        return FleetResult(cfg, self.trace.source, records, self.out_lens, self.replica_of, per,
                           max(r.clock for r in self.replicas), extra)


def simulate_disagg(config: DisaggConfig, trace: Trace, *, progress: bool = False) -> FleetResult:
    return DisaggFleet(config, trace, progress=progress).run()
