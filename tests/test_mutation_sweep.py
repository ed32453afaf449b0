"""The mutation sweep (tests/mutation_sweep.py) stays applicable and reports what it sees."""
from __future__ import annotations

import subprocess

import pytest

from tests import mutation_sweep as sweep


def test_every_mutant_still_applies_to_the_code():
    """A core edit that moves a mutant's snippet must update the list (or drop the claim)."""
    names = [m.name for m in sweep.MUTANTS]
    assert len(set(names)) == len(names)
    for m in sweep.MUTANTS:
        text = (sweep.ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: snippet occurs {text.count(m.old)} times in {m.path}"
        assert m.old != m.new


def _checkout_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", "core"], cwd=sweep.ROOT, check=True,
                          capture_output=True, text=True).stdout


def test_a_sweep_kills_survives_and_goes_stale_in_a_copy(monkeypatch, capsys):
    salt = next(m for m in sweep.MUTANTS if "salt" in m.name)
    harmless = sweep.Mutant("a comment edit", salt.path, "# chained over parent key, tokens, salt",
                            "# (edited)")
    stale = sweep.Mutant("a snippet that is gone", salt.path, "no such code", "x")
    monkeypatch.setattr(sweep, "MUTANTS", [salt, harmless, stale])
    before = _checkout_state()
    rc = sweep.run(["--tests", "tests/core/kv/test_kv_cache_manager.py::test_prefix_hits_need_the_same_context_and_salt"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "killed    kv: block hashes ignore the salt" in out
    assert "SURVIVED  a comment edit" in out and "STALE     a snippet that is gone" in out
    assert "1 killed, 1 survived, 0 known survivors, 1 stale of 3" in out
    assert _checkout_state() == before                      # the checkout was never edited


def test_only_selects_and_an_empty_selection_is_an_error(capsys):
    assert sweep.run(["--only", "pool:", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed and all(line.startswith("pool:") for line in listed)
    assert sweep.run(["--only", "no mutant has this name"]) == 2


@pytest.mark.parametrize("path", sorted({m.path for m in sweep.MUTANTS}))
def test_the_swept_files_are_core_files(path):
    assert path.startswith("core/") and (sweep.ROOT / path).is_file()
