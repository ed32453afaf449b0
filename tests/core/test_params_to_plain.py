"""core.step_message.params_to_plain: the SamplingParams a step message carries to the
workers, as plain values that do not alias the request's own lists (a worker in this
process must not see, or make, later changes to them)."""
from __future__ import annotations

import dataclasses

from core import SamplingParams
from core.step_message import params_to_plain


def test_every_field_as_plain_values_without_aliasing():
    params = SamplingParams(n=2, max_tokens=7, temperature=0.5, seed=3, stop=["\n\n", "END"],
                            stop_token_ids=[2, 7], logprobs=1, cache_salt="s")
    plain = params_to_plain(params)
    assert plain == dataclasses.asdict(params)
    assert set(plain) == {f.name for f in dataclasses.fields(SamplingParams)}
    for name in ("stop", "stop_token_ids"):
        assert type(plain[name]) is list and plain[name] is not getattr(params, name)
    plain["stop"].append("x")
    params.stop_token_ids.append(9)
    assert params.stop == ["\n\n", "END"] and plain["stop_token_ids"] == [2, 7]
