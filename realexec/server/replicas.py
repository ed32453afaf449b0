"""Several uvicorn servers in one process and one event loop (`serve --simulate --replicas N`).

Each replica is its own app (its own AsyncEngine thread, metrics registry and port); they
share the asyncio loop that serves their HTTP. A signal drains every replica: uvicorn's
own signal capture (one handler per process, the last server's) is replaced by one
handler that hands each signal to every server, whose DrainingServer.handle_exit drains
it on the first signal and exits the process on the second.
"""
from __future__ import annotations

import asyncio
import signal
import sys
from contextlib import contextmanager

from realexec.server.lifecycle import DrainingServer


class ReplicaServer(DrainingServer):
    """A DrainingServer that leaves the process's signal handlers to `run_replicas`."""

    @contextmanager
    def capture_signals(self):
        yield


def run_replicas(servers: list[ReplicaServer]) -> None:
    """Serve all of `servers` until each has exited (after a drain)."""
    def handle(sig, frame):
        for server in servers:
            server.handle_exit(sig, frame)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # uvicorn's own loop choice (uvloop when installed: `server` extra), as Server.run makes it
        get_factory = getattr(servers[0].config, "get_loop_factory", None)
        factory = get_factory() if get_factory is not None else None
        if factory is not None and sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(_serve_all(servers))
        else:
            asyncio.run(_serve_all(servers))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve_all(servers: list[ReplicaServer]) -> None:
    await asyncio.gather(*(server.serve() for server in servers))
