"""`python -m core.bench`: the hot-path benchmark runs every mode on a small batch."""
from __future__ import annotations

import pytest

from core.bench import main, measure


@pytest.mark.parametrize("kw", [{}, {"pp": 2}, {"async_scheduling": True}], ids=["one-batch", "pp2", "async"])
@pytest.mark.parametrize("caching", [False, True])
def test_every_mode_measures_a_full_decode_batch(kw, caching):
    r = measure(8, caching, steps=5, **kw)
    assert r["seqs"] == 8 and r["us_per_step"] > 0 and r["us_per_seq"] > 0


def test_async_with_pp_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--seqs", "8", "--steps", "2", "--pp", "2", "--async-scheduling"])
    assert "drop --pp" in capsys.readouterr().err
