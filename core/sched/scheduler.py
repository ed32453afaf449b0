"""Iteration-level (continuous-batching) scheduler over a KV memory manager.

Each `schedule()` builds one step's batch under a token budget and a sequence budget:
  1. running requests, oldest first (decodes and continuing chunked prefills); when the
     pool is short, the victim policy picks a not-yet-scheduled running request to
     preempt (recompute: drop its KV; swap: copy it to the CPU pool); under rules with
     `victim_from_whole_running` (vllm-v1) any running request, a scheduled one giving
     its slice back;
  2. if nothing was preempted (nor waits for a victim in flight): swapped requests are
     brought back (FCFS), then waiting requests are admitted in queue-policy order,
     reusing cached prefix blocks.
`update()` applies the sampled tokens: append, fork (n > 1, beam search), stop checks,
finish and free.

Batches in flight (pipeline parallelism): `schedule()` may be called again before the
earlier outputs were `update()`d; `update()` then takes them oldest first (FIFO). A
request in a batch not yet updated is *in flight*: it is not scheduled again, never a
preemption victim (a request whose victim would be one waits for that batch instead),
and its blocks are never freed (an abort or an outside finish of it waits until its
batch is updated). Budgets apply per batch; running sequence slots are
`pipeline_parallel_size` x max_num_seqs so that every batch can be full. With one batch
at a time nothing is ever in flight at `schedule()` and this costs nothing.

Async scheduling (`SchedulerConfig.async_scheduling`, one stage, up to 2 batches in
flight): step N+1 is scheduled while step N computes, so the host's scheduling, input
building and output processing hide behind the device's work. A request in flight whose
slice in N samples may then be scheduled again: its next decode computes the token N
samples, which the scheduler does not know yet (a placeholder: the slice reaches one
past the known tokens, and the workers fill in the token they sampled). It is not, when
N's token will end it by length, when an abort or a stop string waits for N to land, for
beam search, and for an n > 1 request before it forked. A token N+1 computes after
N's token ended the sequence (EOS, a stop token) is dropped. A request in flight may
also be preempted, always by recompute: its blocks are freed while N still writes
them, which is safe because workers run steps in order (a later step that reuses a
block writes it after N did); N's token for it is kept when N lands (as vLLM's
AsyncScheduler delivers it) and recomputed with the rest on readmission. These rules take
vLLM 0.32's AsyncScheduler decisions step for step (tests/core/sched/test_vllm_v1.py).

A step's token accounting is vLLM v1's unified view: a sequence has `num_tokens` known
tokens, `num_computed_tokens` of them in the cache, and a step computes a slice of the
rest; it samples when that slice reaches the end.

The core has no clock: callers pass `now` to stamp metrics.

Around it: the step's value types in `core.outputs` (re-exported here), the one stop
check in `core.sched.stop`, beam search as a pure planner in `core.beam_search` (this module
applies its plans), the KV manager behind `core.kv.kv_interface.KVManager` (built by the
allocation policy), and the simulator's event skipping in `core.sched.event_skipping`.
"""
from __future__ import annotations

from collections import deque

from core.beam_search import BeamPlan, finalize_beams, plan_beam_step
from core.config import CacheConfig, SchedulerConfig
from core.kv.kv_interface import KVManager
from core.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput, StepResult
from core.sched.policy_api import PolicyBundle
from core.sched.request import Request, RequestStatus, Sequence
from core.sched.stop import stop_status

__all__ = ["Scheduler", "ScheduledSeq", "SchedulerOutput", "ModelRunnerOutput", "StepResult"]

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING


class _Batch:
    """A scheduled output not yet updated, and (computed when first asked) its requests."""

    __slots__ = ("out", "_requests")

    def __init__(self, out: SchedulerOutput):
        self.out = out
        self._requests: set[Request] | None = None

    @property
    def requests(self) -> set[Request]:
        if self._requests is None:
            self._requests = {s.seq.request for s in self.out.scheduled}
        return self._requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, policies: PolicyBundle):
        cache_config.validate()
        config.validate(cache_config)
        self.config = config
        self.cache_config = cache_config
        self.policies = policies
        self.kv: KVManager = policies.make_kv_manager(cache_config, config.max_model_len)
        self.waiting = policies.queue.make_queue()
        if hasattr(self.waiting, "bind"):
            self.waiting.bind(self.kv)          # cache-aware orders (lpm) look up prefixes
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._seq_slots = 0                  # sequence slots held by running + swapped requests
        self._finished: list[Request] = []   # left the engine since the last update
        self._finished_ids: list[str] = []   # ... since the last schedule
        self._running_dirty = False
        self._slot_limit = config.max_num_seqs * config.pipeline_parallel_size
        self._no_flight: set[Request] | None = set() if config.pipeline_parallel_size > 1 else None
        self._in_flight: deque[_Batch] = deque()   # scheduled, not yet updated; oldest first
        # Aborts (None) and outside finishes (seq, status, detail) of in-flight requests,
        # applied when their batch is updated.
        self._deferred: dict[Request, list[tuple[Sequence, RequestStatus, str | None] | None]] = {}
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_steps = 0
        rules = getattr(policies, "rules", None)      # engine-wide rules (policy_api.SchedulingRules)
        self._cap_needs_company = bool(rules is not None and rules.long_prefill_cap_needs_company)
        self._reserve_full = bool(rules is not None and rules.admission_reserves_full_sequence)
        self._victim_anywhere = bool(rules is not None and getattr(rules, "victim_from_whole_running", False))
        self._async = config.async_scheduling

    # -- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> Request:
        """Queue a request, or reject it at once (with a reason) if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        request.arrival_index = self._arrivals
        self._arrivals += 1
        reason = self._never_fits(request)
        if reason is not None:
            request.reject_reason = reason
            self._finish_request(request, RequestStatus.FINISHED_REJECTED)
            return request
        self.requests[request.request_id] = request
        request.metrics._queued_since = request.arrival_time
        self.waiting.add(request)
        return request

    def _never_fits(self, request: Request) -> str | None:
        cfg, bs = self.config, self.cache_config.block_size
        prompt_len = request.num_prompt_tokens
        if prompt_len >= cfg.max_model_len:
            return (f"prompt has {prompt_len} tokens; max_model_len is {cfg.max_model_len} "
                    f"(prompt + at least one output token must fit)")
        slots = request.params.num_seqs_max
        if slots > cfg.max_num_seqs:
            return f"request needs {slots} sequences; max_num_seqs is {cfg.max_num_seqs}"
        worst = self.kv.worst_case_blocks(request, cfg.max_model_len)
        if worst > self.cache_config.num_gpu_blocks:
            return (f"its {slots} sequence(s) may need up to {worst} KV blocks; "
                    f"the cache has {self.cache_config.num_gpu_blocks}")
        if -(-prompt_len // bs) > self.cache_config.num_gpu_blocks - self.kv.watermark_blocks:
            return "prompt needs more KV blocks than the cache can admit"
        return None

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. Call between steps. In flight:
        it stops when its batch is updated (its blocks stay until then); True either way."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        if self._in_flight and self._is_in_flight(request):
            actions = self._deferred.setdefault(request, [])
            finishing = {action[0].seq_id for action in actions if action is not None}
            if None in actions or all(seq.seq_id in finishing for seq in request.seqs):
                return False                      # already aborting, or finishing (as if done)
            actions.append(None)
            return True
        self._leave(request, RequestStatus.FINISHED_ABORTED)
        self._prune_running()
        return True

    def _leave(self, request: Request, status: RequestStatus) -> None:
        """Finish `request` wherever it is: out of the waiting or swapped queue, or running
        (the running list is pruned by the caller: once per step in update())."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self._finish_request(request, status)

    def finish_sequence(self, seq: Sequence, status: RequestStatus, detail: str | None = None) -> None:
        """Finish one sequence from outside (e.g. a stop string found by a detokenizer)."""
        request = seq.request
        if seq.is_finished or request.is_finished:
            return
        if self._in_flight and self._is_in_flight(request):
            actions = self._deferred.setdefault(request, [])
            if None not in actions:               # (an abort already ends it)
                actions.append((seq, status, detail))
            return
        seq.finish_reason_detail = detail
        self._finish_seq(seq, status)
        if not request.seqs:
            # (a request preempted while in flight may be back in the queue when this applies)
            self._leave(request, status)
            self._prune_running()

    def _finish_seq(self, seq: Sequence, status: RequestStatus) -> None:
        seq.status = status
        self.kv.free(seq)
        request = seq.request
        request.seqs.remove(seq)
        request.finished_seqs.append(seq)

    def _finish_request(self, request: Request, status: RequestStatus) -> None:
        was_holding_slots = request.status in (RequestStatus.RUNNING, RequestStatus.SWAPPED)
        for seq in list(request.seqs):
            self._finish_seq(seq, status)
        if request.params.use_beam_search:
            finalize_beams(request)
        self.kv.release_request(request)
        if was_holding_slots:
            self._seq_slots -= request.params.num_seqs_max
            if request.status is RUNNING:
                self._running_dirty = True
        request.status = status
        self.requests.pop(request.request_id, None)
        self._finished.append(request)
        self._finished_ids.append(request.request_id)

    # -- queries -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_unreported_finishes(self) -> bool:
        """Requests left the engine (e.g. aborted) that no `update()` has reported yet."""
        return bool(self._finished)

    @property
    def num_in_flight(self) -> int:
        """Batches scheduled and not yet updated."""
        return len(self._in_flight)

    def _is_in_flight(self, request: Request) -> bool:
        return any(request in batch.requests for batch in self._in_flight)

    def _in_flight_requests(self) -> set[Request]:
        batches = self._in_flight
        if len(batches) == 1:
            return batches[0].requests
        return set().union(*(batch.requests for batch in batches))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # -- scheduling ----------------------------------------------------------------------
    def _prune_running(self) -> None:
        if self._running_dirty:
            self.running = [r for r in self.running if r.status is RUNNING]
            self._running_dirty = False

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        self._prune_running()
        out = SchedulerOutput()
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        budget = self.config.max_num_batched_tokens
        running = self.running
        preempted = False
        # Requests in flight are skipped, and with P > 1 a batch takes at most max_num_seqs of
        # the P * max_num_seqs running slots. With P = 1 and one batch at a time neither
        # check can bind, and the loop skips both (None).
        in_flight = self._in_flight_requests() if self._in_flight else self._no_flight
        overlap = self._async and in_flight is not None      # may requests in flight run again?
        seats = self.config.max_num_seqs        # sequences this batch may still take

        decode_table = self.kv.decode_table
        scheduled = out.scheduled
        decodes = 0
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            seqs = request.seqs
            ahead = False           # in flight, and scheduled again (async scheduling)
            if in_flight is not None:
                if request in in_flight:
                    if not (overlap and self._may_overlap(request)):
                        i += 1
                        continue
                    ahead = True
                if len(seqs) > seats - len(scheduled):
                    i += 1
                    continue
            params = request.params
            if len(seqs) == 1 and not params.beam_width:
                # Fast path: a single-sequence decode that the manager can take as is.
                seq = seqs[0]
                c = seq.num_computed_tokens
                pending = len(seq.token_ids) - c
                if (pending == 1 or (ahead and pending == 0)) and (params.n == 1 or request._forked):
                    table = decode_table(seq)
                    if table is not None:
                        scheduled.append(ScheduledSeq(seq, c, 1, 1, table))
                        seq.num_computed_tokens = c + 1
                        decodes += 1
                        budget -= 1
                        i += 1
                        continue
            plan = self._plan(request, budget, ahead)
            if not plan:
                i += 1
                continue
            while not self.kv.allocate_group(plan):
                if self._victim_anywhere and (in_flight is None or overlap):
                    # vLLM v1 (priority): any running request, even one already scheduled
                    # this step (it gives its slice back)
                    victim = self.policies.victim.select(running)
                    at = running.index(victim)
                    if at < i:
                        budget += self._unschedule(victim, out)
                        i -= 1
                else:
                    victim = self.policies.victim.select(running[i:])
                preempted = True                # (either way: no admissions while a request lacks blocks)
                victim_flies = in_flight is not None and victim in in_flight
                if victim_flies and not overlap:
                    # The policy's victim is in flight: wait for its batch to land rather than
                    # preempt another in its place (two requests alternating in flight would
                    # otherwise keep preempting themselves: a livelock).
                    i += 1
                    break
                self._preempt(victim, out, now, recompute=victim_flies)
                if victim is request:
                    break
            else:
                budget -= self._commit(request, plan, out)
                i += 1

        out.num_batched_tokens += decodes
        if not preempted:
            budget = self._swap_in(budget, out, now)
            if not self.swapped:
                self._admit(budget, out, now)

        out.blocks_to_copy = self.kv.drain_copies()
        if self._in_flight and out.is_empty:
            # Nothing new can run until an in-flight batch returns: this is no batch (the
            # caller neither executes nor updates it); its finished ids go with the next one.
            self._finished_ids = out.finished_request_ids + self._finished_ids
            out.finished_request_ids = []
            return out
        self._in_flight.append(_Batch(out))
        self.num_steps += 1
        return out

    def _may_overlap(self, request: Request) -> bool:
        """May `request`, in flight, be scheduled again before its batch lands?"""
        params = request.params
        if params.beam_width or (params.n > 1 and not request._forked) or request in self._deferred:
            return False
        max_len = self.config.max_model_len
        for seq in request.seqs:
            n = len(seq.token_ids)
            if n == seq.num_computed_tokens and stop_status(params, None, None, n + 1 - seq.num_prompt_tokens,
                                                            n + 1, max_len) is not None:
                return False                    # the token in flight is its last
        return True

    def _plan(self, request: Request, budget: int, ahead: bool = False) -> list[tuple[Sequence, int]]:
        """Token slices for each live sequence of `request` this step (may be empty).
        `ahead`: the request is in flight; a sequence whose every known token is computed
        decodes the token its batch in flight samples (async scheduling)."""
        seqs = request.seqs
        if len(seqs) == 1:                      # the common case, kept lean
            seq = seqs[0]
            pending = len(seq.token_ids) - seq.num_computed_tokens
            if pending == 1 or (ahead and pending == 0):
                return [(seq, 1)]
            n = self._chunk(pending, budget)
            return [(seq, n)] if n else []
        if request.params.use_beam_search:
            return self._plan_beams(seqs, budget)
        plan = []
        for seq in seqs:
            pending = len(seq.token_ids) - seq.num_computed_tokens
            n = self._chunk(1 if ahead and pending == 0 else pending, budget)
            if n:
                plan.append((seq, n))
                budget -= n
        return plan

    def _chunk(self, pending: int, budget: int) -> int:
        cfg = self.config
        n = min(pending, budget)
        if pending > 1 and cfg.long_prefill_token_threshold and not (
                self._cap_needs_company and len(self.running) + len(self.waiting) <= 1):
            # (running + waiting is the same all step: preemption and admission only move
            # requests between the two; so this equals a count taken when the step starts)
            n = min(n, cfg.long_prefill_token_threshold)
        if n < pending and not cfg.enable_chunked_prefill:
            return 0
        return n

    @staticmethod
    def _plan_beams(seqs: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Beams must sample in lock-step: either every beam reaches its end this step, or
        none does (after a recompute, beams catch up with slices that stop one short)."""
        pendings = [len(s.token_ids) - s.num_computed_tokens for s in seqs]
        if sum(pendings) <= budget:
            return list(zip(seqs, pendings))
        plan = []
        for seq, pending in zip(seqs, pendings):
            n = min(pending - 1, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        return plan

    def _commit(self, request: Request, plan: list[tuple[Sequence, int]], out: SchedulerOutput) -> int:
        """Record the planned slices in the step output and advance computed counts."""
        block_table = self.kv.block_table
        params = request.params
        scheduled = out.scheduled
        total = 0
        for seq, n in plan:
            start = seq.num_computed_tokens
            end = start + n
            samples = 0
            if end >= len(seq.token_ids):       # (one past them: a placeholder's decode)
                if params.beam_width:
                    samples = 2 * params.beam_width
                elif params.n > 1 and not request._forked:
                    samples = params.n
                else:
                    samples = 1
            scheduled.append(ScheduledSeq(seq, start, n, samples, block_table(seq)))
            seq.num_computed_tokens = end
            total += n
            if n > 1:
                out.num_prefill_tokens += n
        out.num_batched_tokens += total
        return total

    def _unschedule(self, request: Request, out: SchedulerOutput) -> int:
        """Take `request`'s slices out of this step's batch (it is about to be preempted);
        returns the tokens they had taken from the budget."""
        kept, freed = [], 0
        retract = getattr(self.kv, "retract", None)
        for s in out.scheduled:
            if s.seq.request is request:
                s.seq.num_computed_tokens = s.start
                if retract is not None:
                    retract(s.seq)      # blocks published for the slice were never computed
                freed += s.num_tokens
                if s.num_tokens > 1:
                    out.num_prefill_tokens -= s.num_tokens
            else:
                kept.append(s)
        out.scheduled[:] = kept
        # (schedule() adds its fast-path decodes at the end: the total comes out right)
        out.num_batched_tokens -= freed
        return freed

    def _preempt(self, request: Request, out: SchedulerOutput, now: float, recompute: bool = False) -> None:
        """`recompute`: whatever the policy says (a request in flight: its KV is still being
        written; the token its batch samples is kept when the batch lands)."""
        self.running.remove(request)
        self.num_preemptions += 1
        request.metrics.num_preemptions += 1
        out.preempted.append(request)
        if not recompute and self.policies.preemption.mode_for(request) == "swap" \
                and self.kv.can_swap_out(request.seqs):
            out.blocks_to_swap_out.extend(self.kv.swap_out(request.seqs))
            request.status = RequestStatus.SWAPPED
            for seq in request.seqs:
                seq.status = RequestStatus.SWAPPED
            request.metrics.num_swaps += 1
            self.num_swaps += 1
            self.swapped.append(request)
            return
        # Recompute: drop the KV; tokens (prompt + generated so far) stay and are
        # prefilled again on readmission, where the prefix cache may serve some of them.
        request.status = RequestStatus.WAITING
        for seq in request.seqs:
            seq.status = RequestStatus.WAITING
            self.kv.free(seq)
            seq.num_computed_tokens = 0
        self.kv.release_request(request)
        self._seq_slots -= request.params.num_seqs_max
        request.metrics._queued_since = now    # back in the queue: counts toward queue_time
        self.waiting.add_preempted(request)

    def _swap_in(self, budget: int, out: SchedulerOutput, now: float) -> int:
        kv = self.kv
        seats = self.config.max_num_seqs
        while self.swapped and budget > 0:
            request = self.swapped[0]
            if len(out.scheduled) + len(request.seqs) > seats:
                break
            if not kv.can_swap_in(request.seqs, keep_watermark=bool(self.running)):   # idle: see _try_admission
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(kv.swap_in(request.seqs))
            request.status = RUNNING
            for seq in request.seqs:
                seq.status = RUNNING
            self.running.append(request)
            plan = self._plan(request, budget)
            if plan and self.kv.allocate_group(plan):
                budget -= self._commit(request, plan, out)
        return budget

    def _admission_plan(self, request: Request, budget: int):
        """(plan, prefix hits per seq id) for admitting `request` now. Sets each sequence's
        num_computed_tokens to its cached prefix; callers that do not admit reset it."""
        kv, bs = self.kv, self.cache_config.block_size
        hits = {}
        for seq in request.seqs:        # several after a multi-sequence recompute
            cached = kv.find_cached_prefix(seq)
            seq.num_computed_tokens = len(cached) * bs
            hits[seq.seq_id] = cached
        if request.params.use_beam_search:
            plan = self._plan_beams(request.seqs, budget)
        else:
            plan, left = [], budget
            for seq in request.seqs:
                n = self._chunk(len(seq.token_ids) - seq.num_computed_tokens, left)
                if n == 0:
                    break
                plan.append((seq, n))
                left -= n
        return plan, hits

    def _try_admission(self, request: Request, budget: int):
        """(plan, hits) if the next admission of `request` fits now, else None (and the
        request's sequences are left as they were: nothing computed)."""
        if self._seq_slots + request.params.num_seqs_max > self._slot_limit:
            return None
        plan, hits = self._admission_plan(request, budget)
        # The watermark keeps room for running sequences to grow; an idle engine has none to
        # protect, and keeping it then could strand a request that fits the pool (liveness).
        idle = not self.running and not self.swapped
        if self._reserve_full:
            # The check counts every known token past the prefix hits; the step still
            # allocates only the planned chunk.
            check = [(seq, len(seq.token_ids) - seq.num_computed_tokens, hits[seq.seq_id]) for seq, _ in plan]
        else:
            check = [(seq, n, hits[seq.seq_id]) for seq, n in plan]
        if plan and self.kv.can_admit(check, keep_watermark=not idle):
            return plan, hits
        for seq in request.seqs:
            seq.num_computed_tokens = 0
        return None

    def admits_next(self, token_budget: int) -> bool:
        """Would admission now take the waiting queue's head, with `token_budget` tokens
        left in the step? No side effects beyond caching block hashes."""
        if not len(self.waiting) or token_budget <= 0:
            return False
        request = self.waiting.peek()
        if self._try_admission(request, token_budget) is None:
            return False
        for seq in request.seqs:
            seq.num_computed_tokens = 0
        return True

    def _admit(self, budget: int, out: SchedulerOutput, now: float, seated: int = 0) -> None:
        """Admit waiting requests in queue order while they fit the budgets; `seated`: the
        step's sequences not in `out.scheduled` (core.sched.event_skipping's steady step)."""
        kv, bs = self.kv, self.cache_config.block_size
        waiting = self.waiting
        seats = self.config.max_num_seqs - seated
        # (Async scheduling: a request preempted while its batch flew is never readmitted before
        # that batch lands and delivers its token, which vLLM's scheduler has to check for:
        # a step that preempts admits nothing, and by the next one that batch has landed.)
        while len(waiting) and budget > 0:
            request = waiting.peek()
            if len(out.scheduled) + len(request.seqs) > seats:
                break
            admission = self._try_admission(request, budget)
            if admission is None:
                break
            plan, hits = admission
            waiting.pop()
            planned = {seq.seq_id for seq, _ in plan}
            for seq in request.seqs:
                if seq.seq_id not in planned:
                    seq.num_computed_tokens = 0    # no table yet: computes from scratch later
            # Every sequence's hits are claimed before any fresh block is taken: a fresh
            # block may be a cached one evicted, never one a later sequence of the group hits.
            for seq, _ in plan:
                kv.claim_prefix(seq, hits[seq.seq_id])
            for seq, n in plan:
                ok = kv.allocate_slots(seq, n)
                assert ok, "admission allocation failed after a successful capacity check"
                kv.record_prefix_query(len(seq.token_ids), len(hits[seq.seq_id]) * bs)
            for seq in request.seqs:
                seq.status = RUNNING
            request.status = RUNNING
            self._seq_slots += request.params.num_seqs_max
            self.running.append(request)
            out.admitted.append(request)
            m = request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_prompt_tokens = len(hits[request.seqs[0].seq_id]) * bs
            if m._queued_since is not None:
                m.queue_time += max(0.0, now - m._queued_since)
            m._queued_since = None
            budget -= self._commit(request, plan, out)

    # -- applying a step's results ---------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput, now: float = 0.0) -> StepResult:
        if self._in_flight:
            self._land(out)
        token_ids = result.token_ids
        logprobs = result.logprobs
        top = result.top_logprobs
        updated: list[Request] = []
        beam_batch: dict[int, list[Sequence]] = {}
        last_request = None
        max_len = self.config.max_model_len
        no_logprobs = top is None and logprobs is None
        for s in out.scheduled:
            num_samples = s.num_samples
            if not num_samples:
                continue
            seq = s.seq
            request = seq.request
            if (request.status is not RUNNING or seq.status is not RUNNING) and not (
                    self._async and request.status is WAITING and seq.status is WAITING and num_samples == 1
                    and not request.params.beam_width):
                # (async scheduling keeps the token of a request preempted while this batch
                # flew, as vLLM does: it is recomputed with it when readmitted)
                continue
            params = request.params
            if params.beam_width:
                beam_batch.setdefault(id(request), []).append(seq)
                continue
            toks = token_ids[seq.seq_id]
            if no_logprobs and num_samples == 1:
                # Common path: one token, no logprobs.
                tok = toks[0]
                tokens = seq.token_ids
                tokens.append(tok)
                n = len(tokens)
                status = stop_status(params, request.eos_token_id, tok, n - seq.num_prompt_tokens, n, max_len)
                if status is not None:
                    self._finish_seq(seq, status)
                if request is not last_request:
                    updated.append(request)
                    last_request = request
                continue
            lps = logprobs.get(seq.seq_id) if logprobs is not None else None
            tops = top.get(seq.seq_id) if top is not None else None
            if s.num_samples > 1:
                # Parallel sampling: the prompt's sequence forks one child per extra sample;
                # all share the prompt's blocks (the last, partial one is copied on write).
                request._forked = True
                children = []
                for _ in range(len(toks) - 1):
                    child = seq.fork()
                    self.kv.fork(seq, child)
                    children.append(child)
                request.seqs.extend(children)
                for k, child in enumerate(children, start=1):
                    self._append(child, toks[k], lps[k] if lps else None, tops[k] if tops else None)
            self._append(seq, toks[0], lps[0] if lps else None, tops[0] if tops else None)
            if request is not last_request:
                updated.append(request)
                last_request = request
        for beams in beam_batch.values():
            request = beams[0].request
            self._apply_beam_plan(request, plan_beam_step(request, beams, token_ids, logprobs, max_len))
            updated.append(request)
        for request in updated:
            m = request.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            m.last_token_time = now
            if not request.seqs and not request.is_finished:
                # (running, or waiting: a token kept for a request preempted in flight ended it)
                self._leave(request, request.finished_seqs[-1].status)
        return StepResult(updated=updated, finished=self._end_step(now))

    def _land(self, out: SchedulerOutput) -> None:
        """`out` comes back: its requests leave flight (the oldest batch first, FIFO), and
        aborts and finishes deferred while they flew apply now, before its tokens."""
        batch = self._in_flight[0]
        if batch.out is not out:
            if out.is_empty and not any(b.out is out for b in self._in_flight):
                return                  # an empty output schedule() did not count as a batch
            raise RuntimeError("update() must take scheduled outputs in the order schedule() returned them "
                               f"(oldest first); {len(self._in_flight)} batch(es) in flight")
        self._in_flight.popleft()
        if self._deferred:
            for request in batch.requests:
                actions = self._deferred.pop(request, None)
                for action in actions or ():
                    if request.is_finished:
                        break
                    if action is None:
                        self._leave(request, RequestStatus.FINISHED_ABORTED)
                    else:
                        self.finish_sequence(*action)

    def finish_at_length(self, seqs: list[Sequence], now: float) -> list[Request]:
        """The end of a skipped decode span (core.sched.event_skipping) whose last step brought
        `seqs` (in batch order) to their length limit: finish them as `update()` would, then
        every request they leave without a live sequence; returns the requests that left."""
        for seq in seqs:
            self._finish_seq(seq, RequestStatus.FINISHED_LENGTH)
        # Only the requests of `seqs` can be left without a live sequence; they come in
        # batch order, as in `updated`.
        last = None
        for seq in seqs:
            request = seq.request
            if request is not last and not request.seqs and not request.is_finished:
                self._finish_request(request, request.finished_seqs[-1].status)
            last = request
        return self._end_step(now)

    def _end_step(self, now: float) -> list[Request]:
        """Requests that left the engine during this step, stamped `now`."""
        self._prune_running()
        finished, self._finished = self._finished, []
        for request in finished:
            if request.metrics.finished_time is None:
                request.metrics.finished_time = now
        return finished

    def _append(self, seq: Sequence, token: int, logprob: float | None, top: dict | None) -> None:
        """Append one sampled token and finish the sequence if a stop condition holds."""
        seq.token_ids.append(token)
        if logprob is not None:
            seq.cum_logprob += logprob
        request = seq.request
        params = request.params
        if params.logprobs is not None and top is not None:
            if seq.output_logprobs is None:
                seq.output_logprobs = []
            seq.output_logprobs.append(top)
        n = len(seq.token_ids)
        status = stop_status(params, request.eos_token_id, token, n - seq.num_prompt_tokens, n,
                             self.config.max_model_len)
        if status is not None:
            self._finish_seq(seq, status)

    def _apply_beam_plan(self, request: Request, plan: BeamPlan) -> None:
        request.finished_seqs.extend(plan.hypotheses)
        request._forked = True
        kv = self.kv
        children = plan.extensions
        for seq in list(request.seqs):
            if seq.seq_id not in children:
                kv.free(seq)                       # pruned beam: its private blocks go back first
                request.seqs.remove(seq)
        for seq in list(request.seqs):
            kids = children[seq.seq_id]
            for tok, lp in kids[1:]:
                child = seq.fork()
                kv.fork(seq, child)
                child.token_ids.append(tok)
                child.cum_logprob += lp
                request.seqs.append(child)
            tok, lp = kids[0]
            seq.token_ids.append(tok)
            seq.cum_logprob += lp
        if plan.finish_live is not None:
            for seq in list(request.seqs):
                self._finish_seq(seq, plan.finish_live)
        elif plan.drop_live:
            for seq in request.seqs:               # cannot win: drop without adding hypotheses
                kv.free(seq)
            request.seqs.clear()
