"""AsyncEngine: an LLMEngine driven by one background thread, fed from asyncio handlers.

    engine = AsyncEngine(LLMEngine(args)); engine.start()
    stream = await engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # raises on bad input
    async for prompt_index, output in stream:                                  # RequestOutputs
        ...
    engine.abort(stream)       # client gone: the engine thread aborts it and frees its blocks

Threads. Every call into the engine (add_request, abort_request, step) and the scheduler
happens on the engine thread: the core is not thread-safe and needs none. Prompts
arrive tokenized (the HTTP layer tokenizes in worker threads, so neither the event
loop nor the engine thread ever waits on a long prompt).
Handlers (on the asyncio loop) hand work over through two lists guarded by a
`threading.Condition`: `generate` appends an add (a group of engine requests: one per
prompt of a batch) and `abort` appends request ids; both `notify()`. The engine thread
waits on the condition while it has nothing to add, abort or step (no polling when
idle), else loops: take the handed-over adds and aborts, apply them (adds first, so
an abort that races its own add still finds it), run one `step()`, and deliver.

Delivery. Each `RequestStream` owns an `asyncio.Queue` on its handler's loop. After a
step the engine thread groups what it has for each loop (acks, errors, outputs) and
hands the whole batch over with one `loop.call_soon_threadsafe`, so a step that
advances 100 streams costs one cross-thread wake-up, not 100. The first item of a
stream is its ack (prompt token ids) or the exception that refused it, so a handler
can answer 400/503 before it commits to a 200 streaming response.

Abort. A handler's `finally` (stream closed, client disconnected, task cancelled,
--request-timeout passed) calls `abort(stream)` for requests not yet finished; the
engine thread drops the stream, calls `engine.abort_request` (the scheduler frees the
request's KV blocks) and counts it as finished_reason="abort". `abort_all(error)`
(shutdown) aborts everything and hands `error` to every stream.

Faults. If a step raises, the thread records the error, hands EngineDeadError to every
stream and every pending add, and exits; later `generate` calls raise EngineDeadError.
Nothing is dropped silently: each stream ends with an output that finished or an error.

LoopEngine (below) is the same driver without the thread, for the simulated engine whose
steps only wait: iterations run on the event loop and a step's wait is a loop timer.
`make_async_engine` picks one; both share the hand-over, routing and failure code
(`_EngineDriver`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from core import SamplingParams
from realexec.server.errors import EngineDeadError, QueueFullError, RequestTimeoutError
from realexec.server.metrics import EngineStats

if TYPE_CHECKING:
    from realexec.engine.llm_engine import LLMEngine, RequestOutput
    from realexec.server.metrics import ServerMetrics

logger = logging.getLogger("twinserve.server")


_CLOSED = object()                  # RequestStream.close()'s marker in its queue


@dataclass
class _Ack:
    prompt_token_ids: list[list[int]]


@dataclass
class _Sub:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float        # time.monotonic() when the handler handed it over


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per prompt of a batch).

    Iterating yields (prompt index, RequestOutput) until every engine request finished."""

    def __init__(self, request_ids: list[str], loop: asyncio.AbstractEventLoop, timeout: float | None = None):
        self.request_ids = request_ids
        self.loop = loop
        self.deadline = None if timeout is None else loop.time() + timeout
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_token_ids: list[list[int]] = []
        self.unfinished = set(request_ids)
        self.created = time.time()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    async def wait_added(self) -> None:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        self.prompt_token_ids = item.prompt_token_ids

    def __aiter__(self):
        return self._iterate()

    async def _next_item(self):
        if self.deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), max(0.0, self.deadline - self.loop.time()))
        except asyncio.TimeoutError:
            # Still unfinished in the engine: the handler's abort(stream) frees it.
            raise RequestTimeoutError("the request took longer than the server's --request-timeout; "
                                      "it was aborted") from None

    def close(self) -> None:
        """End the iteration now (its client left; abort the requests first): what the
        engine still hands over is not read."""
        self.unfinished.clear()
        self.queue.put_nowait(_CLOSED)

    async def _iterate(self):
        while self.unfinished:
            item = await self._next_item()
            if item is _CLOSED:
                return
            if isinstance(item, BaseException):     # the engine side dropped these requests
                self.unfinished.clear()
                raise item
            index, out = item
            if out.finished:
                self.unfinished.discard(out.request_id)
            yield index, out


class _EngineDriver:
    """What both drivers share: the hand-over lists, the engine-side apply/route/fail and
    the stats snapshot. A subclass decides where the engine runs (`start`, `shutdown`,
    `_wake`) and how a step's outputs reach their loops (`_deliver`)."""

    def __init__(self, engine: "LLMEngine", *, max_waiting_requests: int | None = None,
                 metrics: "ServerMetrics | None" = None):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max-waiting-requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._cond = threading.Condition()
        self._adds: list[tuple[RequestStream, list[_Sub]]] = []
        self._aborts: list[str] = []
        self._abort_all: BaseException | None = None
        self._stopping = False
        self._ids = itertools.count()
        # Engine-side state: request id -> (stream, prompt index).
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        self.error: BaseException | None = None
        # Test hook: called where the engine runs, before every step (raise to inject a fault).
        self.before_step: Callable[[], None] | None = None
        self.stats = EngineStats()
        self._publish_stats()

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def _wake(self) -> None:
        """Called with self._cond held after something was handed over."""
        raise NotImplementedError

    def _deliver(self, deliveries) -> None:
        for loop, items in deliveries.items():
            if not _hand_to(loop, items):           # that loop is closed: nobody will read
                for stream, _ in items:
                    for request_id in stream.request_ids:
                        self._abort(request_id)

    # -- handler side (asyncio loop) -----------------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 10**8}"

    async def generate(self, prompts: list[list[int]], params: SamplingParams, *, priority: int = 0,
                       request_id: str | None = None, timeout: float | None = None) -> RequestStream:
        """Queue one engine request per tokenized prompt; return their stream once the
        engine accepted them all. Raises InvalidRequestError (a bad prompt, too
        long for the context), QueueFullError, EngineDeadError. With `timeout` (seconds
        from now) iterating the stream raises RequestTimeoutError after it."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running" + (f": it failed with {self.error!r}"
                                                                  if self.error else ""))
        base = request_id or self.new_request_id("req")
        ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        now = time.monotonic()          # its arrival: it may wait for the step in flight to end
        subs = [_Sub(rid, p, params, priority, now) for rid, p in zip(ids, prompts)]
        stream = RequestStream(ids, asyncio.get_running_loop(), timeout)
        with self._cond:
            self._adds.append((stream, subs))
            self._wake()
        try:
            await stream.wait_added()
        except asyncio.CancelledError:
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort the stream's unfinished requests (safe to call at any time, any number of times)."""
        ids = list(stream.unfinished)
        stream.unfinished.clear()
        if ids:
            with self._cond:
                self._aborts.extend(ids)
                self._wake()

    def abort_all(self, error: BaseException) -> None:
        """Abort every request (queued adds too) and end each stream with `error`."""
        with self._cond:
            self._abort_all = error
            self._wake()

    # -- engine side ---------------------------------------------------------------------------
    def _has_work(self) -> bool:
        """With self._cond held: whether an iteration has anything to do."""
        return bool(self._adds or self._aborts or self._stopping or self._abort_all) \
            or self.engine.has_unfinished_requests()

    def _iteration(self) -> tuple[dict, bool]:
        """Take what the handlers handed over, apply it (adds first, so an abort that races
        its own add still finds it) and run one step if a request is unfinished -> (what to
        deliver, per loop; whether a step ran)."""
        engine = self.engine
        with self._cond:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            abort_all, self._abort_all = self._abort_all, None
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        if abort_all is not None:
            self._fail(abort_all, adds, abort_engine_requests=True)
            adds = []
        for stream, subs in adds:
            self._add(stream, subs, deliveries)
        for request_id in aborts:
            self._abort(request_id)
        stepped = False
        if engine.has_unfinished_requests() and not engine.is_sleeping:
            if self.before_step is not None:
                self.before_step()
            outputs = engine.step()
            self._route(outputs, deliveries)
            stepped = True
        self._publish_stats()
        return deliveries, stepped

    def _shut_down(self) -> None:
        """The end of the engine's runs: every stream and pending add gets EngineDeadError
        (the error the engine died of, or "the server shut down")."""
        with self._cond:
            adds, self._adds = self._adds, []
        self._fail(EngineDeadError(f"the engine failed: {self.error!r}" if self.error
                                   else "the server shut down"), adds, abort_engine_requests=self.error is None)
        self._publish_stats()

    def _add(self, stream: RequestStream, subs: list[_Sub], deliveries) -> None:
        engine = self.engine
        added: list[str] = []
        try:
            limit = self.max_waiting_requests
            if limit is not None and engine.scheduler.num_waiting + len(subs) > limit:
                raise QueueFullError(
                    f"server busy: {engine.scheduler.num_waiting} requests are waiting "
                    f"(--max-waiting-requests {limit}); retry later")
            prompt_ids = []
            for i, sub in enumerate(subs):
                engine.add_request(sub.prompt_token_ids, sub.params, request_id=sub.request_id,
                                   priority=sub.priority, arrival_time=sub.arrival_time)
                added.append(sub.request_id)
                self._streams[sub.request_id] = (stream, i)
                prompt_ids.append(sub.prompt_token_ids)
        except Exception as e:                      # all or nothing for a batch of prompts
            for request_id in added:
                engine.abort_request(request_id)
                self._streams.pop(request_id, None)
            if not isinstance(e, (ValueError, QueueFullError)):
                logger.exception("add_request failed")
            deliveries.setdefault(stream.loop, []).append((stream, e))
            return
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(p) for p in prompt_ids))
        deliveries.setdefault(stream.loop, []).append((stream, _Ack(prompt_ids)))

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return                                  # finished (or refused) meanwhile
        if self.engine.abort_request(request_id) and self.metrics is not None:
            self.metrics.request_finished_reason("abort")

    def _route(self, outputs: list["RequestOutput"], deliveries) -> None:
        if self.metrics is not None:
            self.metrics.outputs(outputs)
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            stream, index = target
            if out.finished:
                del self._streams[out.request_id]
            deliveries.setdefault(stream.loop, []).append((stream, (index, out)))

    def _fail(self, error: BaseException, adds, abort_engine_requests: bool) -> None:
        """End every stream (and every add not yet applied) with `error`; with
        abort_engine_requests, also abort their engine requests (frees their KV)."""
        deliveries: dict = {}
        for stream, _ in adds:
            deliveries.setdefault(stream.loop, []).append((stream, error))
        seen = set()
        for request_id, (stream, _) in list(self._streams.items()):
            if abort_engine_requests:
                self._abort(request_id)
            if id(stream) not in seen:
                seen.add(id(stream))
                deliveries.setdefault(stream.loop, []).append((stream, error))
        self._streams.clear()
        for loop, items in deliveries.items():
            _hand_to(loop, items)

    def _publish_stats(self) -> None:
        """A snapshot for /metrics, replaced whole (readers on other threads see one or the other)."""
        sched = self.engine.scheduler
        kv = sched.kv.stats()
        self.stats = EngineStats(
            num_requests_running=sched.num_running, num_requests_waiting=sched.num_waiting,
            num_requests_swapped=sched.num_swapped, kv_cache_usage_perc=kv.gpu_usage,
            cpu_cache_usage_perc=kv.num_used_cpu_blocks / kv.num_cpu_blocks if kv.num_cpu_blocks else 0.0,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions, num_gpu_blocks=kv.num_gpu_blocks,
            num_used_gpu_blocks=kv.num_used_gpu_blocks, num_pending=len(self._streams))
        if self.metrics is not None:
            self.metrics.publish(self.stats)


class AsyncEngine(_EngineDriver):
    """The engine on its own thread (see the module docstring)."""

    def __init__(self, engine: "LLMEngine", **kw):
        super().__init__(engine, **kw)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="twinserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _wake(self) -> None:
        self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._has_work():
                        self._cond.wait()
                    if self._stopping:
                        break
                deliveries, stepped = self._iteration()
                if not stepped and self.engine.is_sleeping and self.engine.has_unfinished_requests():
                    time.sleep(0.01)            # queued behind a sleeping engine: wait for wake_up
                self._deliver(deliveries)
        except BaseException as e:        # noqa: BLE001 - report it to every waiting handler
            logger.exception("engine thread died")
            self.error = e
        finally:
            self._shut_down()


def _put_all(items) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _hand_to(loop: asyncio.AbstractEventLoop, items) -> bool:
    """Put `items` on their streams' queues, which live on `loop`: directly on that loop's
    own thread, else through one call_soon_threadsafe. False if the loop is closed."""
    if _running_loop() is loop:
        _put_all(items)
        return True
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:
        return False
    return True


class LoopEngine(_EngineDriver):
    """The engine on the event loop itself, for an executor whose steps only wait (the
    simulated one, `serve --simulate`): an iteration runs on the loop at once, and its
    step's outputs are handed over when the executor's deferred clock says the step ends
    (a loop timer); meanwhile the loop serves HTTP. No engine thread means no thread
    wake-up, no cross-thread hand-off and no GIL switch per step, and the replicas of
    `--replicas N` all run on the one loop. Iterations follow AsyncEngine's: what was
    handed over during a step is applied when it ends, then the next step starts."""

    def __init__(self, engine: "LLMEngine", **kw):
        super().__init__(engine, **kw)
        self.clock = engine.executor.defer_waits()
        engine.core.clock = self.clock.now      # stamps taken after a step's wait: the step's end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None      # the next iteration, when one is scheduled
        self._in_flight: dict | None = None            # a waiting step's deliveries
        self._started = False
        self._stopped = False

    def start(self) -> None:
        self._started = True
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:                # bound by the first request's loop
            pass

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopped and self.error is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop: a step in flight hands its outputs over at once, then every stream still
        open and every pending add ends with EngineDeadError. Callable from any thread."""
        with self._cond:
            self._stopping = True
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running() or _running_loop() is loop:
            self._stop()
            return
        done = threading.Event()
        try:
            loop.call_soon_threadsafe(self._stop, done)
        except RuntimeError:                # closed meanwhile
            self._stop()
            return
        done.wait(timeout)

    def _wake(self) -> None:
        if self._timer is not None or self._stopped or self.error is not None:
            return                          # the next iteration (or a step's end) takes it
        running = _running_loop()
        if self._loop is None or self._loop.is_closed():
            self._loop = running
        if self._loop is None:
            raise RuntimeError("LoopEngine: no event loop to run the engine on")
        if running is self._loop:
            self._timer = self._loop.call_soon(self._run_iteration)
        else:
            self._timer = self._loop.call_soon_threadsafe(self._run_iteration)

    def _run_iteration(self) -> None:
        self._timer = None
        if self._stopping:
            self._stop()
            return
        try:
            deliveries, stepped = self._iteration()
        except BaseException as e:      # noqa: BLE001 - report it to every waiting handler
            logger.exception("engine step failed")
            self.error = e
            self._stop()
            return
        finally:
            self.clock.resume_at(None)
        if stepped:             # hand over at the step's end (at once if that has passed)
            self._in_flight = deliveries
            self._timer = self._loop.call_later(max(0.0, self.clock.due - time.monotonic()), self._step_ended)
            return
        self._deliver(deliveries)
        with self._cond:
            more = self._has_work()
        if not more:
            return                          # idle until a handler hands something over
        if self.engine.is_sleeping and not self._stopping:
            # queued behind a sleeping engine (/sleep): look again in 10 ms, for wake_up
            self._timer = self._loop.call_later(0.01, self._run_iteration)
        else:
            self._timer = self._loop.call_soon(self._run_iteration)

    def _step_ended(self) -> None:
        self._timer = None
        deliveries, self._in_flight = self._in_flight, None
        self._deliver(deliveries)
        with self._cond:
            more = self._has_work()
        if more:
            # The next step starts where this one ended, however late the loop came back
            # to it (HTTP work, other replicas): the deployment's timeline does not drift
            # with this process's load; only the hand-overs are late.
            self.clock.resume_at(self.clock.due)
            self._run_iteration()

    def _stop(self, done: threading.Event | None = None) -> None:
        if not self._stopped:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._in_flight is not None:     # a step was waiting: its outputs first
                deliveries, self._in_flight = self._in_flight, None
                self._deliver(deliveries)
            self._shut_down()
        if done is not None:
            done.set()


def make_async_engine(engine: "LLMEngine", **kw) -> _EngineDriver:
    """The driver for `engine`: LoopEngine when its executor's steps only wait on the wall
    clock (the simulated executor), else AsyncEngine's thread."""
    can_defer = getattr(engine.executor, "can_defer_waits", None)
    return LoopEngine(engine, **kw) if can_defer is not None and can_defer() else AsyncEngine(engine, **kw)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
