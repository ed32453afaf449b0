"""StepRecorder: watches a running LLMEngine and records each executed step.

    with StepRecorder(engine, "results/steps.jsonl"):      # --step-log PATH on generate / serve / bench
        ...run requests...

It hooks three calls of one engine instance (restored on close): `core.add_request`
(arrivals), `executor.execute_model` (the step's decision, read from the SchedulerOutput
before the executor builds its step message, and the executor's wall time) and
`LLMEngine._step` (the whole step's wall time, detokenization included). Records follow
`core.cost.step_log`; `records` keeps the step records in memory too (`realexec profile`
reads them). Each step also carries where its wall time went on the stepping thread:
`cpu_s` (the thread ran; `execute_cpu_s` of it inside the executor) and `runq_s` (it
was runnable but another process or thread had the core); the rest of `step_s` it was
blocked (the GIL, locks, I/O, a worker process or actor computing) or, in a VM, its
virtual CPU was not running (steal). `gc_s`: seconds of Python's garbage collector
during the step (any thread's; it holds the GIL). `runq_s` comes
from Linux schedstat (absent elsewhere). With
`worker_timings`, each step also carries the worker's input-preparation and
forward+sampling seconds (one extra `get_timings` call after the step, not timed).
A finish record also says after how many output tokens the request's text first showed
(`first_text_token`; None: never, or no tokenizer): a streaming server sends no chunk for
tokens without text (a leading special token), so its client's first token comes later.
"""
from __future__ import annotations

import gc
import os
import time

from core.cost.step_log import config_record, step_decision, write_record


def thread_schedstat() -> dict[str, float]:
    """Seconds the calling thread has run (`cpu_s`: its CPU clock, exact to the call) and
    waited runnable for a core (`runq_s`: Linux schedstat, absent elsewhere) since it
    started. (schedstat's own run time only advances at ticks and switches.)"""
    out = {"cpu_s": time.thread_time()}
    try:
        with open("/proc/thread-self/schedstat") as f:
            out["runq_s"] = int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        pass
    return out


class _GcClock:
    """Seconds spent in Python's cyclic garbage collector, process-wide (gc.callbacks)."""

    def __init__(self):
        self.total = 0.0
        self._start = None

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.total += time.perf_counter() - self._start
            self._start = None


class StepRecorder:
    def __init__(self, engine, path: str | None = None, *, worker_timings: bool = False, keep: bool = True):
        self.engine = engine
        self.records: list[dict] = []
        self.keep = keep
        self.worker_timings = worker_timings
        if path:                          # e.g. --step-log results/steps.jsonl in a fresh clone
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "w") if path else None
        self._t0 = time.monotonic()
        self._executed = 0
        self._pending: dict | None = None
        self._open: dict[str, object] = {}          # request id -> Request, until it finishes
        self._first_text: dict[str, int] = {}       # request id -> output tokens when text first showed
        self._timings = self._worker_timings() if worker_timings else None
        core, executor = engine.core, engine.executor
        self._add, self._execute, self._step = core.add_request, executor.execute_model, engine._step
        core.add_request = self._on_add
        executor.execute_model = self._on_execute
        engine._step = self._on_step
        self._gc = _GcClock()
        gc.callbacks.append(self._gc)
        self._emit(config_record(engine.scheduler, engine.args.policy_names()))

    # -- hooks ------------------------------------------------------------------------------
    def _on_add(self, request):
        params = request.params
        self._emit({"kind": "arrival", "req_id": request.request_id, "step": self._executed,
                    "t": time.monotonic() - self._t0, "t_arrival": request.metrics.arrival_time - self._t0,
                    "prompt_token_ids": list(request.prompt_token_ids),
                    "max_tokens": params.max_tokens, "n": params.n, "beam_width": params.beam_width,
                    "ignore_eos": params.ignore_eos, "priority": request.priority})
        self._open[request.request_id] = request
        return self._add(request)

    def _on_execute(self, out):
        decision = step_decision(out, self.engine.scheduler.kv)
        t = time.perf_counter()
        cpu0 = time.thread_time()
        result = self._execute(out)
        cpu = time.thread_time() - cpu0
        self._pending = {"decision": decision, "execute_s": time.perf_counter() - t, "execute_cpu_s": cpu}
        return result

    def _on_step(self):
        detok0 = self.engine.detokenize_time
        t0 = time.perf_counter()              # the wall clock brackets the CPU/run-queue reads:
        sched0 = thread_schedstat()           # cpu_s + runq_s <= step_s
        gc0 = self._gc.total
        start = time.monotonic() - self._t0
        outputs = self._step()
        sched1 = thread_schedstat()
        wall = time.perf_counter() - t0
        pending, self._pending = self._pending, None
        if pending is not None:
            rec = {"kind": "step", "step": self._executed, "t_start": start, "t_end": start + wall,
                   "step_s": wall, "execute_s": pending["execute_s"], "execute_cpu_s": pending["execute_cpu_s"],
                   "detokenize_s": self.engine.detokenize_time - detok0, "decision": pending["decision"]}
            rec.update({k: sched1[k] - sched0[k] for k in sched1})
            rec["gc_s"] = self._gc.total - gc0
            if self.worker_timings:
                now = self._worker_timings()
                rec.update({k: now[k] - self._timings[k] for k in now})
                self._timings = now
            self._executed += 1
            self._emit(rec)
        for o in outputs:
            if o.outputs and o.outputs[0].text and o.request_id not in self._first_text:
                self._first_text[o.request_id] = len(o.outputs[0].token_ids)
        self._emit_finishes()
        return outputs

    # -- output -----------------------------------------------------------------------------
    def _worker_timings(self) -> dict[str, float]:
        t = self.engine.executor.collective_rpc("get_timings")[0]
        return {"prepare_s": t["prepare_s"], "forward_s": t["forward_s"], "worker_execute_s": t["execute_s"]}

    def _emit_finishes(self) -> None:
        done = [rid for rid, r in self._open.items() if r.is_finished]
        for rid in done:
            request = self._open.pop(rid)
            seqs = request.all_seqs()
            self._emit({"kind": "finish", "req_id": rid, "status": request.status.value,
                        "num_output_tokens": seqs[0].num_output_tokens if seqs else 0,
                        "first_text_token": self._first_text.pop(rid, None)})

    def _emit(self, record: dict) -> None:
        if self.keep:
            self.records.append(record)
        if self._file is not None:
            write_record(self._file, record)
            self._file.flush()

    def close(self) -> None:
        """Restore the engine's own methods and close the log (idempotent)."""
        if self._add is None:
            return
        self._emit_finishes()
        for obj, name in ((self.engine.core, "add_request"), (self.engine.executor, "execute_model"),
                          (self.engine, "_step")):
            obj.__dict__.pop(name, None)
        self._add = self._execute = self._step = None
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> StepRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "step"]
