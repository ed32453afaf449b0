"""OpenAI-compatible HTTP server over the real engine (`python -m realexec serve`).

    from realexec.server import create_app
    app = create_app(engine_args=EngineArgs(), served_model_name="SmolLM2-135M-Instruct")

- app.py: the FastAPI app factory, the handlers, the auth/drain guard (ASGI middleware);
- protocol.py: OpenAI request/response shapes (pydantic);
- errors.py: what can go wrong, as values, and the OpenAI error body (no other imports);
- config.py: ServerConfig (auth, limits, timeouts, shutdown) and its `serve` flags;
- async_engine.py: the engine loop in a background thread, per-request asyncio queues;
- metrics.py: Prometheus metrics (vLLM names, `twinserve:` prefix), fed one way by snapshots;
- lifecycle.py: graceful SIGTERM/SIGINT drain around uvicorn;
- cli.py: `serve` flags (EngineArgs' + ServerConfig's + host/port/name) and runner.

Imports point one way: app -> async_engine -> metrics -> errors; nothing imports app.
"""
from __future__ import annotations


def create_app(*args, **kwargs):
    from realexec.server.app import create_app as _create_app
    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
