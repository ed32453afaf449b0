"""Server processes: the one free-port helper and the one "start `realexec serve`, wait
until healthy, stop" context manager.

`sim` (validate, calibrate) and `realexec` (the chaos and GPU benchmarks) both start
servers and may not import each other, so this lives in the core (stdlib only). One
policy everywhere:

* the server listens on 127.0.0.1 at a free port; its stdout and stderr go to a log
  file, and every error message names that file (and quotes its tail);
* healthy = `GET /health` answers 200, polled in a bounded loop; a process that exits
  first is an error at once;
* stop = SIGINT (the server drains), then SIGTERM, then SIGKILL, each after a timeout;
  the process is always waited for (killed by its pid in `finally`, also when the
  caller's block raised or the server never became healthy);
* a SIGTERM to this process while it has such a child unwinds it (`sigterm_unwinds`), so
  those `finally` blocks run: by default Python dies of SIGTERM at once, and `timeout` or
  `kill` on a command left the servers it had started running;
* one-shot children (`run_child`: a client, a peer engine, a sub-command) are stopped the
  same way, SIGINT first, when this process is interrupted, not SIGKILLed as
  `subprocess.run` does (a child killed outright leaves its own children behind).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0
# Seconds to wait after SIGINT (a drain: running requests may finish) and after SIGTERM.
STOP_TIMEOUTS_S = (30.0, 10.0)


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message names its log file."""


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on at `host` now (the OS picks it; another process may
    still take it before the caller binds it, which a server start then reports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = HOST, attempts: int = 50) -> int:
    """The first of `n` consecutive TCP ports nothing listens on at `host` now (for
    `serve --replicas N`, which takes PORT..PORT+N-1); the same caveat as free_port."""
    if n < 1:
        raise ValueError(f"free_ports: n must be >= 1, got {n}")
    for _ in range(attempts):
        socks: list[socket.socket] = []
        try:
            first = socket.socket()
            socks.append(first)
            first.bind((host, 0))
            port = first.getsockname()[1]
            if port + n - 1 > 65535:
                continue
            for p in range(port + 1, port + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"free_ports: no {n} consecutive free ports at {host} in {attempts} attempts")


def log_tail(log: str | Path, chars: int = 2000) -> str:
    """The last `chars` characters of a log file ('' if it cannot be read)."""
    try:
        return Path(log).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_healthy(url: str, proc: subprocess.Popen, log: str | Path, timeout: float = READY_TIMEOUT_S,
                 poll: float = 0.2) -> float:
    """Poll `url`/health until it answers 200; the seconds it took. Raises ServerError,
    naming `log`, if `proc` exits first or `timeout` seconds pass."""
    if timeout <= 0:
        raise ValueError(f"wait_healthy: timeout must be > 0 seconds, got {timeout}")
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        if proc.poll() is not None:
            raise ServerError(f"the server exited with status {proc.returncode} before it was healthy "
                              f"(log: {log}):\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (OSError, urllib.error.URLError):    # not listening yet, or 503 while starting
            pass
        if time.monotonic() >= deadline:
            raise ServerError(f"the server at {url} was not healthy within {timeout:.0f} s (log: {log}):\n"
                              f"{log_tail(log)}")
        time.sleep(poll)


def stop(proc: subprocess.Popen, timeouts: tuple[float, float] = STOP_TIMEOUTS_S) -> int:
    """Stop `proc` by its pid: SIGINT, then SIGTERM after timeouts[0] s, then SIGKILL after
    timeouts[1] s more; waits for it and returns its exit status (already exited: as is).
    Interrupted itself (a second Ctrl-C, SIGTERM while it waits), it kills the process at
    once and re-raises: it never returns with the process still running."""
    try:
        for sig, wait in ((signal.SIGINT, timeouts[0]), (signal.SIGTERM, timeouts[1])):
            if proc.poll() is not None:
                return proc.returncode
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                return proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
    except BaseException:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        raise
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    return proc.wait()


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(143) in this process's main thread instead of
    ending it on the spot, so `finally` blocks (the ones that stop child processes) run.
    Only where SIGTERM has its default action and on the main thread (where Python runs
    signal handlers); elsewhere, and when someone else handles SIGTERM, it does nothing.
    Further SIGTERMs are ignored while the process unwinds (each stop is bounded by its
    timeouts); the default comes back on the way out."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def unwind(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_child(cmd: Sequence[str], *, timeout: float | None = None,
              stop_timeouts: tuple[float, float] = STOP_TIMEOUTS_S, **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, timeout=timeout, **popen_kwargs)` (stdout/stderr/stdin/env/cwd/
    text ...), except that when this process is interrupted, gets SIGTERM or `timeout`
    passes, the child is stopped as `stop` does (SIGINT, so its own cleanup runs) and
    waited for; the exception (TimeoutExpired on a timeout) then propagates."""
    with sigterm_unwinds():
        proc = subprocess.Popen(list(cmd), **popen_kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            stop(proc, stop_timeouts)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@dataclass
class Server:
    """A running server: its process, base URL (http://127.0.0.1:PORT) and log file."""
    proc: subprocess.Popen
    url: str
    log: Path
    ready_s: float = 0.0

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def output(self) -> str:
        """Everything the server wrote so far (stdout and stderr, interleaved)."""
        return Path(self.log).read_text(errors="replace")


@contextlib.contextmanager
def serve_process(cmd: Sequence[str], port: int, log: str | Path, *, ready_timeout: float = READY_TIMEOUT_S,
                  stop_timeouts: tuple[float, float] = STOP_TIMEOUTS_S, env: dict | None = None,
                  cwd: str | Path | None = None) -> Iterator[Server]:
    """Run `cmd` (a server that listens on 127.0.0.1:`port`), yield it as a Server once
    healthy, and stop it on the way out (see `stop`); its output goes to `log`."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_unwinds():
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            server = Server(proc, f"http://{HOST}:{port}", log)
            server.ready_s = wait_healthy(server.url, proc, log, ready_timeout)
            yield server
        finally:
            stop(proc, stop_timeouts)


def realexec_serve_cmd(args: Sequence[str], port: int, python: str | None = None) -> list[str]:
    """The command line of `python -m realexec serve --port PORT ARGS...`."""
    return [python or sys.executable, "-m", "realexec", "serve", "--port", str(port), *args]


@contextlib.contextmanager
def realexec_server(args: Sequence[str], log: str | Path, *, port: int | None = None,
                    ready_timeout: float = READY_TIMEOUT_S, stop_timeouts: tuple[float, float] = STOP_TIMEOUTS_S,
                    env: dict | None = None, cwd: str | Path | None = None) -> Iterator[Server]:
    """`realexec serve ARGS...` on 127.0.0.1 at `port` (default: a free one), yielded once
    healthy and stopped on the way out. `env` is added to this process's environment."""
    port = free_port() if port is None else port
    if "--port" in args or any(a.startswith("--port=") for a in args):
        raise ValueError("realexec_server: pass the port as port=, not --port in args")
    with serve_process(realexec_serve_cmd(args, port), port, log, ready_timeout=ready_timeout,
                       stop_timeouts=stop_timeouts, env={**os.environ, **(env or {})}, cwd=cwd) as server:
        yield server
