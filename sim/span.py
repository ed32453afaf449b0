"""A steady-decode span: planned ahead, then committed in order (whole, or in pieces).

Event skipping (`sim.engine`) runs the steady decode steps the core describes
(`core.sched.event_skipping.SteadyDecode`) without one engine iteration each, in two passes:

* planning (`Span.extend`, `Span.cover`): price the steps with the cost model's
  `decode_step_times` (the same floats as single steps) and stamp their end times (a
  running sum, in C). A span that goes on past finishes is priced in phases: after a step
  in which sequences reach their length limit, the survivors' steps are priced without
  them. Planning knows nothing of memory, so planning steps that are never run (a fleet
  replica plans past arrivals that may be routed to it) costs little;
* committing (`Replica._commit_span`, which calls `Span.account`): the steps
  [done, k) add their time-weighted accounting to the engine's integrals (blocks in use,
  the memory breakdown, request counts: sums of the same products in step order as single
  steps, so bit-identical), one timeseries row per phase piece, and are applied to the
  core (`core.sched.event_skipping.fast_forward`).

A fleet replica (`sim.cluster.fleet`, `sim.cluster.disagg`) plans to the fleet's next arrival, grows the
plan while the router sends requests elsewhere, and commits when a request is delivered
to it or the router reads its KV state. The single engine knows its next event when a span
starts and commits every span whole, so it prices and accounts in one fused loop
(`SimEngine._span`, the same sums): two passes cost it ~3% more instructions per run.

Blocks in use per step: a sequence with c cached tokens and a table of b blocks takes a
new block at steps j0 = b * block_size - c, j0 + block_size, ... (paged: j0 < block
size; a contiguous region covers the sequence's whole life, so its j0 lies past the
span: `late`). When sequences finish in step f they free `blocks_at_finish` blocks and
their token states leave the pool.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from itertools import accumulate

from sim.memory import MemorySample, SpanModel, blocks_at_finish, growth_from_offsets


class Span:
    """The plan (durations, end times) and the accounting cursor of one span."""

    __slots__ = ("start", "plan", "horizon", "durations", "ends", "counts", "model", "done", "cut",
                 "_finish_steps", "_price", "_bs", "_leaving", "_plan_bounds", "_num_seqs", "_context_sum",
                 "_finish_counts", "_acc_bounds", "_starts", "_late", "_used", "_tok", "_res", "_n",
                 "_running", "_g", "_c0")

    def __init__(self, engine, plan):
        sched = engine.scheduler
        self.start = engine.clock
        self.plan = plan
        horizon = self.horizon = plan.horizon
        self._price = engine.executor.decode_step_times
        bs = self._bs = engine.resolved.cache.block_size
        self.durations: list[float] = []
        self.ends = array("d")           # each request's token_times extends by a memcpy
        self.counts = (len(sched.running), len(sched.waiting), len(sched.swapped))
        self.done = 0                    # steps already committed
        self.cut: int | None = None      # a fleet replica: stop after this many steps
        starts, late = self._starts, self._late = growth_from_offsets(plan.offsets, bs)
        model = self.model = SpanModel(sched, plan.num_seqs, starts, late, plan.offsets)
        # Steps in which sequences finish before the horizon's last one (past finishes):
        # step -> the plan indices of the sequences it finishes.
        leaving: dict[int, list[int]] = {}
        if horizon > plan.first_finish:
            for idx, left in enumerate(plan.lefts):
                if left < horizon:
                    leaving.setdefault(left - 1, []).append(idx)
            if late or self.counts[1] or self.counts[2] or model.reserves or model.ext \
                    or plan.num_seqs != self.counts[0]:
                raise RuntimeError("event skipping: a span past finishes needs paged, exclusive blocks and no queue")
        self._leaving = leaving
        self._c0: dict[int, int] | None = None           # their cached tokens, once the core moved on
        self._finish_steps: list[int] | None = None    # (lazy, for routers)
        self._finish_counts: list[int] | None = None   # cumulative requests over finish_steps (lazy)
        # Planning: the running set of the phase priced next (phase ends popped from the end).
        self._plan_bounds = sorted(leaving, reverse=True) if leaving else []
        self._num_seqs, self._context_sum = plan.num_seqs, plan.context_sum
        # Accounting cursor: the state before step `done`.
        self._acc_bounds = self._plan_bounds[:]
        self._used = sched.kv.gpu.num_used
        self._tok, self._res, self._n, self._running = model.tok, model.res, plan.num_seqs, self.counts[0]
        self._g = model.used - model.logical              # logical blocks = used - g

    # -- planning ---------------------------------------------------------------------------
    def extend(self, n: int) -> None:
        """Price the next n steps (at most to the horizon) and stamp their end times."""
        ends, durations, bounds = self.ends, self.durations, self._plan_bounds
        target = min(self.horizon, len(ends) + n)
        while len(ends) < target:
            i0 = len(ends)
            if bounds and i0 == bounds[-1] + 1:
                # Step i0 - 1 finished sequences: the next steps run without them.
                leaving = self._leaving[bounds.pop()]
                self._num_seqs -= len(leaving)
                self._context_sum -= sum(map(self._cached_tokens, leaving))
            end = min(target, bounds[-1] + 1) if bounds else target
            num_seqs = self._num_seqs
            chunk = self._price(num_seqs, self._context_sum + i0 * num_seqs, end - i0)
            times = accumulate(chunk, initial=ends[-1] if i0 else self.start)
            next(times)
            ends.extend(times)               # t + dt in step order: the single steps' floats
            durations += chunk

    # -- reading the plan -------------------------------------------------------------------
    @property
    def finishes(self) -> bool:
        """Does the span's last step bring sequences to their length limit?"""
        return self.plan.first_finish <= self.horizon

    def steps_started_before(self, t: float) -> int:
        """Planned steps that start before t."""
        if t <= self.start:
            return 0
        return min(len(self.ends), bisect_left(self.ends, t) + 1)

    def end_of(self, k: int) -> float:
        return self.ends[k - 1] if k else self.start

    @property
    def finish_steps(self) -> list[int]:
        """The steps in which sequences reach their length limit, in order."""
        steps = self._finish_steps
        if steps is None:
            steps = self._finish_steps = sorted(self._leaving) + ([self.horizon - 1] if self.finishes else [])
        return steps

    def finishes_in(self, step: int) -> bool:
        """Do sequences reach their length limit in this step?"""
        return step in self._leaving or (step == self.horizon - 1 and self.finishes)

    def requests_finished_before(self, t: float) -> tuple[int, float]:
        """(requests, until): the requests (one sequence each) that finish in the steps not
        yet committed that start before t, and the last instant from t on at which that
        number is still the same: the start of the next finishing step not started before
        t (the planned end when that step is not planned yet; inf when none is left). (A
        span cut by a delivery is committed before the next arrival instant.)"""
        cum = self._finish_counts
        if cum is None:
            counts = {f: len(v) for f, v in self._leaving.items()}
            if self.finishes:
                counts[self.horizon - 1] = self.plan.lefts.count(self.horizon)
            cum = [0]                                   # cum[j]: requests finishing in finish_steps[:j]
            for f in self.finish_steps:
                cum.append(cum[-1] + counts[f])
            self._finish_counts = cum
        steps = self.finish_steps
        j = bisect_left(steps, self.steps_started_before(t))
        finished = cum[j] - cum[bisect_left(steps, self.done)]
        if j == len(steps):
            return finished, float("inf")
        f = steps[j]
        return finished, self.end_of(f) if f < len(self.ends) else self.ends[-1]

    # -- committing -------------------------------------------------------------------------
    def account(self, engine, k: int) -> None:
        """Add steps [done, k) to the engine's integrals (`memory.integrals()`, request-seconds,
        the largest block count) and timeseries (one row per phase piece), in step order:
        each integral is the same sum of the same products as single steps make. Advances
        the cursor; the caller applies the steps to the core and moves `done`."""
        model, bs = self.model, self._bs
        total, ext, free0, used0, g = model.total, model.ext, model.free, model.used, self._g
        waiting, swapped = self.counts[1], self.counts[2]
        memory = engine.memory
        token_s, reserved_s, internal_s, external_s, free_s, physical_s, logical_s = memory.integrals()
        w_run, w_wait, w_swap = engine._w_running, engine._w_waiting, engine._w_swapped
        used, tok, res, n, running = self._used, self._tok, self._res, self._n, self._running
        starts, late, durations, ends, bounds = self._starts, self._late, self.durations, self.ends, self._acc_bounds
        res_step = n if model.reserves else 0
        # Terms that are 0 throughout the span add nothing (x + 0.0 == x for these sums of
        # non-negative products): the common case (paged, nothing waiting) skips them.
        lean = not (waiting or swapped or model.res or res_step or ext or late)
        a = self.done
        while a < k:
            while bounds and bounds[-1] < a:
                # Step f finished sequences: their blocks and token states leave.
                f = bounds.pop()
                leaving, offsets = self._leaving[f], self.plan.offsets
                for idx in leaving:
                    c, j0 = self._cached_tokens(idx), offsets[idx]
                    used -= blocks_at_finish(c, j0, f, bs)
                    tok -= c + f + 1                   # its token states during step f
                    starts[j0] -= 1
                n -= len(leaving)
                running = n
            b = min(k, bounds[-1] + 1) if bounds else k
            in_use_before, physical_before = (token_s, reserved_s, internal_s, external_s), physical_s
            if lean:
                # free and used - g kept as they change (the same integers, so the same
                # products); step i's growth is starts[i % bs], rotated to start at a.
                free, used_g = free0 - bs * (used - used0), used - g
                r = a % bs
                growth = starts[r:] + starts[:r]
                if b - a > bs:
                    growth *= -(-(b - a) // bs)
                for dt, grow in zip(durations[a:b], growth):
                    if grow:
                        used += grow
                        free -= bs * grow
                        used_g += grow
                    w_run += running * dt
                    tok += n
                    token_s += tok * dt
                    internal_s += (total - tok - free) * dt
                    free_s += free * dt
                    physical_s += used * dt
                    logical_s += used_g * dt
            else:
                for i in range(a, b):
                    dt = durations[i]
                    if late and i in late:
                        starts[i % bs] += late.pop(i)
                    used += starts[i % bs]
                    w_run += running * dt
                    w_wait += waiting * dt
                    w_swap += swapped * dt
                    tok += n
                    res -= res_step
                    free = free0 - bs * (used - used0)
                    token_s += tok * dt
                    reserved_s += res * dt
                    internal_s += (total - tok - res - ext - free) * dt
                    external_s += ext * dt
                    free_s += free * dt
                    physical_s += used * dt
                    logical_s += (used - g) * dt
            engine._span_row(ends[a - 1] if a else self.start, ends[b - 1], b - a, physical_s - physical_before, running, waiting, swapped, n,
                             (token_s, reserved_s, internal_s, external_s), in_use_before)
            if used > engine._max_used:
                engine._max_used = used            # (blocks only grow within a phase)
            a = b
        memory.set(MemorySample(token_s, reserved_s, internal_s, external_s, free_s, physical_s, logical_s))
        engine._w_running, engine._w_waiting, engine._w_swapped = w_run, w_wait, w_swap
        self._used, self._tok, self._res, self._n, self._running = used, tok, res, n, running

    def _cached_tokens(self, idx: int) -> int:
        """Cached tokens before the span of the plan's sequence idx."""
        c0 = self._c0
        return c0[idx] if c0 is not None else self.plan.seqs[idx].num_computed_tokens

    def keep_cached_tokens(self) -> None:
        """Before a commit that is not the span's last: the core is about to move the
        sequences on, so keep what later phases read of them (their cached tokens before
        the span)."""
        if self._c0 is None and self._leaving:
            seqs = self.plan.seqs
            self._c0 = {idx: seqs[idx].num_computed_tokens for ids in self._leaving.values() for idx in ids}

    def sample_after(self) -> tuple[int, int, int, int, int, int, int]:
        """The memory sample during the last committed step (`sim.memory.sample`), from the
        cursor: what the core must show after the commit unless sequences finished in it."""
        model, used = self.model, self._used
        free = model.free - self._bs * (used - model.used)
        tok, res, ext = self._tok, self._res, model.ext
        return tok, res, model.total - tok - res - ext - free, ext, free, used, used - self._g

    @property
    def blocks_in_use(self) -> int:
        """Blocks in use during the last committed step (the cursor)."""
        return self._used
