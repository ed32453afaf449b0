"""MultiprocExecutor: one worker process per rank (pipeline stage x tensor-parallel rank)
on this machine.

    engine process                     rank 0 process        rank 1 process ...
    step message --encode once-->  pipe ----------------> pipe ---------------> ...
                                   Worker.execute_model   Worker.execute_model
                                        \\___ torch.distributed (gloo / NCCL) ___/
    ModelRunnerOutput  <--- pipe --- the output rank only (the last stage's TP driver samples)

Transport: one duplex pipe per rank. Each step's message is encoded once (msgspec) and
the same bytes are written to every rank's pipe; a reader blocks in the kernel until
they arrive, which matters on a small machine where a polling shared-memory reader would
take a core from the ranks that compute (measured: `python -m realexec bench executors`).
Ranks other than the output rank answer a step only when they fail. Sending never waits
for a reply: with pipeline stages, the next step's message is already in stage 0's pipe
while the last stage still works on this one; the executor's reader thread collects
replies in sending order (realexec.executor.base.InOrderReplies).

Faults: the engine waits on the driver's pipe, every pipe (a non-driver writes only to
report an error) and every process sentinel. A process that exits is reported at once
with its rank and exit code or signal; a rank whose heartbeat (a thread stamping a shared
array every 0.5 s) goes stale, or a step that outlasts `worker_timeout`, is reported as
hung. Then every worker is stopped (terminate, then kill) and the executor stays failed.
Workers exit by themselves when the engine's end of their pipe closes.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import wait as wait_any

from core.procs import free_port
from core.step_message import ModelRunnerOutput, StepMessage
from realexec.config import EngineArgs
from realexec.executor.base import ExecutorBase, InOrderReplies, WorkerError, load_engine_tokenizer
from realexec.executor.serialization import decode_step, dumps, encode_step, loads

STEP, RPC, STOP = b"S", b"R", b"X"
HEARTBEAT_S = 0.5
STALE_HEARTBEAT_S = 15.0
# Start-up calls wait for every rank to spawn and join the process group, partly inside
# native calls that hold the GIL (the heartbeat thread cannot stamp): on a loaded machine
# that takes longer than a stale heartbeat. `worker_timeout` bounds them instead.
STARTUP_CALLS = ("init_device", "load_model")
# Exit code of a worker process that, while spawn re-imported the main module, was asked to
# start workers itself: the script creates an engine without an `if __name__ == "__main__":`
# guard. (EX_CONFIG from sysexits.h: a usage error, not a crash.)
EXIT_MAIN_NOT_GUARDED = 78
MAIN_GUARD_HINT = ('the script that created the engine has no `if __name__ == "__main__":` guard. The mp executor '
                   "starts its workers with 'spawn', which imports the main module again in each of them, so each "
                   "worker ran the script and tried to start workers of its own. Put the code that creates the "
                   'LLM / engine under `if __name__ == "__main__":` (Python\'s multiprocessing docs, "Safe '
                   'importing of main module")')


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _heartbeat(beats, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_S)


def worker_main(args: EngineArgs, rank: int, world_size: int, init_method: str, conn, beats) -> None:
    """The loop of one rank's process: read a request, run it, answer."""
    from realexec.worker.worker import Worker, call_on_worker

    threading.Thread(target=_heartbeat, args=(beats, rank), daemon=True).start()
    worker = Worker(args, rank=rank, world_size=world_size, distributed_init_method=init_method,
                    with_tokenizer=False)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return                               # the engine is gone: no orphans
        kind, body = data[:1], memoryview(data)[1:]
        if kind == STOP:
            from realexec.distributed import destroy_distributed
            destroy_distributed()
            return
        try:
            if kind == STEP:
                result = worker.execute_model(decode_step(body))
                if worker.is_output_rank:
                    conn.send_bytes(dumps(("ok", result)))
            else:
                method, a, kw = loads(body)
                conn.send_bytes(dumps(("ok", call_on_worker(worker, method, a, kw))))
        except BaseException as e:           # report, then keep serving (the engine decides)
            conn.send_bytes(dumps(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))


class MultiprocExecutor(ExecutorBase):
    backend = "mp"

    def _init_workers(self) -> None:
        if getattr(mp.current_process(), "_inheriting", False):
            # A spawned process still importing the main module (what multiprocessing's own
            # check looks at): its RuntimeError would reach only this process's stderr, and
            # the engine would see a bare exit code 1. Exit with a code the engine names.
            print(f"twinserve: {MAIN_GUARD_HINT}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_MAIN_NOT_GUARDED)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ctx = mp.get_context("spawn")           # CUDA and torch threads do not survive fork
        n = self.world_size
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{free_port()}"
        self._beats = ctx.Array("d", [time.monotonic()] * n, lock=False)
        self.conns, self.procs = [], []
        self._closed = False
        for rank in range(n):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=worker_main, args=(self.args, rank, n, init_method, child, self._beats),
                            name=f"twinserve-worker-{rank}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        # Replies read ahead of their call: a rank that answers a step only on error may
        # answer an RPC sent after that step while the step is still being collected.
        self._early: list[deque] = [deque() for _ in range(n)]
        self._replies = InOrderReplies("twinserve-mp-replies")
        self._tokenizer = load_engine_tokenizer(self.args)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- transport --------------------------------------------------------------------------
    def _broadcast(self, data: bytes) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                raise self._fail(WorkerError(rank, f"cannot send to it ({e}); process "
                                                   f"{describe_exit(self.procs[rank].exitcode)}")) from None

    def _await(self, ranks: list[int], what: str) -> dict[int, object]:
        """Wait for one reply from each of `ranks`, watching every rank for errors and death
        (the reader thread's job: one call at a time, in sending order)."""
        if self.error is not None:
            raise self.error
        replies: dict[int, object] = {r: self._early[r].popleft() for r in ranks if self._early[r]}
        deadline = time.monotonic() + self.args.worker_timeout
        stale = min(STALE_HEARTBEAT_S, self.args.worker_timeout)
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(replies) < len(ranks):
            if self._closed:
                raise self.error or WorkerError(None, f"the executor was shut down during {what}")
            try:
                ready = wait_any(list(by_conn) + list(by_sentinel), timeout=1.0)
            except (OSError, ValueError):             # a pipe closed under us by shutdown
                continue
            self._check_deaths(ready, what)
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        status, value = loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        continue                           # its sentinel tells why
                    if status == "err":
                        # A peer's death makes the others' collectives fail: blame the dead one.
                        self._check_deaths(wait_any(list(by_sentinel), timeout=2.0), what)
                        raise self._fail(WorkerError(rank, f"raised during {what}: {value}"))
                    if rank in ranks and rank not in replies:
                        replies[rank] = value
                    else:
                        self._early[rank].append(value)       # a later call's reply
            now = time.monotonic()
            for rank in range(self.world_size if what not in STARTUP_CALLS else 0):
                if now - self._beats[rank] > stale:
                    raise self._fail(WorkerError(rank, f"hung during {what}: no heartbeat for "
                                                       f"{now - self._beats[rank]:.0f} s"))
            if now > deadline:
                late = [r for r in ranks if r not in replies]
                raise self._fail(WorkerError(late[0], f"no reply to {what} within {self.args.worker_timeout:g} s "
                                                      f"(ranks without a reply: {late})"))
        return replies

    def _check_deaths(self, ready, what: str) -> None:
        for rank, p in enumerate(self.procs):
            if p.sentinel in ready:
                p.join(timeout=1.0)                 # reap it: its exit code says how it ended
                cause = f"process {p.pid} died during {what} ({describe_exit(p.exitcode)})"
                if p.exitcode == EXIT_MAIN_NOT_GUARDED:
                    cause += f": {MAIN_GUARD_HINT}"
                raise self._fail(WorkerError(rank, cause))

    def _send_rpc(self, method, args: tuple, kwargs: dict):
        self._broadcast(RPC + dumps((method, args, kwargs)))
        return list(range(self.world_size)), getattr(method, "__name__", method), False

    def _send_step(self, msg: StepMessage):
        data = STEP + encode_step(msg)
        self.message_bytes += len(data)
        self._broadcast(data)
        return [self.output_rank], f"step {msg.step_id}", True

    def _collect(self, handle) -> ModelRunnerOutput | list:
        ranks, what, is_step = handle
        replies = self._await(ranks, what)
        return replies[ranks[0]] if is_step else [replies[r] for r in ranks]

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._close_replies()
        if self.error is None:                  # healthy: ask politely; failed: no waiting
            for conn in self.conns:
                try:
                    conn.send_bytes(STOP)
                except OSError:
                    pass
        deadline = time.monotonic() + (5.0 if self.error is None else 0.0)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive() and self.error is None:
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():                    # also reaches a stopped (SIGSTOP) process
                p.kill()
                p.join(timeout=2.0)
        for conn in self.conns:
            conn.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
