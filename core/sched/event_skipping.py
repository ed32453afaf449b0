"""Event skipping for the simulator: run k steady decode steps of a scheduler at once.

In a steady decode span every running sequence computes exactly one token per step,
and nothing is admitted, swapped, preempted or copied; only its last step may finish
sequences at their length limit. The simulator asks
`steady_decode_horizon` how long the span lasts, prices its steps, and applies them
with `fast_forward`, which allocates (and publishes to the prefix cache) exactly as
that many `schedule()` + `update()` calls would, so both modes give identical results
(tests/core/sched/test_event_skipping.py checks this under every registered policy combination).
The real engine never uses this module.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from core.outputs import ModelRunnerOutput, SchedulerOutput, StepResult
from core.sched.request import Request, RequestStatus, Sequence
from core.sched.stop import stop_status

if TYPE_CHECKING:
    from core.sched.scheduler import Scheduler

RUNNING = RequestStatus.RUNNING


class SteadyDecode:
    """What a pass over the running sequences tells about the next steady decode span.

    seqs: the running sequences in batch order; lefts: each one's steps to its length
    limit; offsets: each one's `KVManager.decode_block_offsets` (when it takes its next
    block); context_sum: their cached tokens (the next step's shape is (num_seqs,
    context_sum)); horizon: as `steady_decode_horizon` (0: no span can start now, though
    every sequence is a plain decode); first_finish: the step count after which the first
    sequences reach their limit. `fast_forward` takes it to skip its own pass; `applied`
    counts the steps applied through it so far (a span may be applied in pieces). Valid
    until anything but `fast_forward`, `schedule_steady_step`/`update_steady_step` or
    `add_request` changes the scheduler; `renew_steady_plan` then gives the next span's
    plan without a pass over every sequence."""

    __slots__ = ("horizon", "seqs", "lefts", "offsets", "num_seqs", "num_requests", "context_sum", "first_finish",
                 "applied")

    def __init__(self, horizon: int, seqs: list[Sequence], lefts: list[int], offsets: list[int],
                 context_sum: int, num_requests: int):
        self.horizon = horizon
        self.seqs = seqs
        self.lefts = lefts
        self.offsets = offsets
        self.num_seqs = len(seqs)
        self.num_requests = num_requests
        self.context_sum = context_sum
        self.first_finish = min(lefts)
        self.applied = 0

    def current_offsets(self, block_size: int) -> list[int]:
        """`offsets` after the `applied` steps."""
        return shifted_offsets(self.offsets, self.applied, block_size)


def shifted_offsets(offsets: list[int], steps: int, block_size: int) -> list[int]:
    """Block offsets (`KVManager.decode_block_offsets`) after `steps` decode steps: a
    sequence that took its block at step j <= steps takes the next one every block_size."""
    if not steps:
        return offsets
    return [j - steps if steps <= j else (j - steps) % block_size for j in offsets]


def steady_decode_horizon(sched: "Scheduler", through_finishes: bool = False) -> int:
    """How many upcoming steps, run one by one, would each schedule exactly one decode
    token for every running sequence with no admission, swap, preemption, copy-on-write
    or finish. 0 when the engine is not in such a steady state. Call between steps.

    through_finishes: the span may end *with* the step in which the first sequences
    reach their length limit (`fast_forward` then finishes them as `update()` would).
    That step's own schedule() sees the pool before the finish, like the span's other
    steps; the blocks the finish frees can only matter to the next schedule(), which the
    caller's next horizon check (admission, swap-in) covers.

    Admission during the span is ruled out by checking the queue's head once: with a
    shrinking free pool the head stays inadmissible as long as the cache contents it
    sees do not change. They change in two ways. New entries: assumed harmless (as the
    simulator guarantees, a waiting prompt never contains the tokens running sequences
    are generating). Evictions: they can shorten a waiting request's prefix hits (which
    can lower its block demand) and reorder a cache-aware queue (lpm), so while a
    request waits under prefix caching the span only uses blocks that evict nothing.
    """
    plan = steady_decode_plan(sched, through_finishes)
    return 0 if plan is None else plan.horizon


def steady_decode_plan(sched: "Scheduler", through_finishes: bool = False) -> SteadyDecode | None:
    """`steady_decode_horizon` with what the pass saw (None when the horizon is 0)."""
    plan = describe_steady_decode(sched, through_finishes)
    return plan if plan is not None and plan.horizon > 0 else None


def describe_steady_decode(sched: "Scheduler", through_finishes: bool = False,
                           past_finishes: bool = False) -> SteadyDecode | None:
    """The running sequences as a `SteadyDecode` when every one of them is a plain decode
    (one known token to compute, no beams, stop tokens or EOS, no copy-on-write next),
    with its span horizon (possibly 0); None when they are not. past_finishes: see
    `_horizon`."""
    running = sched.running
    if not running or sched.has_unreported_finishes:
        return None
    max_len = sched.config.max_model_len
    seqs: list[Sequence] = []
    lefts: list[int] = []
    context_sum = 0
    for request in running:
        context_sum = _add_decodes(request, max_len, seqs, lefts, context_sum)
        if context_sum < 0:
            return None
    offsets = sched.kv.decode_block_offsets(seqs)
    if offsets is None:
        return None
    plan = SteadyDecode(0, seqs, lefts, offsets, context_sum, len(running))
    plan.horizon = _horizon(sched, plan, through_finishes, past_finishes)
    return plan


def _add_decodes(request: Request, max_len: int, seqs: list[Sequence], lefts: list[int], context_sum: int) -> int:
    """Append the request's sequences and their steps to the length limit; returns the new
    context sum, or -1 if one of them is not a plain decode."""
    params = request.params
    if params.beam_width or not params.ignore_eos or params.stop_token_ids or \
            (params.n > 1 and not request._forked):
        return -1
    max_tokens = params.max_tokens
    for seq in request.seqs:
        n = len(seq.token_ids)
        c = seq.num_computed_tokens
        if n - c != 1:
            return -1                                 # not a decode
        left = max_len - n
        if max_tokens is not None and max_tokens - (n - seq.num_prompt_tokens) < left:
            left = max_tokens - (n - seq.num_prompt_tokens)
        seqs.append(seq)
        lefts.append(left)
        context_sum += c
    return context_sum


def _horizon(sched: "Scheduler", plan: SteadyDecode, through_finishes: bool, past_finishes: bool = False) -> int:
    """The span horizon of a fresh (nothing applied) plan of the scheduler's state.

    past_finishes (with through_finishes): the span may go on past the steps in which
    sequences finish, up to the last sequence's limit, when nothing waits or is swapped
    out and every request has one sequence. Step by step, a finish then changes nothing
    for the others: the next schedule() has nobody to admit or swap in, and the survivors
    decode on (`fast_forward` finishes each sequence at its own step, freeing its blocks
    in step order). The caller vouches that a finish creates no event of its own (e.g. a
    conversation's next turn). Only when the free pool holds every sequence's growth to
    that last limit (counted as if none finished: an overestimate); otherwise the span ends
    at the first finish, so a tight pool sees the same spans either way."""
    cfg, kv = sched.config, sched.kv
    horizon = plan.first_finish - (0 if through_finishes else 1)   # 1: the finishing step runs normally
    if horizon <= 0 or plan.num_seqs > cfg.max_num_batched_tokens:
        return 0
    if sched.swapped:
        if kv.can_swap_in(sched.swapped[0].seqs):
            return 0
    elif len(sched.waiting):
        if sched.admits_next(cfg.max_num_batched_tokens - plan.num_seqs):
            return 0
    elif past_finishes and through_finishes and plan.num_requests == plan.num_seqs:
        last = max(plan.lefts)
        if last > horizon and kv.steps_fitting(plan.offsets, last, kv.free_blocks()) >= last:
            return last
    free = kv.free_blocks(evicting=not (kv.enable_prefix_caching and len(sched.waiting) and not sched.swapped))
    # Largest k whose block growth fits the free pool.
    return max(kv.steps_fitting(plan.offsets, horizon, free), 0)


def renew_steady_plan(sched: "Scheduler", plan: SteadyDecode, through_finishes: bool = False,
                      admitted: list[Request] = (), past_finishes: bool = False) -> SteadyDecode | None:
    """The next span's plan from the previous one (`describe_steady_decode`'s result),
    after its steps were applied (`fast_forward`, ending in finishes or not) and possibly
    a `schedule_steady_step` that admitted `admitted`: the finished sequences leave, the
    admitted ones join, the rest are rebased by the steps applied; only the joining
    requests are examined. None when the scheduler is no longer a plain decode state."""
    if sched.has_unreported_finishes or sched._in_flight:
        return None
    a = plan.applied
    bs = sched.kv.block_size
    seqs, lefts, offsets = plan.seqs, plan.lefts, plan.offsets
    context_sum = plan.context_sum + a * plan.num_seqs
    num_requests = plan.num_requests
    if plan.first_finish <= a:                          # the last application finished some
        keep = [i for i, seq in enumerate(seqs) if seq.status is RUNNING]
        # A finished sequence ran lefts[i] <= a of the steps (context_sum counts a).
        context_sum -= sum(seq.num_computed_tokens + a - left for seq, left in zip(seqs, plan.lefts)
                           if seq.status is not RUNNING)
        seqs = [seqs[i] for i in keep]
        lefts = [lefts[i] - a for i in keep]
        offsets = [offsets[i] for i in keep]
        num_requests = len(seqs) if num_requests == plan.num_seqs else len({seq.request for seq in seqs})
    else:
        if admitted:
            seqs = list(seqs)
        lefts = [left - a for left in lefts]
    offsets = shifted_offsets(offsets, a, bs)
    if offsets is plan.offsets:
        offsets = list(offsets)
    if admitted:
        max_len = sched.config.max_model_len
        first = len(seqs)
        for request in admitted:
            if request.status is not RUNNING:
                continue                                # finished at once (its first token was its last)
            context_sum = _add_decodes(request, max_len, seqs, lefts, context_sum)
            if context_sum < 0:
                return None
            num_requests += 1
        more = sched.kv.decode_block_offsets(seqs[first:])
        if more is None:
            return None
        offsets += more
    if not seqs or num_requests != len(sched.running):
        return None
    renewed = SteadyDecode(0, seqs, lefts, offsets, context_sum, num_requests)
    renewed.horizon = _horizon(sched, renewed, through_finishes, past_finishes)
    return renewed


def steady_decode_shape(sched: "Scheduler") -> tuple[int, int]:
    """(num_seqs, sum of cached tokens) of the next steady decode step."""
    num, ctx = 0, 0
    for request in sched.running:
        for seq in request.seqs:
            num += 1
            ctx += seq.num_computed_tokens
    return num, ctx


def fast_forward(sched: "Scheduler", k: int, step_end_times: list[float],
                 token_fn: Callable[[Sequence, int, int], list[int]],
                 plan: SteadyDecode | None = None,
                 extend_tokens: Callable[[list[Sequence], int], None] | None = None) -> StepResult:
    """Apply k steady decode steps at once (k <= steady_decode_horizon(sched, ...), or the
    plan's horizon).

    Blocks are allocated and published in exactly the order k single steps would use
    (`KVManager.advance_decodes`), so eviction and cache state match; per-token work is
    a list extend. token_fn(seq, first_position, count) gives the sampled tokens.
    Sequences at their length limit after the k-th step finish as `update()` finishes
    them (in batch order, freeing blocks in the same order); their requests are returned.
    `plan`: this state's `steady_decode_plan` (its steps applied so far counted in
    plan.applied), which spares a pass over the running sequences; with it,
    `extend_tokens(seqs, k)` (if given) appends token_fn's k tokens to every sequence
    in one call, and a plan whose horizon goes past finishes (`_horizon`'s past_finishes)
    finishes each sequence at its own step (`_fast_forward_past_finishes`).
    """
    if k <= 0:
        return StepResult(updated=[], finished=[])
    done: list[Sequence] = []                 # at their length limit after the k-th step
    if plan is not None:
        seqs = plan.seqs
        applied = plan.applied + k
        if plan.first_finish < applied:       # some finish before the last step (or finished before)
            return _fast_forward_past_finishes(sched, k, step_end_times, token_fn, plan, extend_tokens)
        plan.applied = applied
        if extend_tokens is not None:
            extend_tokens(seqs, k)
        else:
            for seq in seqs:
                tokens = seq.token_ids
                tokens.extend(token_fn(seq, len(tokens), k))
        if applied >= plan.first_finish:
            done = [seq for seq, left in zip(seqs, plan.lefts) if left <= applied]
    else:
        max_len = sched.config.max_model_len
        seqs = []
        for request in sched.running:
            params = request.params
            for seq in request.seqs:
                tokens = seq.token_ids
                tokens.extend(token_fn(seq, len(tokens), k))
                seqs.append(seq)
                n = len(tokens)
                if stop_status(params, None, None, n - seq.num_prompt_tokens, n, max_len) is not None:
                    done.append(seq)
    if plan is not None:
        applied -= k                              # the steps applied before these
        sched.kv.advance_decodes(seqs, k, shifted_offsets(plan.offsets, applied, sched.kv.block_size))
    else:
        sched.kv.advance_decodes(seqs, k)
    for seq in seqs:
        seq.num_computed_tokens += k
    times = step_end_times[:k] if len(step_end_times) != k else step_end_times
    last = times[-1]
    running = sched.running
    for request in running:
        m = request.metrics
        if m.first_token_time is None:        # the span's first step ended a prefill
            m.first_token_time = times[0]
        m.token_times.extend(times)
        m.last_token_time = last
    sched.num_steps += k
    updated = list(running)
    if not done:
        return StepResult(updated=updated, finished=[])
    return StepResult(updated=updated, finished=sched.finish_at_length(done, last))


def _fast_forward_past_finishes(sched: "Scheduler", k: int, step_end_times, token_fn, plan: SteadyDecode,
                                extend_tokens) -> StepResult:
    """`fast_forward` of k plan steps in which sequences finish before the last one: each
    sequence runs until its own limit (steps = lefts - applied, at most k). Tokens, step
    times and computed counts are applied once per sequence; the blocks single steps would
    take are allocated up to each step in which sequences finish, which are then finished
    (freeing theirs), so every allocation and free happens in the order single steps use."""
    kv, bs = sched.kv, sched.kv.block_size
    a0 = plan.applied
    plan.applied = a0 + k
    seqs, lefts, offsets = plan.seqs, plan.lefts, plan.offsets
    if plan.first_finish <= a0:
        # Sequences finished in an earlier piece of this plan (a span applied in pieces).
        live = [i for i, left in enumerate(lefts) if left > a0]
        seqs, lefts, offsets = [seqs[i] for i in live], [lefts[i] for i in live], [offsets[i] for i in live]
    times = step_end_times[:k] if len(step_end_times) != k else step_end_times
    counts: list[int] = []
    finishing: dict[int, list[int]] = {}           # step -> batch indices of the sequences it finishes
    steps_of: dict[int, int] = {}                  # id(request) -> steps it takes part in
    for i, left in enumerate(lefts):
        c = left - a0
        if c <= k:
            finishing.setdefault(c - 1, []).append(i)
        else:
            c = k
        counts.append(c)
        key = id(seqs[i].request)
        if c > steps_of.get(key, 0):
            steps_of[key] = c
    if extend_tokens is not None:
        extend_tokens([seq for seq, c in zip(seqs, counts) if c == k], k)
        for seq, c in zip(seqs, counts):
            if c < k:
                extend_tokens([seq], c)
    else:
        for seq, c in zip(seqs, counts):
            tokens = seq.token_ids
            tokens.extend(token_fn(seq, len(tokens), c))
    running = list(sched.running)
    for request in running:
        m = request.metrics
        n = steps_of[id(request)]
        if m.first_token_time is None:
            m.first_token_time = times[0]
        m.token_times.extend(times if n == k else times[:n])
        m.last_token_time = times[n - 1]
    offsets = shifted_offsets(offsets, a0, bs)
    takers = kv.decode_allocations(seqs, counts, offsets)
    finished: list[Request] = []
    if takers is not None:
        # Allocation-only manager: nothing reads the computed counts while blocks move.
        for seq, c in zip(seqs, counts):
            seq.num_computed_tokens += c
        pos = 0
        for f in sorted(finishing):
            end = pos
            while end < len(takers) and takers[end][0] <= f:
                end += 1
            if end > pos:
                kv.take_blocks(takers[pos:end])
                pos = end
            finished += sched.finish_at_length([seqs[i] for i in finishing[f]], times[f])
        if pos < len(takers):
            kv.take_blocks(takers[pos:])
    else:
        # Phase by phase: the steps up to each one in which sequences finish.
        alive = list(range(len(seqs)))
        pos = 0
        for f in sorted(finishing) + ([k - 1] if k - 1 not in finishing else []):
            length = f + 1 - pos
            alive_seqs = [seqs[i] for i in alive]
            kv.advance_decodes(alive_seqs, length, [offsets[i] for i in alive])
            for seq in alive_seqs:
                seq.num_computed_tokens += length
            offsets = shifted_offsets(offsets, length, bs)
            pos = f + 1
            ending = finishing.get(f)
            if ending:
                finished += sched.finish_at_length([seqs[i] for i in ending], times[f])
                gone = set(ending)
                alive = [i for i in alive if i not in gone]
    sched.num_steps += k
    return StepResult(updated=running, finished=finished)


class SteadyStep:
    """A step scheduled by `schedule_steady_step`: every sequence of `plan` decodes one
    token (not listed as slices: num_decodes sequences with decode_context_sum cached
    tokens, batch order first), then `out.scheduled` holds what schedule() would add after
    them (admissions). `num_running`: the running requests before the admissions."""

    __slots__ = ("plan", "out", "num_decodes", "decode_context_sum", "num_running")

    def __init__(self, plan: SteadyDecode, out: SchedulerOutput, decode_context_sum: int, num_running: int):
        self.plan = plan
        self.out = out
        self.num_decodes = plan.num_seqs
        self.decode_context_sum = decode_context_sum
        self.num_running = num_running

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + len(self.out.scheduled)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_decodes + self.out.num_batched_tokens


def schedule_steady_step(sched: "Scheduler", plan: SteadyDecode, now: float) -> SteadyStep | None:
    """`schedule()` for the step after a steady decode span, when requests arrived: the
    plan's sequences decode one token each and the waiting queue is admitted after them,
    as schedule() would do it (same allocations in the same order, same admissions), but
    without a pass building the decodes' slices. None (nothing changed) when the step is
    not of that kind: a sequence would reach its length limit in it, the decodes' block
    growth does not fit the pool (schedule() would preempt), requests are swapped out or
    in flight, or finishes are unreported.

    `plan` must still describe the scheduler: nothing but `fast_forward(..., plan)` (no
    finish) and `add_request` changed it since `steady_decode_plan` returned it. The
    simulator uses this for the steps that admit arrivals; `update_steady_step` applies it.
    """
    if plan.first_finish - plan.applied < 2 or sched.swapped or sched._in_flight or sched._finished:
        return None
    kv, cfg = sched.kv, sched.config
    seqs = plan.seqs
    n = plan.num_seqs
    offsets = plan.current_offsets(kv.block_size)
    # An offset 0: the sequence needs a block this step (schedule() would preempt if the
    # pool were short; a full contiguous region cannot grow at all).
    if n > cfg.max_num_batched_tokens or (0 in offsets and kv.steps_fitting(offsets, 1, kv.free_blocks()) < 1):
        return None
    # schedule()'s running pass: one token each, allocating (and publishing) in batch order.
    kv.advance_decodes(seqs, 1, offsets)
    for seq in seqs:
        seq.num_computed_tokens += 1
    context_sum = plan.context_sum + plan.applied * n
    plan.applied += 1
    out = SchedulerOutput()
    out.finished_request_ids, sched._finished_ids = sched._finished_ids, []
    num_running = len(sched.running)
    budget = cfg.max_num_batched_tokens - n
    if budget > 0:
        sched._admit(budget, out, now, seated=n)
    out.blocks_to_copy = kv.drain_copies()
    sched.num_steps += 1
    return SteadyStep(plan, out, context_sum, num_running)


def update_steady_step(sched: "Scheduler", step: SteadyStep, result: ModelRunnerOutput, now: float,
                       token_fn: Callable[[Sequence, int, int], list[int]],
                       extend_tokens: Callable[[list[Sequence], int], None] | None = None) -> StepResult:
    """`update()` for a `SteadyStep`: the decodes append token_fn's token (no sequence
    finishes: see schedule_steady_step), then `result` (tokens of `step.out`'s slices) is
    applied as update() applies it. The plan counts the step as applied; the admitted
    requests join it through `renew_steady_plan(..., admitted=step.out.admitted)`."""
    if extend_tokens is not None:
        extend_tokens(step.plan.seqs, 1)
    else:
        for seq in step.plan.seqs:
            tokens = seq.token_ids
            tokens.extend(token_fn(seq, len(tokens), 1))
    running = sched.running
    for i in range(step.num_running):
        m = running[i].metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        m.last_token_time = now
    rest = sched.update(step.out, result, now)
    return StepResult(updated=running[:step.num_running] + rest.updated, finished=rest.finished)


def memory_breakdown(sched: "Scheduler") -> dict[str, int]:
    """KV slots by category now: token_states, reserved, internal_frag, external_frag, free."""
    head: Request | None = sched.waiting.peek() if len(sched.waiting) else None
    return sched.kv.memory_breakdown(sched.running, head)
