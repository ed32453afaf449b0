"""Graceful shutdown: uvicorn, except that the first SIGTERM/SIGINT drains first.

    server = DrainingServer(uvicorn.Config(app, ...), drain=app.state.server.drain, shutdown_timeout=30)
    server.run()          # returns after a drain (exit code 0); a second signal exits at once (1)

Drain (OpenAIServer.drain): new /v1 requests get 503 and /health turns 503 (so a load
balancer stops sending), so do requests whose body is still arriving (a stalled upload
holds nothing up), running requests may finish for up to shutdown_timeout
seconds, the rest are aborted (streams end with an SSE error event), then uvicorn's
usual exit closes the connections and the app's lifespan stops the engine thread.
uvicorn itself would stop listening at once and re-raise the signal after exiting (a
non-zero exit); this subclass does neither.
"""
from __future__ import annotations

import asyncio
import os
import signal
from typing import Awaitable, Callable

import uvicorn


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[None]], shutdown_timeout: float):
        super().__init__(config)
        self._drain, self._timeout = drain, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self._draining or self._loop is None:
            print(f"twinserve: second {name}: exiting now", flush=True)
            os._exit(1)
        self._draining = True
        print(f"twinserve: {name}: draining (up to {self._timeout:g} s), send it again to exit now", flush=True)
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain(self._timeout)
        finally:
            self.should_exit = True
