"""core.procs: the one free-port helper and server-process context manager (used by sim
validate/calibrate, the chaos and GPU benchmarks and the server tests). A fake server
(stdlib http.server) stands in for `realexec serve`: it logs the signals it gets, and
can ignore them, exit early or never become healthy."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from core.procs import (ServerError, free_port, free_ports, realexec_serve_cmd, realexec_server, run_child,
                        serve_process, sigterm_unwinds, stop)

FAKE = textwrap.dedent("""
    import http.server, os, signal, sys, threading, time
    port, mode = int(sys.argv[1]), sys.argv[2]
    print("pid", os.getpid(), flush=True)
    if mode == "exit":
        print("cannot load the model", flush=True)
        sys.exit(3)

    def on(sig, frame):
        print("got", signal.Signals(sig).name, flush=True)
        if mode != "stubborn":
            os._exit(0)
    signal.signal(signal.SIGINT, on)
    signal.signal(signal.SIGTERM, on)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503 if mode == "unhealthy" else 200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    while True:
        time.sleep(0.05)
""")


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)

    def cmd(port: int, mode: str = "ok") -> list[str]:
        return [sys.executable, str(script), str(port), mode]
    return cmd


def _pid(log_text: str) -> int:
    return int(log_text.split("pid ", 1)[1].split()[0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_free_port_is_free_on_loopback():
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:          # nothing holds it: we can bind it ourselves
        s.bind(("127.0.0.1", port))


def test_free_ports_are_consecutive_and_free():
    """`serve --replicas 4` takes PORT..PORT+3: all four can be bound."""
    port = free_ports(4)
    socks = [socket.socket() for _ in range(4)]
    try:
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", port + i))
    finally:
        for s in socks:
            s.close()
    with pytest.raises(ValueError, match="n must be >= 1"):
        free_ports(0)


def test_server_is_healthy_inside_and_stopped_with_sigint_after(fake, tmp_path):
    port, log = free_port(), tmp_path / "logs" / "server.log"
    with serve_process(fake(port), port, log, ready_timeout=30) as server:
        assert server.url == f"http://127.0.0.1:{port}" and server.port == port
        assert server.proc.poll() is None
        with socket.create_connection(("127.0.0.1", port), timeout=5):   # it listens where we said
            pass
    assert server.proc.returncode == 0
    assert "got SIGINT" in server.output() and "SIGTERM" not in server.output()   # one drain signal


def test_stop_escalates_sigint_sigterm_sigkill(fake, tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    t0 = time.monotonic()
    with serve_process(fake(port, "stubborn"), port, log, ready_timeout=30, stop_timeouts=(0.5, 0.5)) as server:
        t0 = time.monotonic()
    assert server.proc.returncode == -9                       # killed in the end
    out = server.output()
    assert out.index("got SIGINT") < out.index("got SIGTERM"), out
    assert time.monotonic() - t0 < 10


def test_server_stopped_when_the_body_raises(fake, tmp_path):
    port = free_port()
    with pytest.raises(KeyError), serve_process(fake(port), port, tmp_path / "s.log", ready_timeout=30) as server:
        raise KeyError("boom")
    assert server.proc.returncode is not None


def test_early_exit_is_an_error_naming_the_log_and_quoting_it(fake, tmp_path):
    port, log = free_port(), tmp_path / "early.log"
    with pytest.raises(ServerError) as e, serve_process(fake(port, "exit"), port, log, ready_timeout=30):
        pytest.fail("the body must not run")
    msg = str(e.value)
    assert "exited with status 3" in msg and str(log) in msg and "cannot load the model" in msg


def test_never_healthy_times_out_and_the_process_is_killed(fake, tmp_path):
    port, log = free_port(), tmp_path / "slow.log"
    with pytest.raises(ServerError, match=r"not healthy within 1 s") as e, \
            serve_process(fake(port, "unhealthy"), port, log, ready_timeout=1, stop_timeouts=(5, 5)):
        pytest.fail("the body must not run")
    assert str(log) in str(e.value)
    pid = _pid(log.read_text())
    assert _gone(pid), "the server outlived its context"
    assert "got SIGINT" in log.read_text()


def test_realexec_server_builds_the_command_and_refuses_a_second_port(tmp_path):
    assert realexec_serve_cmd(["--model", "m"], 1234, python="py") == \
        ["py", "-m", "realexec", "serve", "--port", "1234", "--model", "m"]
    with pytest.raises(ValueError, match="port="):
        with realexec_server(["--port", "80"], tmp_path / "x.log"):
            pass
    with pytest.raises(ValueError, match="timeout must be > 0"), \
            serve_process([sys.executable, "-c", "pass"], free_port(), tmp_path / "y.log", ready_timeout=0):
        pass


# A parent that starts the fake server (through serve_process or run_child) and then waits;
# the tests send it SIGTERM, as `timeout` or `kill` would, and look for the orphan.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from core.procs import run_child, serve_process
    fake, port, log, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cmd = [sys.executable, fake, str(port), "ok"]
    if how == "serve":
        with serve_process(cmd, port, log, ready_timeout=30, stop_timeouts=(5, 5)):
            print("ready", flush=True)
            time.sleep(120)
    else:
        with open(log, "w") as f:
            run_child(cmd, stdout=f, stderr=subprocess.STDOUT, stop_timeouts=(5, 5))
""")


def _wait_for(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["serve", "run"])
def test_sigterm_to_the_parent_stops_its_child_first(fake, tmp_path, how):
    """SIGTERM (`timeout`, `kill`) to a command that started a server or a child: Python's
    default ends it without its `finally` blocks, which left the child running. Now the
    parent unwinds (exit status 143), its child gets SIGINT and is gone."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    log = tmp_path / "child.log"
    fake_script = fake(0)[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen([sys.executable, str(script), fake_script, str(free_port()), str(log), how],
                              cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert _wait_for(lambda: log.is_file() and "pid " in log.read_text()), "the child never started"
        if how == "serve":
            assert parent.stdout.readline().strip() == "ready"
        child = _pid(log.read_text())
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 143
        assert "got SIGINT" in log.read_text()          # stopped the gentle way, by its parent
        assert _wait_for(lambda: _gone(child), 10), "the child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and not _gone(child):      # the failure above: no orphan either
            os.kill(child, signal.SIGKILL)


def test_run_child_timeout_stops_the_child_and_raises(fake, tmp_path):
    log = tmp_path / "child.log"
    with open(log, "w") as f, pytest.raises(subprocess.TimeoutExpired):
        run_child(fake(free_port()), timeout=2, stdout=f, stderr=subprocess.STDOUT, stop_timeouts=(5, 5))
    assert "got SIGINT" in log.read_text()
    assert _gone(_pid(log.read_text()))


def test_run_child_returns_like_subprocess_run(tmp_path):
    done = run_child([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(4)"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (4, "out\n", "err\n")


def test_sigterm_handler_is_restored_and_left_alone_when_someone_else_owns_it():
    # (an earlier test in the same process may have left its own handler, e.g. ray.init's)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with sigterm_unwinds():
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        mine = lambda signum, frame: None           # noqa: E731 - a handler someone else installed
        signal.signal(signal.SIGTERM, mine)
        with sigterm_unwinds():
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_interrupted_while_waiting_kills_and_reraises(fake, tmp_path):
    """A second Ctrl-C (or SIGTERM) while stop waits for a server to drain: the server is
    killed at once, never left running, and the interruption propagates."""
    port = free_port()
    with serve_process(fake(port, "stubborn"), port, tmp_path / "s.log", ready_timeout=30) as server:
        pass_through = signal.getsignal(signal.SIGALRM)

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                stop(server.proc, (30, 30))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, pass_through)
        assert server.proc.returncode == -9 and time.monotonic() - t0 < 10
