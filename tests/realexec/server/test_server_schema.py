"""Fuzz the app through its own OpenAPI schema (schemathesis over the ASGI app, a tiny
random model): no 5xx, every 4xx in OpenAI's error shape, and every KV block free after.

CI runs a bounded number of examples per operation; set TWINSERVE_FUZZ_EXAMPLES=500 for
a longer local run.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from tests.realexec.server.test_server import tiny_dir, tiny_engine  # noqa: F401

schemathesis = pytest.importorskip("schemathesis")

pytestmark = pytest.mark.usefixtures("one_torch_thread")
EXAMPLES = int(os.environ.get("TWINSERVE_FUZZ_EXAMPLES", "12"))


@pytest.fixture(scope="module")
def app(tiny_dir):
    from realexec.server.app import create_app
    from realexec.server.config import ServerConfig

    # A short context keeps every generated request cheap (at most 64 tokens per sample).
    app = create_app(tiny_engine(tiny_dir, max_model_len=64, num_gpu_blocks=256), served_model_name="tiny",
                     config=ServerConfig(request_timeout=30))
    app.state.server.engine.start()          # the ASGI transport does not run the lifespan
    yield app
    app.state.server.engine.shutdown()


def test_schema_fuzz(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
            "GET /metrics"} <= set(operations)
    statuses: dict[int, int] = {}
    for name, op in operations.items():
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case):
            resp = case.call()
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (name, case.body, resp.text[:500])
            if resp.status_code >= 400:
                body = resp.json()
                assert set(body) == {"error"}, resp.text
                assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
        check()
    assert any(400 <= s < 500 for s in statuses) and statuses.get(200, 0) > 0, statuses
    stats = app.state.server.engine.stats
    assert stats.num_used_gpu_blocks == 0 and stats.num_requests_running == stats.num_requests_waiting == 0
    assert stats.num_pending == 0
