"""core.cli_args: the one config-dataclass -> argparse generator (SimConfig, EngineArgs,
ServerConfig), its deprecated spellings, and the same field name for a knob the
simulator and the real engine share."""
from __future__ import annotations

import argparse
import json
import dataclasses
from dataclasses import dataclass

import pytest

from core.cli_args import add_dataclass_args, dataclass_from_args, field_flag, knob


@dataclass
class Toy:
    tensor_parallel_size: int = knob(1, "ranks", aliases=("-tp",), deprecated=("--tp",), metavar="N")
    max_model_len: int | None = knob(None, "tokens", group="limits")
    watermark: float = knob(0.01, "free fraction", group="limits")
    queue_policy: str = knob("fcfs", "order", flag="--queue-policy", deprecated=("--queue",), choices=["fcfs", "sjf"])
    enable_chunked_prefill: bool = knob(True, "chunk", deprecated=("--no-chunked-prefill",))
    note: str | None = knob(None, "free text")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    add_dataclass_args(p, Toy, group="deployment")
    return p


def test_one_flag_per_field_typed_from_the_annotation():
    t = dataclass_from_args(Toy, parser().parse_args(["--tensor-parallel-size", "4", "--max-model-len", "2048",
                                                      "--watermark", "0.5", "--no-enable-chunked-prefill"]))
    assert t == Toy(tensor_parallel_size=4, max_model_len=2048, watermark=0.5, enable_chunked_prefill=False)
    assert isinstance(t.max_model_len, int) and isinstance(t.watermark, float)
    assert dataclass_from_args(Toy, parser().parse_args([])) == Toy()          # defaults are the dataclass's


def test_choices_and_types_are_enforced(capsys):
    for bad in (["--queue-policy", "lifo"], ["--tensor-parallel-size", "two"], ["--max-model-len", "1.5"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
        assert bad[0] in capsys.readouterr().err


def test_old_spelling_works_warns_in_one_line_and_is_hidden(capsys):
    t = dataclass_from_args(Toy, parser().parse_args(["--tp", "2", "--queue", "sjf", "--no-chunked-prefill"]))
    assert (t.tensor_parallel_size, t.queue_policy, t.enable_chunked_prefill) == (2, "sjf", False)
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: --tp is deprecated; use --tensor-parallel-size",
                   "warning: --queue is deprecated; use --queue-policy",
                   "warning: --no-chunked-prefill is deprecated; use --no-enable-chunked-prefill"]
    with pytest.raises(SystemExit):                 # the old spelling keeps its choices
        parser().parse_args(["--queue", "lifo"])
    help_ = parser().format_help()
    assert "--tp " not in help_ and "--queue " not in help_ and "--no-chunked-prefill" not in help_
    assert "-tp N" in help_ and "--queue-policy" in help_


def test_visible_alias_does_not_warn(capsys):
    assert parser().parse_args(["-tp", "8"]).tensor_parallel_size == 8
    assert capsys.readouterr().err == ""


def test_help_sections_and_defaults():
    p = argparse.ArgumentParser()
    groups = add_dataclass_args(p, Toy, group="deployment")
    assert set(groups) == {"deployment", "limits"}
    help_ = p.format_help()
    assert "ranks (default: 1)" in help_ and "free text\n" in help_ + "\n"      # None: no default shown
    assert help_.index("limits:") > help_.index("deployment:")


def test_field_flag_spells_a_value_as_typed():
    assert field_flag(Toy, "queue_policy", "sjf") == "--queue-policy sjf"
    assert field_flag(Toy, "enable_chunked_prefill", False) == "--no-enable-chunked-prefill"
    assert field_flag(Toy, "tensor_parallel_size") == "--tensor-parallel-size"
    with pytest.raises(KeyError, match="Toy has no field 'tp'"):
        field_flag(Toy, "tp")


def test_a_field_without_a_parseable_type_is_named():
    @dataclass
    class Bad:
        sizes: list[int] = knob(default_factory=list, help="sizes")

    with pytest.raises(TypeError, match="field 'sizes'.*knob"):
        add_dataclass_args(argparse.ArgumentParser(), Bad)


# -- the same knob, the same name, in both backends ---------------------------------------------

SHARED = ("model", "tensor_parallel_size", "pipeline_parallel_size", "pp_layer_partition", "num_gpu_blocks",
          "gpu_memory_utilization", "swap_space", "block_size", "max_num_seqs", "max_num_batched_tokens",
          "max_model_len", "enable_chunked_prefill", "enable_prefix_caching", "watermark", "queue_policy",
          "preemption_mode", "victim_policy", "eviction_policy", "seed")
OLD_NAMES = ("tp", "pp", "swap_space_gib", "queue", "preemption", "victim", "eviction")


def test_sim_and_realexec_name_a_shared_knob_alike():
    from realexec.config import EngineArgs
    from sim.config import SimConfig

    for cls in (SimConfig, EngineArgs):
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(SHARED) <= names, (cls.__name__, set(SHARED) - names)
        assert not names & set(OLD_NAMES), (cls.__name__, names & set(OLD_NAMES))
        flags = {f.name: field_flag(cls, f.name) for f in dataclasses.fields(cls) if f.name in SHARED}
        assert flags == {n: "--" + n.replace("_", "-") for n in SHARED}


@pytest.mark.parametrize("old,new,field,value", [
    ("--tp", "--tensor-parallel-size", "tensor_parallel_size", 2), ("--pp", "--pipeline-parallel-size",
                                                                     "pipeline_parallel_size", 2),
    ("--queue", "--queue-policy", "queue_policy", "sjf"), ("--preemption", "--preemption-mode", "preemption_mode",
                                                           "swap"),
    ("--swap-space-gib", "--swap-space", "swap_space", 2.0)])
def test_the_simulators_old_flags_still_work_and_warn(old, new, field, value, capsys):
    from sim.config import SimConfig, add_config_args, config_from_args

    p = argparse.ArgumentParser()
    add_config_args(p)
    config = config_from_args(p.parse_args([old, str(value)]))
    assert getattr(config, field) == value and isinstance(config, SimConfig)
    assert capsys.readouterr().err == f"warning: {old} is deprecated; use {new}\n"


def test_sim_run_warns_once_per_old_spelling(tmp_path, capsys):
    """`sim run` parses its flags twice (the second time to learn which were given): an old
    spelling still warns once."""
    from sim.cli import main

    out = tmp_path / "out"
    assert main(["run", "traces/sharegpt.json", "--num-requests", "3", "--model", "SmolLM2-135M", "--hardware",
                 "cpu-2core", "--tp", "1", "--queue", "sjf", "--quiet", "--out", str(out)]) == 0
    assert capsys.readouterr().err.splitlines() == ["warning: --tp is deprecated; use --tensor-parallel-size",
                                                    "warning: --queue is deprecated; use --queue-policy"]
    assert json.loads((out / "summary.json").read_text())["config"]["queue_policy"] == "sjf"
