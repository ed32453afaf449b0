"""`bench simulate-vs-real`'s pieces that need no server: the --loads flag and the table."""
from __future__ import annotations

import pytest

from realexec.bench.simulated import ROWS, _parse_loads, comparison_table


def test_loads_parse_and_bad_ones_name_the_item():
    assert _parse_loads("light=0.3, queueing=2") == [("light", 0.3), ("queueing", 2.0)]
    for bad in ("light", "light=0", "=2", "light=fast", "light=-1"):
        with pytest.raises(ValueError, match=r"--loads: expected name=rate pairs"):
            _parse_loads(bad)


def test_table_gives_each_rows_error_against_the_real_run_and_its_target():
    real = {key: 100.0 for _, key, _ in ROWS}
    sim = dict(real, median_ttft_ms=104.0, median_tpot_ms=94.0, p90_ttft_ms=109.0, p90_tpot_ms=111.0,
               output_throughput=100.0, request_throughput=0.0)
    real["request_throughput"] = 0.0                      # nothing to compare against: n/a, not a division
    lines = comparison_table({"light": {"real": real, "simulated": sim}}).splitlines()
    rows = {line.split(" | ")[1]: line for line in lines[2:]}
    assert len(rows) == len(ROWS)
    assert rows["median TTFT (ms)"].endswith("| +4.0% | ±5% ok |")
    assert rows["median TPOT (ms)"].endswith("| -6.0% | ±5% missed |")
    assert rows["p90 TTFT (ms)"].endswith("| +9.0% | ±10% ok |")
    assert rows["p90 TPOT (ms)"].endswith("| +11.0% | ±10% missed |")
    assert rows["request throughput (req/s)"].endswith("| n/a | ±5%  |")
