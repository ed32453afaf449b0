"""`sim run` with the model families of issue 31: MoE models pick a GPU they fit when
--hardware is not given, and expert parallelism is a flag of its own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.cost.specs import MODELS
from sim.cli import main as cli_main
from sim.config import DEFAULT_HARDWARE, SimConfig
from sim.engine import with_fitting_hardware
from sim.engine import resolve

SHAREGPT = Path(__file__).resolve().parents[2] / "traces" / "sharegpt.json"


def _run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "out"
    assert cli_main(["run", str(SHAREGPT), "--num-requests", "40", "--rate", "4", "--quiet",
                     "--out", str(out), *flags]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("model, tp, hardware", [
    ("Qwen3-30B-A3B", 1, "A100-80G"),      # 57 GiB of weights
    ("Mixtral-8x7B", 1, "H200"),           # 87 GiB
    ("Mixtral-8x7B", 2, "A100-80G"),       # 44 GiB a rank
    ("Llama-2-13B", 1, DEFAULT_HARDWARE),  # fits the default: unchanged
    ("Gemma-2-9B", 1, DEFAULT_HARDWARE),
])
def test_without_hardware_a_model_gets_the_first_gpu_it_fits(model, tp, hardware):
    messages = []
    config = with_fitting_hardware(SimConfig(model=model, tensor_parallel_size=tp), {"model", "tensor_parallel_size"},
                                   warn=messages.append)
    assert config.hardware == hardware
    assert resolve(config).cache.num_gpu_blocks > 0
    assert bool(messages) == (hardware != DEFAULT_HARDWARE)
    assert all(f"simulating {hardware}" in m for m in messages)


def test_a_given_hardware_is_kept_and_the_error_says_why():
    given = with_fitting_hardware(SimConfig(model="Qwen3-30B-A3B", hardware="A100-40G"), {"model", "hardware"})
    assert given.hardware == "A100-40G"
    with pytest.raises(ValueError, match="weights need 56.9 GiB"):
        resolve(given)


@pytest.mark.parametrize("model", ["Qwen3-30B-A3B", "Mixtral-8x7B"])
def test_sim_run_moe_end_to_end(model, tmp_path, capsys):
    summary = _run(tmp_path, "--model", model)
    assert summary["completed"] == 40
    assert summary["config"]["hardware"] != DEFAULT_HARDWARE
    assert "does not fit A100-40G" in capsys.readouterr().err


def test_expert_parallel_run_prices_the_all_to_all(tmp_path):
    """Same deployment with and without EP: EP swaps an all-reduce per layer for two
    all-to-alls of the same volume, so its steps take longer (latency terms)."""
    base = _run(tmp_path / "tp", "--model", "Mixtral-8x7B", "--tensor-parallel-size", "4")
    ep = _run(tmp_path / "ep", "--model", "Mixtral-8x7B", "--tensor-parallel-size", "4", "--enable-expert-parallel")
    assert ep["config"]["enable_expert_parallel"] and not base["config"]["enable_expert_parallel"]
    assert ep["completed"] == base["completed"] == 40
    assert ep["mean_tpot"] > base["mean_tpot"]


@pytest.mark.parametrize("flags, needle", [
    (["--model", "Llama-3-8B", "--tensor-parallel-size", "2", "--enable-expert-parallel"], "Llama-3-8B is dense"),
    (["--model", "Mixtral-8x7B", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--enable-expert-parallel"],
     "drop it or --pipeline-parallel-size"),
])
def test_expert_parallel_misuse_is_one_line_and_exit_2(flags, needle, tmp_path, capsys):
    assert cli_main(["run", str(SHAREGPT), "--quiet", "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_every_new_family_resolves_somewhere():
    for name in ("Qwen3-8B", "Qwen3-32B", "Gemma-2-27B", "Phi-3-mini-4k", "Mistral-7B-v0.1", "Mistral-7B-v0.3"):
        assert name in MODELS
        config = with_fitting_hardware(SimConfig(model=name), {"model"}, warn=lambda m: None)
        assert resolve(config).cache.num_gpu_blocks > 0, name
