"""core.cost.grid_workload: the profile grid an outside engine (vLLM) is driven with. The
staircase's decode-batch coverage is checked through our own scheduler in
tests/sim/twin/test_grid_runs.py; here, the layout."""
from __future__ import annotations

import pytest

from core.cost.grid_workload import (PREFILL_LENGTHS, grid_tokens, profile_workload, staircase,
                                     staircase_prompts)

POOL = list(range(100_000))          # distinct ids: a window's content names where it came from


def test_staircase_prompts_spread_from_8_to_the_longest():
    lengths = staircase_prompts(16, 512)
    assert lengths[0] == 8 and lengths[-1] == 512 and lengths == sorted(lengths)
    assert staircase_prompts(1, 512) == [8]
    assert staircase_prompts(4, 4) == [4, 4, 4, 4]         # shorter than 8: all at the cap


def test_staircase_outputs_are_staggered_by_steps_per_size():
    reqs = staircase(POOL, 8, 4, 24)
    assert [r["max_tokens"] for r in reqs] == [4 * (i + 1) + 1 for i in range(8)]
    assert {r["at_step"] for r in reqs} == {0}
    assert [len(r["prompt_token_ids"]) for r in reqs] == staircase_prompts(8, 24)


def test_profile_workload_lays_out_probes_into_the_staircase_and_alone():
    n, k = 16, 6
    reqs = profile_workload(POOL, n, k)
    stair, rest = reqs[:n], reqs[n:]
    lengths = sorted(PREFILL_LENGTHS)
    mixed, alone = rest[:2 * len(lengths)], rest[2 * len(lengths):]
    assert [len(r["prompt_token_ids"]) for r in mixed] == lengths + lengths[::-1]
    assert all(r["max_tokens"] == 1 for r in mixed)
    steps = [r["at_step"] for r in mixed]
    assert steps == sorted(steps) and steps[0] >= 2 and steps[-1] < steps[0] + k * n   # while the staircase decodes
    assert [len(r["prompt_token_ids"]) for r in alone] == lengths
    assert all(r["max_tokens"] == 2 for r in alone)
    alone_steps = [r["at_step"] for r in alone]
    # after the staircase's last decode, and far enough apart that each probe runs alone
    assert alone_steps[0] > steps[0] + k * n and all(b - a >= 3 for a, b in zip(alone_steps, alone_steps[1:]))
    # every prompt its own window of the pool (no token shared: no prefix-cache hit between
    # requests, nor any repeated text), the windows in order
    ids = [t for r in reqs for t in r["prompt_token_ids"]]
    assert ids == POOL[:len(ids)]
    assert sum(len(r["prompt_token_ids"]) for r in reqs) == grid_tokens(n)
    assert stair == staircase(POOL, n, k)


def test_a_pool_too_short_is_refused_with_both_counts():
    with pytest.raises(ValueError, match=rf"the token pool has 100 tokens, the grid needs {grid_tokens(4)}"):
        profile_workload(POOL[:100], 4, 2)
    with pytest.raises(ValueError, match="n >= 1 and steps_per_size >= 1"):
        staircase(POOL, 0, 2)
