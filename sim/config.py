"""SimConfig: every knob of a simulated deployment, and the CLI flags built from it.

Each field declares its flag, help and argument type next to its default, so adding a
knob is one line here; `core.cli_args` turns the fields into flags, as it does for the
real engine's EngineArgs. A knob both backends have has the same field name and flag in
both, vLLM's (`tensor_parallel_size`, `pipeline_parallel_size`, `queue_policy`,
`preemption_mode`, `victim_policy`, `eviction_policy`, `swap_space`, ...; `-tp`/`-pp`
as short spellings); the simulator's older spellings (`--tp`, `--pp`, `--queue`,
`--preemption`, `--victim`, `--eviction`, `--swap-space-gib`, `--no-chunked-prefill`)
still work for one release, hidden from --help, with a warning on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

from policies import REGISTRY
from core.cli_args import add_dataclass_args, dataclass_from_args, field_flag, knob
from core.cost.specs import HARDWARE, MODELS

DEFAULT_MODEL = "Llama-2-13B"
DEFAULT_HARDWARE = "A100-40G"


# -- argparse types: numbers with bounds and readable errors ---------------------------------
def int_at_least(low: int):
    """argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v


def positive_float(text: str) -> float:
    v = _number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def nonneg_float(text: str) -> float:
    v = _number(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def fraction(text: str) -> float:
    v = positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def unit_interval(text: str) -> float:
    v = nonneg_float(text)
    if v >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def _names(kind: str) -> str:
    return " | ".join(REGISTRY[kind])


def _knob(default, help: str, *, group: str = "deployment", flag: str | None = None, old: str | None = None,
          type=None, metavar: str | None = None, choices=None, alias: str | None = None):
    """A SimConfig field with its flag (core.cli_args.knob): `flag` (default: --field-name),
    its argparse `type`, `alias`, a short second spelling, and `old`, a deprecated spelling
    kept as a hidden alias that warns."""
    return knob(default, help, group=group, flag=flag, aliases=(alias,) if alias else (),
                deprecated=(old,) if old else (), type=type, metavar=metavar, choices=choices)


@dataclass
class SimConfig:
    """Everything that defines a simulated deployment (the trace is separate)."""
    model: str = _knob(DEFAULT_MODEL, f"model spec: {', '.join(MODELS)}", metavar="NAME")
    hardware: str = _knob(DEFAULT_HARDWARE, f"accelerator: {', '.join(HARDWARE)}", metavar="NAME")
    tensor_parallel_size: int = _knob(1, "tensor-parallel degree", alias="-tp", old="--tp", type=positive_int,
                                      metavar="N")
    enable_expert_parallel: bool = _knob(False, "mixture-of-experts models: spread whole experts over the tp GPUs "
                                                "(expert parallelism, EP = tp) instead of a 1/tp slice of each; "
                                                "every MoE layer then adds a dispatch and a combine all-to-all")
    pipeline_parallel_size: int = _knob(1, "pipeline stages P: the decoder layers split over P x tp GPUs, up to P batches in flight "
                       "(P > 1 runs every step one by one: no event skipping)", 
                                        alias="-pp", old="--pp", type=positive_int, metavar="P")
    pp_layer_partition: str | None = _knob(None, "layers per pipeline stage, e.g. 40,40 (default: an even split, "
                                                 "the first stages taking one more)", metavar="N,N,...")
    pp_link_bandwidth: float | None = _knob(
        None, "GB/s per direction between consecutive pipeline stages (default: --hardware's NVLink when the "
              "P x tp GPUs fit one 8-GPU node, else 25 GB/s, a 200 Gb/s InfiniBand NIC per GPU)",
        type=positive_float, metavar="GBPS")
    async_scheduling: bool = _knob(
        False, "schedule step N+1 while step N computes (vLLM's async scheduling; one stage): the host's per-step "
               "work (the cost model's overhead) overlaps the device's, 2 batches in flight, no event skipping")
    num_gpu_blocks: int | None = _knob(None, "KV blocks in the GPU pool (default: sized from memory like vLLM)",
                                       type=positive_int, metavar="N")
    gpu_memory_utilization: float = _knob(0.9, "fraction of GPU memory the engine may use", type=fraction,
                                          metavar="F")
    swap_space: float = _knob(4.0, "GiB of CPU memory per GPU for swapped-out KV blocks (0 disables swapping)",
                                  old="--swap-space-gib", type=nonneg_float, metavar="GIB")
    block_size: int = _knob(16, "tokens per KV block", type=positive_int, metavar="N")
    max_num_seqs: int = _knob(256, "most sequences running at once (the batch of one step; parallel samples and "
                                   "beams count one each)", type=positive_int, metavar="N")
    max_num_batched_tokens: int | None = _knob(
        None, "most tokens computed in one step (default: 2048; without chunked prefill at least max-model-len)",
        type=positive_int, metavar="N")
    max_model_len: int | None = _knob(None, "prompt + output tokens of one sequence (default: the model's context, "
                                            "capped at what the KV cache holds)", type=positive_int, metavar="N")
    enable_chunked_prefill: bool = _knob(True, "split long prompts over several steps", old="--no-chunked-prefill")
    enable_prefix_caching: bool = _knob(False, "reuse KV blocks of identical prompt prefixes")
    watermark: float = _knob(0.01, "fraction of KV blocks new admissions must leave free", type=unit_interval,
                             metavar="F")
    long_prefill_token_threshold: int = _knob(0, "most prompt tokens one request computes in a step (0: no cap)",
                                              type=nonneg_int, metavar="N")
    queue_policy: str = _knob("fcfs", f"waiting-queue order: {_names('queue')}", group="policies",
                       old="--queue", choices=list(REGISTRY["queue"]), metavar="NAME")
    preemption_mode: str = _knob("recompute", f"preemption mode: {_names('preemption')}", group="policies",
                            old="--preemption", choices=list(REGISTRY["preemption"]),
                            metavar="NAME")
    victim_policy: str = _knob("newest", f"preemption victim: {_names('victim')}", group="policies",
                        old="--victim", choices=list(REGISTRY["victim"]), metavar="NAME")
    eviction_policy: str = _knob("lru", f"cached-block eviction: {_names('eviction')}", group="policies",
                          old="--eviction", choices=list(REGISTRY["eviction"]),
                          metavar="NAME")
    scheduler: str = _knob("twinserve", "engine whose scheduling rules the core follows: twinserve, or vllm-v1 "
                                        "(vLLM v1's decisions step for step; flags not given take vLLM's defaults: "
                                        "prefix caching on, watermark 0, recompute, 128-token blocks on cpu-* "
                                        "hardware, victim 'tail' for fcfs)", group="policies",
                           choices=list(REGISTRY["scheduler"]), metavar="NAME")
    allocation: str = _knob("paged", f"KV allocation: {_names('allocation')}: paged blocks, or an Orca-style "
                                     "contiguous region per sequence reserved for max_model_len / the next power "
                                     "of two of / exactly its final length (no prefix caching, no swapping: swap "
                                     "preemption recomputes)", group="policies",
                            choices=list(REGISTRY["allocation"]), metavar="NAME")
    n: int = _knob(1, "parallel samples per request", group="workload", type=positive_int, metavar="N")
    beam_width: int = _knob(0, "beam search width, 0 = off; each beam draws 2W candidates with random log-probs, "
                               "so which beams survive is random (seeded by --seed; see sim/workloads.py)",
                            group="workload", type=nonneg_int, metavar="W")
    seed: int = _knob(0, "arrival and beam-model seed", group="workload", type=int, metavar="S")
    cost_model: str | None = _knob(None, "price steps with the model fitted by `python -m realexec profile` (that "
                                         "JSON file; per-step overhead included; swaps still use the roofline's "
                                         "PCIe term) instead of the roofline of --model on --hardware",
                                   group="simulator", metavar="FILE")
    jitter_seed: int | None = _knob(None, "with a calibrated --cost-model (`sim calibrate`): multiply each step's "
                                          "time by seeded noise with the served runs' measured step-to-step "
                                          "spread and correlation (its jitter section); runs step by step",
                                    group="simulator", type=int, metavar="S")
    event_skipping: bool = _knob(True, "skip steady decode spans in bulk (--no-event-skipping: every step one by "
                                       "one; slower, same results)", group="simulator")


def add_config_args(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One flag per SimConfig field, in groups (returned so callers can add to them)."""
    return add_dataclass_args(parser, SimConfig)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return dataclass_from_args(SimConfig, args)


# -- the engine a cost model was measured on ------------------------------------------------------
# `realexec profile` writes the engine configuration it ran (its `engine` section, SimConfig's
# field names; `sim calibrate` keeps it): with --cost-model, a run simulates that engine
# unless a flag says otherwise.
ENGINE_FIELDS = ("num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "enable_chunked_prefill", "enable_prefix_caching", "watermark", "swap_space", "queue_policy",
                 "preemption_mode", "victim_policy", "eviction_policy")
# A policy kind (policies.REGISTRY, `--policies queue=sjf`) -> the SimConfig field that names it.
POLICY_FIELDS = {"queue": "queue_policy", "preemption": "preemption_mode", "victim": "victim_policy",
                 "eviction": "eviction_policy", "allocation": "allocation", "scheduler": "scheduler"}


def _flag(name: str, value=None) -> str:
    return field_flag(SimConfig, name, value)


def measured_engine(model: dict, where: str) -> dict:
    """The cost model's `engine` section, checked (core.cost.schema; old key names read as
    the new ones), by SimConfig field ({} for files from before it existed)."""
    from core.cost.schema import engine_settings
    return {k: v for k, v in engine_settings(model, where).items() if k in ENGINE_FIELDS}


def with_scheduler_defaults(config: SimConfig, explicit: set[str] | None) -> SimConfig:
    """`config` with the defaults of the engine --scheduler names (policies.scheduling) for
    the fields the command line did not give (`explicit`; None: those equal to SimConfig's
    defaults count as not given)."""
    from policies.scheduling import ENGINE_DEFAULTS, VLLM_V1_CPU_BLOCK_SIZE, scheduling_rules
    defaults = dict(ENGINE_DEFAULTS.get(config.scheduler.lower(), {}))
    if not defaults:
        return config
    if config.scheduler.lower() == "vllm-v1" and config.hardware.lower().startswith("cpu"):
        defaults["block_size"] = VLLM_V1_CPU_BLOCK_SIZE
    victim = scheduling_rules(config.scheduler).victim_for(config.queue_policy.lower())
    if victim:
        defaults["victim_policy"] = victim         # the engine's own victim rule (summary shows it)
    if explicit is None:
        explicit = {f.name for f in dataclasses.fields(SimConfig) if getattr(config, f.name) != f.default}
    return dataclasses.replace(config, **{k: v for k, v in defaults.items() if k not in explicit})


def with_measured_engine(config: SimConfig, explicit: set[str] | None, warn=None) -> SimConfig:
    """(First the --scheduler engine's defaults: `with_scheduler_defaults`.) `config` simulating the engine its --cost-model was measured on: each field of the
    file's `engine` section replaces the default of a flag the user did not give. A given
    flag that differs from the measured engine is kept and named in one warning line.
    `explicit`: the SimConfig fields given on the command line (None: those that differ
    from SimConfig's defaults). --gpu-memory-utilization given sizes the KV cache from
    memory instead of the measured block count."""
    config = with_scheduler_defaults(config, explicit)
    if config.cost_model is None:
        return config
    from core.cost.fitted import load_cost_model_file
    try:
        model = load_cost_model_file(config.cost_model)
    except ValueError:
        return config                    # unreadable: resolve() says so, with the other checks
    engine = measured_engine(model, config.cost_model)
    if not engine:
        return config
    if explicit is None:
        explicit = {f.name for f in dataclasses.fields(SimConfig) if getattr(config, f.name) != f.default}
    changes, differs = {}, []
    for name, value in engine.items():
        if name == "num_gpu_blocks" and "gpu_memory_utilization" in explicit and name not in explicit:
            differs.append(f"{_flag('gpu_memory_utilization', config.gpu_memory_utilization)} sizes the KV cache "
                           f"(measured: {value:,} blocks)")
        elif name not in explicit:
            changes[name] = value
        elif getattr(config, name) != value:
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            differs.append(f"{_flag(name, getattr(config, name))} (measured: {shown})")
    if differs:
        (warn or (lambda m: print(m, file=sys.stderr)))(
            f"warning: simulating another engine than {config.cost_model} was measured on: " + "; ".join(differs))
    return dataclasses.replace(config, **changes)
