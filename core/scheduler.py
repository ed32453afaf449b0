"""Iteration-level (continuous-batching) scheduler over the paged KV cache.

Each `schedule()` builds one step's batch under a token budget and a sequence budget:
  1. running requests, oldest first (decodes and continuing chunked prefills); when the
     pool is short, the victim policy picks a not-yet-scheduled running request to
     preempt (recompute: drop its KV; swap: copy it to the CPU pool);
  2. if nothing was preempted: swapped requests are brought back (FCFS), then waiting
     requests are admitted in queue-policy order, reusing cached prefix blocks.
`update()` applies the sampled tokens: append, fork (n > 1, beam search), stop checks,
finish and free. A step's token accounting is vLLM v1's unified view: a sequence has
`num_tokens` known tokens, `num_computed_tokens` of them in the cache, and a step
computes a slice of the rest; it samples when that slice reaches the end.

The core has no clock: callers pass `now` to stamp metrics.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from core.beam_search import beam_step, finalize_beams
from core.config import CacheConfig, SchedulerConfig
from core.contiguous import ContiguousKVCacheManager
from core.kv_cache_manager import KVCacheManager
from core.policy_api import PolicyBundle
from core.request import Request, RequestStatus, Sequence
from core.step_message import ModelRunnerOutput  # noqa: F401  (the executor's reply; re-exported)

RUNNING = RequestStatus.RUNNING


class ScheduledSeq:
    """One sequence's work in a step: compute tokens [start, start + num_tokens)."""

    __slots__ = ("seq", "start", "num_tokens", "num_samples", "block_table")

    def __init__(self, seq: Sequence, start: int, num_tokens: int, num_samples: int, block_table: list[int]):
        self.seq = seq
        self.start = start
        self.num_tokens = num_tokens
        self.num_samples = num_samples      # 0: mid-prefill chunk, nothing to sample
        self.block_table = block_table      # the manager's live list: read it, never mutate

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def request(self) -> Request:
        return self.seq.request

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens]

    @property
    def context_len(self) -> int:
        """Tokens already in the cache before this step."""
        return self.start

    def __repr__(self) -> str:
        return (f"ScheduledSeq(seq={self.seq.seq_id}, tokens=[{self.start}, {self.start + self.num_tokens}), "
                f"samples={self.num_samples})")


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0          # tokens of slices longer than one token
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)       # (src, dst) on GPU
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    # Requests that left the engine since the previous step (runners drop their state).
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)


@dataclass
class StepResult:
    updated: list[Request]       # requests that produced tokens this step
    finished: list[Request]      # requests that left the engine (finished, aborted, rejected)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, policies: PolicyBundle):
        cache_config.validate()
        config.validate(cache_config)
        self.config = config
        self.cache_config = cache_config
        self.policies = policies
        reservation = getattr(policies, "reservation", None)
        if reservation is None:        # paged allocation (the point of this project)
            self.kv = KVCacheManager(
                cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks,
                enable_prefix_caching=cache_config.enable_prefix_caching,
                evictor=policies.eviction() if cache_config.enable_prefix_caching else None,
                watermark=cache_config.watermark, hash_algo=cache_config.prefix_caching_hash_algo,
            )
        else:                          # a contiguous-reservation baseline (Orca-*)
            self.kv = ContiguousKVCacheManager(cache_config.block_size, cache_config.num_gpu_blocks,
                                               reservation, config.max_model_len)
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
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_steps = 0

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
            return f"prompt needs more KV blocks than the cache can admit"
        return None

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. Call between steps."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self._finish_request(request, RequestStatus.FINISHED_ABORTED)
        self._prune_running()
        return True

    def finish_sequence(self, seq: Sequence, status: RequestStatus, detail: str | None = None) -> None:
        """Finish one sequence from outside (e.g. a stop string found by a detokenizer)."""
        request = seq.request
        if seq.is_finished or request.is_finished:
            return
        seq.finish_reason_detail = detail
        self._finish_seq(seq, status)
        if not request.seqs:
            self._finish_request(request, status)

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

        bs = self.cache_config.block_size
        ref = self.kv.gpu.ref_cnt
        tables = self.kv.tables
        scheduled = out.scheduled
        decodes = 0
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            seqs = request.seqs
            if len(seqs) == 1 and not request.params.beam_width:
                # Fast path: a single-sequence decode that neither needs a new block, nor
                # fills one (nothing to publish), nor writes into a shared block.
                seq = seqs[0]
                c = seq.num_computed_tokens
                if len(seq.token_ids) - c == 1 and c % bs and (c + 1) % bs:
                    table = tables[seq.seq_id]
                    if ref[table[-1]] == 1 and (request._forked or request.params.n == 1):
                        scheduled.append(ScheduledSeq(seq, c, 1, 1, table))
                        seq.num_computed_tokens = c + 1
                        decodes += 1
                        budget -= 1
                        i += 1
                        continue
            plan = self._plan(request, budget)
            if not plan:
                i += 1
                continue
            while not self._allocate(plan):
                victim = self.policies.victim.select(running[i:])
                self._preempt(victim, out, now)
                preempted = True
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
        self.num_steps += 1
        return out

    def _plan(self, request: Request, budget: int) -> list[tuple[Sequence, int]]:
        """Token slices for each live sequence of `request` this step (may be empty)."""
        seqs = request.seqs
        if len(seqs) == 1:                      # the common case, kept lean
            seq = seqs[0]
            pending = len(seq.token_ids) - seq.num_computed_tokens
            if pending == 1:
                return [(seq, 1)]
            n = self._chunk(pending, budget)
            return [(seq, n)] if n else []
        if request.params.use_beam_search:
            return self._plan_beams(seqs, budget)
        plan = []
        for seq in seqs:
            n = self._chunk(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if n:
                plan.append((seq, n))
                budget -= n
        return plan

    def _chunk(self, pending: int, budget: int) -> int:
        cfg = self.config
        n = min(pending, budget)
        if pending > 1 and cfg.long_prefill_token_threshold:
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

    def _allocate(self, plan: list[tuple[Sequence, int]]) -> bool:
        kv = self.kv
        if len(plan) == 1:
            seq, n = plan[0]
            return kv.allocate_slots(seq, n)
        # All or nothing across the group (the per-sequence estimate is conservative).
        if sum(kv.blocks_needed(seq, n) for seq, n in plan) > kv.gpu.num_free:
            return False
        for seq, n in plan:
            ok = kv.allocate_slots(seq, n)
            assert ok, "group allocation failed after a successful capacity check"
        return True

    def _commit(self, request: Request, plan: list[tuple[Sequence, int]], out: SchedulerOutput) -> int:
        """Record the planned slices in the step output and advance computed counts."""
        tables = self.kv.tables
        params = request.params
        scheduled = out.scheduled
        total = 0
        for seq, n in plan:
            start = seq.num_computed_tokens
            end = start + n
            samples = 0
            if end == len(seq.token_ids):
                if params.beam_width:
                    samples = 2 * params.beam_width
                elif params.n > 1 and not request._forked:
                    samples = params.n
                else:
                    samples = 1
            scheduled.append(ScheduledSeq(seq, start, n, samples, tables[seq.seq_id]))
            seq.num_computed_tokens = end
            total += n
            if n > 1:
                out.num_prefill_tokens += n
        out.num_batched_tokens += total
        return total

    def _preempt(self, request: Request, out: SchedulerOutput, now: float) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        request.metrics.num_preemptions += 1
        out.preempted.append(request)
        if self.policies.preemption.mode_for(request) == "swap" and self.kv.can_swap_out(request.seqs):
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
        while self.swapped and budget > 0:
            request = self.swapped[0]
            if not kv.can_swap_in(request.seqs):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(kv.swap_in(request.seqs))
            request.status = RUNNING
            for seq in request.seqs:
                seq.status = RUNNING
            self.running.append(request)
            plan = self._plan(request, budget)
            if plan and self._allocate(plan):
                budget -= self._commit(request, plan, out)
        return budget

    def _admission_plan(self, request: Request, budget: int):
        """(plan, prefix hits per seq id, blocks needed) for admitting `request` now. Sets each
        sequence's num_computed_tokens to its cached prefix; callers that do not admit reset it."""
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
        need = sum(kv.blocks_needed(seq, n, hits[seq.seq_id]) for seq, n in plan)
        return plan, hits, need

    def _admit(self, budget: int, out: SchedulerOutput, now: float) -> None:
        kv, cfg, bs = self.kv, self.config, self.cache_config.block_size
        waiting = self.waiting
        while len(waiting) and budget > 0:
            request = waiting.peek()
            slots = request.params.num_seqs_max
            if self._seq_slots + slots > cfg.max_num_seqs:
                break
            plan, hits, need = self._admission_plan(request, budget)
            if not plan or not kv.can_admit(need):
                for seq in request.seqs:
                    seq.num_computed_tokens = 0
                break
            waiting.pop()
            planned = {seq.seq_id for seq, _ in plan}
            for seq in request.seqs:
                if seq.seq_id not in planned:
                    seq.num_computed_tokens = 0    # no table yet: computes from scratch later
            for seq, n in plan:
                cached = hits[seq.seq_id]
                ok = kv.allocate_slots(seq, n, cached)
                assert ok, "admission allocation failed after a successful capacity check"
                kv.record_prefix_query(len(seq.token_ids), len(cached) * bs)
            for seq in request.seqs:
                seq.status = RUNNING
            request.status = RUNNING
            self._seq_slots += slots
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
        token_ids = result.token_ids
        logprobs = result.logprobs
        top = result.top_logprobs
        updated: list[Request] = []
        beam_batch: dict[int, list[ScheduledSeq]] = {}
        last_request = None
        max_len = self.config.max_model_len
        for s in out.scheduled:
            if not s.num_samples:
                continue
            seq = s.seq
            request = seq.request
            if request.status is not RUNNING or seq.status is not RUNNING:
                continue
            if request.params.beam_width:
                beam_batch.setdefault(id(request), []).append(s)
                continue
            toks = token_ids[seq.seq_id]
            if s.num_samples == 1 and top is None and logprobs is None:
                # Common path: one token, no logprobs; stop checks inline.
                tok = toks[0]
                seq.token_ids.append(tok)
                params = request.params
                num_out = len(seq.token_ids) - seq.num_prompt_tokens
                if (params.max_tokens is not None and num_out >= params.max_tokens) or \
                        (tok == request.eos_token_id and not params.ignore_eos) or \
                        tok in params.stop_token_ids or len(seq.token_ids) >= max_len:
                    status = self.stop_status(seq, tok)
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
        for group in beam_batch.values():
            request = group[0].seq.request
            beam_step(request, group, token_ids, logprobs, self)
            updated.append(request)
        for request in updated:
            m = request.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            m.last_token_time = now
            if not request.seqs and not request.is_finished:
                self._finish_request(request, request.finished_seqs[-1].status)
        self._prune_running()
        finished = self._finished
        for request in finished:
            if request.metrics.finished_time is None:
                request.metrics.finished_time = now
        self._finished = []
        return StepResult(updated=updated, finished=finished)

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
        status = self.stop_status(seq, token)
        if status is not None:
            self._finish_seq(seq, status)

    def stop_status(self, seq: Sequence, token: int) -> RequestStatus | None:
        request = seq.request
        params = request.params
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        if num_out >= params.min_tokens:
            if (token == request.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if (params.max_tokens is not None and num_out >= params.max_tokens) or \
                len(seq.token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- event skipping (used by the simulator) ---------------------------------------------
    def steady_decode_horizon(self) -> int:
        """How many upcoming steps, run one by one, would each schedule exactly one decode
        token for every running sequence with no admission, swap, preemption, copy-on-write
        or finish. 0 when the engine is not in such a steady state. Call between steps.

        Admission during the span is ruled out by checking the queue's head once: with a
        shrinking free pool the head stays inadmissible as long as the cache contents it
        sees do not change. They change in two ways. New entries: assumed harmless (as the
        simulator guarantees, a waiting prompt never contains the tokens running sequences
        are generating). Evictions: they can shorten a waiting request's prefix hits (which
        can lower its block demand) and reorder a cache-aware queue (lpm), so while a
        request waits under prefix caching the span only uses blocks that evict nothing.
        """
        running = self.running
        if not running or self._finished:
            return 0
        cfg, kv, bs = self.config, self.kv, self.cache_config.block_size
        ref = kv.gpu.ref_cnt
        tables = kv.tables
        horizon = cfg.max_model_len
        num_seqs = 0
        for request in running:
            params = request.params
            if params.beam_width or not params.ignore_eos or params.stop_token_ids or \
                    (params.n > 1 and not request._forked):
                return 0
            for seq in request.seqs:
                n = len(seq.token_ids)
                c = seq.num_computed_tokens
                if n - c != 1:
                    return 0
                if c % bs and ref[tables[seq.seq_id][-1]] > 1:
                    return 0                          # the next step copies on write
                left = cfg.max_model_len - n
                if params.max_tokens is not None:
                    left = min(left, params.max_tokens - (n - seq.num_prompt_tokens))
                if left - 1 < horizon:
                    horizon = left - 1                # the step that finishes is run normally
                num_seqs += 1
        if horizon <= 0 or num_seqs > cfg.max_num_batched_tokens:
            return 0
        if self.swapped and kv.can_swap_in(self.swapped[0].seqs):
            return 0
        if not self.swapped and len(self.waiting) and self._admissible(self.waiting.peek(), num_seqs):
            return 0
        # Largest k whose block growth fits the free pool (growth is monotone in k).
        seqs = [seq for r in running for seq in r.seqs]
        free = kv.gpu.num_free
        if kv.enable_prefix_caching and len(self.waiting) and not self.swapped:
            free = kv.gpu.num_uncached_free

        def blocks_for(k: int) -> int:
            return sum(max(0, -(-(s.num_computed_tokens + k) // bs) - len(tables[s.seq_id])) for s in seqs)

        if blocks_for(horizon) <= free:
            return horizon
        lo, hi = 0, horizon                           # blocks_for(lo) fits, blocks_for(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if blocks_for(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def _admissible(self, request: Request, num_running_seqs: int) -> bool:
        """Would the next schedule() admit `request` (given the running batch)? No side effects
        beyond caching block hashes."""
        cfg, kv, bs = self.config, self.kv, self.cache_config.block_size
        if self._seq_slots + request.params.num_seqs_max > cfg.max_num_seqs:
            return False
        left = cfg.max_num_batched_tokens - num_running_seqs
        if left <= 0:
            return False
        plan, _, need = self._admission_plan(request, left)
        for seq in request.seqs:
            seq.num_computed_tokens = 0
        return bool(plan) and kv.can_admit(need)

    def memory_breakdown(self) -> dict[str, int]:
        """KV slots by category now: token_states, reserved, internal_frag, external_frag, free."""
        head = self.waiting.peek() if len(self.waiting) else None
        return self.kv.memory_breakdown(self.running, head)

    def steady_decode_shape(self) -> tuple[int, int]:
        """(num_seqs, sum of cached tokens) of the next steady decode step."""
        num, ctx = 0, 0
        for request in self.running:
            for seq in request.seqs:
                num += 1
                ctx += seq.num_computed_tokens
        return num, ctx

    def fast_forward(self, k: int, step_end_times: list[float],
                     token_fn: Callable[[Sequence, int, int], list[int]]) -> StepResult:
        """Apply k steady decode steps at once (k <= steady_decode_horizon()).

        Blocks are allocated and published in exactly the order k single steps would use
        (step by step, running order), so eviction and cache state match; per-token work
        is a list extend. token_fn(seq, first_position, count) gives the sampled tokens.
        """
        if k <= 0:
            return StepResult(updated=[], finished=[])
        kv, bs = self.kv, self.cache_config.block_size
        gpu, tables = kv.gpu, kv.tables
        caching = kv.enable_prefix_caching
        seqs = [seq for r in self.running for seq in r.seqs]
        # Step j computes position c + j of each sequence: it needs a new block when that
        # position starts one, and publishes a block when c + j + 1 fills one.
        events: list[list[tuple[Sequence, bool]]] = [[] for _ in range(bs)]
        for seq in seqs:
            c = seq.num_computed_tokens
            events[(-c) % bs].append((seq, True))
            if caching:
                events[(-c - 1) % bs].append((seq, False))
        if caching:
            order = {seq.seq_id: i for i, seq in enumerate(seqs)}
            for ev in events:
                ev.sort(key=lambda e: order[e[0].seq_id])
        for seq in seqs:
            n = len(seq.token_ids)
            seq.token_ids.extend(token_fn(seq, n, k))
        registered = kv._num_registered
        if not caching:
            # Only allocations: one bulk allocate per step hands out the same ids, in the
            # same order, as the per-sequence allocations of a single step.
            for j in range(k):
                needy = [tables[seq.seq_id] for seq, _ in events[j % bs]
                         if len(tables[seq.seq_id]) * bs <= seq.num_computed_tokens + j]
                if needy:
                    for table, block in zip(needy, gpu.allocate(len(needy))):
                        table.append(block)
            k_done = k
        else:
            k_done = 0
        for j in range(k_done, k):
            for seq, is_alloc in events[j % bs]:
                table = tables[seq.seq_id]
                if is_alloc:
                    if len(table) * bs <= seq.num_computed_tokens + j:   # reservations may cover it
                        table.extend(gpu.allocate(1))
                else:
                    full = (seq.num_computed_tokens + j + 1) // bs
                    hashes = kv._extend_hashes(seq, full)
                    for i in range(registered[seq.seq_id], full):
                        gpu.register(table[i], hashes[i])
                    registered[seq.seq_id] = full
        for seq in seqs:
            seq.num_computed_tokens += k
        times = step_end_times[:k]
        last = times[-1]
        for request in self.running:
            m = request.metrics
            if m.first_token_time is None:        # the span's first step ended a prefill
                m.first_token_time = times[0]
            m.token_times.extend(times)
            m.last_token_time = last
        self.num_steps += k
        return StepResult(updated=list(self.running), finished=[])
