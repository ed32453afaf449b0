"""`python -m realexec bench profile-vllm`: its arguments are checked before vLLM starts
(vLLM is not installed in CI; the grid it sends is core.cost.grid_workload's, tested there,
and the recorder's stepping in tests/sim/twin/test_vllm_logs.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.cost.grid_workload import grid_tokens
from traces import TraceError
from traces.build import prompt_token_pool

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("args, message", [
    (["--vllm-python", "/nonexistent/python", "--model-dir", "."], "/nonexistent/python"),
    (["--vllm-python", sys.executable, "--model-dir", "/nonexistent"], "--model-dir /nonexistent: not a directory"),
    (["--vllm-python", sys.executable, "--model-dir", ".", "--max-num-seqs", "0"],
     "--max-num-seqs and --steps-per-size must be >= 1"),
])
def test_bad_arguments_are_one_line_errors_before_vllm_starts(args, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "realexec", "bench", "profile-vllm", *args,
                           "--out", str(tmp_path / "p.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_the_token_pool_is_the_traces_prompts_in_order():
    path = ROOT / "traces" / "sharegpt.json"
    pool = prompt_token_pool(path, grid_tokens(16), skip=300)
    assert len(pool) >= grid_tokens(16) and pool != prompt_token_pool(path, grid_tokens(16), skip=301)
    with pytest.raises(TraceError, match=r"its prompts from request 1990 on have \d+ tokens, 1000000000 are needed"):
        prompt_token_pool(path, 10 ** 9, skip=1990)
