"""Sampling parameters through `realexec serve`: the same sampler as `LLM` (issue 26)."""
from __future__ import annotations

import httpx
import pytest

from tests.realexec.server.test_server import IGNORE_EOS, TINY, serve, tiny_dir, tiny_engine  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_temperature_below_epsilon_is_greedy_through_the_server(tiny_dir):  # noqa: F811
    """Defect: temperature 1e-40 underflowed float32 (NaN probabilities) and the server
    answered with token 0 only; now it is greedy, like temperature 0."""
    from realexec.server.app import create_app

    body = dict(model=TINY, prompt="The capital of France is", max_tokens=12, logprobs=1, **IGNORE_EOS)
    with serve(create_app(tiny_engine(tiny_dir), served_model_name=TINY)) as base, \
            httpx.Client(base_url=base, timeout=60) as http:
        def tokens(temperature):
            r = http.post("/v1/completions", json={**body, "temperature": temperature})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        greedy = tokens(0.0)
        assert len(set(greedy)) > 1                  # (a constant output could not tell them apart)
        assert tokens(1e-40) == greedy
