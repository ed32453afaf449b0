"""`python -m realexec.bench.gpu`, the one command a lent GPU box runs, kept working on CPU:
the random-weight checkpoint it builds when the real model cannot be sent, and its greedy
agreement step (Triton interpreted on CPU instead of compiled on CUDA)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from realexec.bench.gpu import agreement, make_random_checkpoint
from tests.tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path, vocab_size=256, initializer_range=0.15, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2)
    return path


def test_random_checkpoint_has_the_shapes_of_its_source_and_loads(tiny, tmp_path):
    from realexec.models.loader import load_model

    import shutil

    src = Path(shutil.copytree(tiny, tmp_path / "src"))
    (src / "tokenizer_config.json").write_text("{}")        # tokenizer files travel with the config
    out = make_random_checkpoint(src, tmp_path / "random", std=0.05)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == \
        json.loads((tiny / "config.json").read_text())["hidden_size"]
    assert (out / "tokenizer_config.json").exists()
    ours, _, _ = load_model(out, dtype=torch.float32, with_tokenizer=False)
    theirs, _, _ = load_model(tiny, dtype=torch.float32, with_tokenizer=False)
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    weights = [v for k, v in a.items() if v.dim() == 2]
    assert all(abs(float(w.std()) - 0.05) < 0.01 for w in weights if w.numel() > 1000)
    assert not any(torch.equal(a[k], b[k]) for k in a if a[k].dim() == 2)   # not the source's weights


def test_agreement_counts_identical_sequences_and_common_prefixes():
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [5, 6]]) == \
        {"identical": 2, "of": 2, "mean_prefix": 1.0}
    a = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 9], [7, 6]])
    assert a["identical"] == 0 and a["mean_prefix"] == pytest.approx((2 / 4 + 0) / 2)


def test_greedy_step_agrees_across_our_paths_and_hf_on_cpu(tiny, tmp_path):
    out = tmp_path / "greedy.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "realexec.bench.gpu", "greedy", str(tiny), "--device", "cpu",
                        "--max-tokens", "4", "--num-prompts", "6", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    table = json.loads(out.read_text())
    assert set(table) == {"triton+graphs", "triton+graphs+async", "triton eager", "torch eager", "triton+graphs vs torch eager"}
    assert all(row == {"identical": 6, "of": 6, "mean_prefix": 1.0} for row in table.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA message; with a GPU the script runs its steps")
def test_without_cuda_it_says_so_and_exits_0():
    r = subprocess.run([sys.executable, "-m", "realexec.bench.gpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "CUDA is not available" in r.stdout
