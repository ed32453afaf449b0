"""The project's one percentile (core.metrics.percentile) is numpy's default, exactly.

vLLM's `bench serve` reports numpy.percentile (linear interpolation, q in [0, 100]);
the core must stay stdlib-only, so it has its own pure-Python copy, checked here
against numpy on arbitrary data. The other places that report percentiles call it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.metrics import describe, percentile

finite = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)
qs = st.one_of(st.sampled_from([0.0, 25.0, 50.0, 90.0, 99.0, 99.9, 100.0]),
               st.floats(min_value=0.0, max_value=100.0, allow_nan=False))


@settings(max_examples=500)
@given(values=st.lists(finite, min_size=1, max_size=60), q=qs)
def test_percentile_is_numpys_to_the_last_bit(values, q):
    want = float(np.percentile(np.array(values, dtype=np.float64), q))
    assert percentile(values, q) == want


@given(values=st.lists(finite, min_size=1, max_size=40), q1=qs, q2=qs)
def test_percentile_is_monotone_in_q_and_within_the_data(values, q1, q2):
    lo, hi = sorted((q1, q2))
    assert min(values) <= percentile(values, lo) <= percentile(values, hi) <= max(values)


def test_unsorted_input_and_integer_values():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([10, 0], 25) == 2.5        # interpolated, not nearest-rank (0 or 10)
    assert percentile([5], 99) == 5


def test_empty_input_is_nan_not_zero():
    assert math.isnan(percentile([], 50))
    d = describe([])
    assert all(math.isnan(v) for v in d.values())


@pytest.mark.parametrize("q", [-1, 100.5, 0.5 - 1, float("nan")])
def test_q_outside_0_100_is_refused(q):
    with pytest.raises(ValueError, match="q must be in \\[0, 100\\]"):
        percentile([1.0, 2.0], q)


def test_other_modules_use_the_core_percentile():
    """The five places that used to carry their own percentile now call this one."""
    import core.cost.fit as cost_fit
    import traces.stats as stats

    # nearest-rank gave 2.0 here (the 2nd of 4); interpolated: 2.5
    assert cost_fit.summarize_errors([1.0, 2.0, 3.0, 4.0])["median"] == 2.5
    assert stats.summarize([1, 2, 3, 4])["median"] == 2.5
    assert stats.percentile is percentile

    import plots.figures as figures
    import realexec.bench.chaos as bench_chaos

    assert figures.percentile is percentile and bench_chaos.percentile is percentile
