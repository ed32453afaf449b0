"""The `mp` executor in a script without an `if __name__ == "__main__":` guard (issue 26):
the engine's error names the missing guard, not just a worker's exit code."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[3]


def run_script(path: Path, body: str) -> subprocess.CompletedProcess:
    path.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=path.parent)


@pytest.mark.timeout(600)
def test_missing_main_guard_is_named_in_the_engine_error(tmp_path):
    save_tiny_llama(tmp_path / "tiny", vocab_size=256)
    make = (f"llm = LLM(model={str(tmp_path / 'tiny')!r}, distributed_executor_backend='mp', block_size=4, "
            f"num_gpu_blocks=64, swap_space=0.01)\n")
    use = "print('tokens', llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids)\n"
    header = "from core import SamplingParams\nfrom realexec import LLM\n"

    bare = run_script(tmp_path / "bare.py", header + make + use)
    assert bare.returncode != 0
    error = [line for line in bare.stderr.splitlines() if line.startswith("realexec.executor.base.WorkerError")]
    assert len(error) == 1, bare.stderr[-3000:]
    assert "died during init_device" in error[0]
    assert 'no `if __name__ == "__main__":` guard' in error[0] and "spawn" in error[0], error[0]

    # The same script with the guard runs.
    guarded = run_script(tmp_path / "guarded.py", header + 'if __name__ == "__main__":\n'
                         + textwrap.indent(make + use, "    "))
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    assert "tokens [" in guarded.stdout
