"""Event skipping for the simulator: run k steady decode steps of a scheduler at once.

In a steady decode span every running sequence computes exactly one token per step,
and nothing is admitted, swapped, preempted or copied; only its last step may finish
sequences at their length limit. The simulator asks
`steady_decode_horizon` how long the span lasts, prices its steps, and applies them
with `fast_forward`, which allocates (and publishes to the prefix cache) exactly as
that many `schedule()` + `update()` calls would, so both modes give identical results
(tests/core/test_event_skipping.py checks this under every registered policy combination).
The real engine never uses this module.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from core.outputs import StepResult
from core.request import Request, Sequence
from core.stop import stop_status

if TYPE_CHECKING:
    from core.scheduler import Scheduler


class SteadyDecode:
    """What one pass over the running sequences tells about the next steady decode span.

    seqs: the running sequences in batch order; lefts: each one's steps to its length
    limit; context_sum: their cached tokens (the next step's shape is (num_seqs,
    context_sum)); horizon: as `steady_decode_horizon`. `fast_forward` takes it to skip its
    own pass; `applied` counts the steps it applied so far (a span may be applied in pieces);
    first_finish: the step count after which the first sequences reach their limit.
    Valid until anything but `fast_forward` changes the scheduler."""

    __slots__ = ("horizon", "seqs", "lefts", "num_seqs", "context_sum", "first_finish", "applied")

    def __init__(self, horizon: int, seqs: list[Sequence], lefts: list[int], context_sum: int, first_finish: int):
        self.horizon = horizon
        self.seqs = seqs
        self.lefts = lefts
        self.num_seqs = len(seqs)
        self.context_sum = context_sum
        self.first_finish = first_finish
        self.applied = 0


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
    running = sched.running
    if not running or sched.has_unreported_finishes:
        return None
    cfg, kv = sched.config, sched.kv
    max_len = cfg.max_model_len
    horizon = max_len
    last = 0 if through_finishes else 1          # 1: the step that finishes is run normally
    seqs: list[Sequence] = []
    lefts: list[int] = []
    context_sum = 0
    for request in running:
        params = request.params
        if params.beam_width or not params.ignore_eos or params.stop_token_ids or \
                (params.n > 1 and not request._forked):
            return None
        max_tokens = params.max_tokens
        for seq in request.seqs:
            n = len(seq.token_ids)
            c = seq.num_computed_tokens
            if n - c != 1:
                return None                           # not a decode
            left = max_len - n
            if max_tokens is not None and max_tokens - (n - seq.num_prompt_tokens) < left:
                left = max_tokens - (n - seq.num_prompt_tokens)
            if left - last < horizon:
                horizon = left - last
            seqs.append(seq)
            lefts.append(left)
            context_sum += c
    if horizon <= 0 or len(seqs) > cfg.max_num_batched_tokens:
        return None
    if sched.swapped:
        if kv.can_swap_in(sched.swapped[0].seqs):
            return None
    elif len(sched.waiting) and sched.admits_next(cfg.max_num_batched_tokens - len(seqs)):
        return None
    free = kv.free_blocks(evicting=not (kv.enable_prefix_caching and len(sched.waiting) and not sched.swapped))
    # Largest k whose block growth fits the free pool; 0 if the next step copies on write.
    horizon = kv.decode_steps_fitting(seqs, horizon, free)
    if horizon <= 0:
        return None
    return SteadyDecode(horizon, seqs, lefts, context_sum, min(lefts))


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
                 plan: SteadyDecode | None = None) -> StepResult:
    """Apply k steady decode steps at once (k <= steady_decode_horizon(sched, ...)).

    Blocks are allocated and published in exactly the order k single steps would use
    (`KVManager.advance_decodes`), so eviction and cache state match; per-token work is
    a list extend. token_fn(seq, first_position, count) gives the sampled tokens.
    Sequences at their length limit after the k-th step finish as `update()` finishes
    them (in batch order, freeing blocks in the same order); their requests are returned.
    `plan`: this state's `steady_decode_plan` (its steps applied so far counted in
    plan.applied), which spares a pass over the running sequences.
    """
    if k <= 0:
        return StepResult(updated=[], finished=[])
    done: list[Sequence] = []                 # at their length limit after the k-th step
    if plan is not None:
        seqs = plan.seqs
        plan.applied += k
        applied = plan.applied
        for seq, left in zip(seqs, plan.lefts):
            tokens = seq.token_ids
            tokens.extend(token_fn(seq, len(tokens), k))
            if left <= applied:
                done.append(seq)
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
    return StepResult(updated=updated, finished=sched.finish_at_length(done, updated, last))


def memory_breakdown(sched: "Scheduler") -> dict[str, int]:
    """KV slots by category now: token_states, reserved, internal_frag, external_frag, free."""
    head: Request | None = sched.waiting.peek() if len(sched.waiting) else None
    return sched.kv.memory_breakdown(sched.running, head)
