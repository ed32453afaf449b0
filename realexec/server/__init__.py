"""OpenAI-compatible HTTP server over the real engine (`python -m realexec serve`).

    from realexec.server import create_app
    app = create_app(engine_args=EngineArgs(), served_model_name="SmolLM2-135M-Instruct")

- app.py: the FastAPI app factory and the endpoint handlers;
- protocol.py: OpenAI request/response shapes (pydantic) and the error body;
- async_engine.py: the engine loop in a background thread, per-request asyncio queues;
- metrics.py: Prometheus metrics (vLLM names, `twinserve:` prefix);
- cli.py: `serve` flags (EngineArgs' flags + host/port/name/queue limit) and runner.
"""
from __future__ import annotations


def create_app(*args, **kwargs):
    from realexec.server.app import create_app as _create_app
    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
