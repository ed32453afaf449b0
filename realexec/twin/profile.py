"""`python -m realexec profile [--out results/profile.json]`: time real engine steps, fit a step-cost model.

The real engine (same scheduler, executor and workers as `serve`) runs small workloads
chosen so that its steps cover a grid, and every executed step is timed (StepRecorder):
  * prefill: one prompt of C + P tokens with chunks of M = max-num-batched-tokens tokens:
    its last chunk computes P tokens after C cached ones (C a multiple of M);
  * decode: B prompts of L tokens, then B-sequence decode steps over growing context;
  * mixed: B sequences decoding when a prompt of P tokens arrives: chunked-prefill steps
    that mix one prefill slice with B decodes.
Each workload runs after a warm-up pass and is repeated; every step of every run is a
sample (also the earlier chunks and the prefill steps of decode workloads). Per step it
records the whole step's wall time and where it went: the executor (`execute_s`: input
preparation, forward, sampling, RPC to the workers) and the rest (`overhead_s`:
scheduling, update, detokenization), in wall seconds and in CPU seconds of the stepping
thread. On CPU the fit uses the CPU seconds (`--time-basis`): a step's wall time on a
shared machine also holds the time its thread waited for a core (`runq_s`, 30-40% at a
load average of 3 on 2 cores), which changes with the neighbours, not with the batch.
`core.cost.fit` fits each part per phase, choosing
the feature family by k-fold held-out error. Swap copies are timed apart (n blocks out
and back in on the idle engine) and fitted as a fixed cost plus a cost per block. The
file holds the raw samples and the fitted model (plain JSON; `python -m sim run --cost-model FILE` reads it),
and, in its `engine` section, the engine configuration `realexec serve` runs with the same
flags (KV blocks, block size, max_model_len, max_num_seqs, max_num_batched_tokens, chunked
prefill, ...): the deployment `sim run --cost-model FILE` simulates unless told otherwise.
"""
from __future__ import annotations

import json
import os
import platform
import random
import sys
import time

from core import SamplingParams
from core.cost.fit import PHASES, check_model, fit_step_cost, fit_swap_cost, phase_of, shape_of
from realexec.config import add_engine_args, engine_args_from_namespace

# The full grid's chunk: served prompts of a few hundred tokens are prefilled in one step
# (serve's default chunk is 2048), and on CPU such a step costs more than the line through
# smaller ones (SmolLM2 fp32, served: a 438-token prefill 1.5-1.7x a 256-token grid's
# price, the other steps 1.2-1.3x), so the grid times prefills up to 512 tokens.
FULL_CHUNK, QUICK_CHUNK = 512, 32
TIME_BASES = ("auto", "cpu", "wall")
SWAP_BLOCKS, SWAP_BLOCKS_QUICK = (1, 4, 16, 64), (1, 4, 16)      # blocks per timed swap copy


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="results/profile.json",
                        help="write the samples and the fitted model here (JSON) [results/profile.json]")
    parser.add_argument("--quick", action="store_true", help="a small grid (CI, tiny models): seconds, not minutes")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each grid workload [3]")
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds for the held-out error [5]")
    parser.add_argument("--time-basis", choices=TIME_BASES, default="auto",
                        help="fit the stepping thread's CPU seconds (cpu: steady on a shared machine; needs the "
                             "uni executor on CPU with one torch thread) or wall seconds; auto picks cpu where "
                             "it applies [auto]")
    add_engine_args(parser)


def grid(chunk: int, quick: bool) -> list[tuple[str, dict]]:
    """(kind, parameters) of each workload."""
    if quick:
        prefill = [(p, c) for p in (4, 16, chunk) for c in (0, chunk)]
        decode = [(b, length) for b in (1, 4, 8) for length in (8, 24)]
        mixed = [(2, 8, p) for p in (8, chunk)]
        decode_tokens = 4
    else:
        prefill = [(p, c) for p in sorted({16, 64, 128, 256, chunk}) if p <= chunk for c in (0, chunk, 2 * chunk)]
        # small batches densely: on CPU the cost is not linear in the batch there (see cost_fit)
        decode = [(b, length) for b in (1, 2, 3, 4, 6, 8, 12, 16, 32) for length in (32, 128, 384)
                  if b * length <= 2048]
        mixed = [(b, 64, p) for b in (4, 16) for p in (32, chunk)]
        decode_tokens = 8
    work = [("prefill", {"tokens": p, "context": c}) for p, c in prefill]
    work += [("decode", {"batch": b, "prompt": length, "max_tokens": decode_tokens}) for b, length in decode]
    work += [("mixed", {"batch": b, "prompt": length, "new_prompt": p, "max_tokens": decode_tokens + 2})
             for b, length, p in mixed]
    return work


class _Runner:
    """Adds a workload's requests to the engine and steps it until they are done."""

    def __init__(self, engine, seed: int = 0):
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.ids = 0

    def prompt(self, n: int) -> list[int]:
        # random ids (not special tokens at the low end), distinct per request
        return [self.rng.randrange(min(3, self.vocab - 1), self.vocab) for _ in range(n)]

    def add(self, n_prompt: int, max_tokens: int) -> str:
        self.ids += 1
        rid = f"profile-{self.ids}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(self.prompt(n_prompt), params, request_id=rid)
        return rid

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def run(self, kind: str, p: dict) -> None:
        if kind == "prefill":
            self.add(p["context"] + p["tokens"], 1)
        elif kind == "decode":
            for _ in range(p["batch"]):
                self.add(p["prompt"], p["max_tokens"])
        elif kind == "mixed":
            rids = [self.add(p["prompt"], p["max_tokens"]) for _ in range(p["batch"])]
            states = self.engine._states
            # wait until every one of them decodes, then a prompt arrives
            while any(rid in states and not states[rid].request.seqs[0].num_output_tokens for rid in rids):
                self.engine.step()
            self.add(p["new_prompt"], 1)
        else:
            raise ValueError(f"unknown workload kind {kind!r}")
        self.drain()


def time_basis_for(engine, requested: str = "auto") -> str:
    """'cpu' fits the stepping thread's CPU seconds (what the step costs on a core of its
    own: steady on a shared machine, where wall time also holds the waits for a core);
    only meaningful when that thread does all the work: the in-process (uni) executor on
    CPU with one torch thread. 'wall' fits wall seconds (GPUs, worker processes, Ray)."""
    if requested not in TIME_BASES:
        raise ValueError(f"--time-basis must be one of {TIME_BASES}, got {requested!r}")
    executor = engine.executor
    own_thread = (executor.backend == "uni" and executor.driver.device.type == "cpu"
                  and engine.args.cpu_threads == 1)
    if requested == "auto":
        return "cpu" if own_thread else "wall"
    if requested == "cpu" and not own_thread:
        raise ValueError("--time-basis cpu needs the uni executor on CPU with --cpu-threads 1 "
                         "(elsewhere the step's work is not on the stepping thread)")
    return requested


def sample_of(rec: dict, basis: str = "wall") -> dict:
    """A fit sample from a step record: the batch's sums and where the time went.
    `execute_s` / `overhead_s` (the fitted parts) are in the chosen basis; the wall and
    CPU seconds are kept as measured."""
    batch = rec["decision"]["batch"]
    seqs, tokens, context, pairs = shape_of([b[1] for b in batch], [b[2] for b in batch])
    step_s, wall_execute_s = rec["step_s"], rec["execute_s"]
    if basis == "cpu":
        execute_s, overhead_s = rec["execute_cpu_s"], rec["cpu_s"] - rec["execute_cpu_s"]
    else:
        execute_s, overhead_s = wall_execute_s, step_s - wall_execute_s
    out = {"seqs": seqs, "tokens": tokens, "context": context, "pairs": pairs,
           "execute_s": max(execute_s, 1e-9), "overhead_s": max(overhead_s, 1e-9),
           "step_s": step_s, "wall_execute_s": wall_execute_s, "detokenize_s": rec["detokenize_s"],
           "scheduler_s": step_s - wall_execute_s - rec["detokenize_s"]}
    for k in ("prepare_s", "forward_s", "worker_execute_s", "cpu_s", "execute_cpu_s", "runq_s"):
        if k in rec:
            out[k] = rec[k]
    if "worker_execute_s" in rec:
        out["rpc_s"] = wall_execute_s - rec["worker_execute_s"]
    return out


def overhead_breakdown(samples: list[dict]) -> dict[str, float]:
    """Mean wall seconds per step of each component, over all samples."""
    keys = ("step_s", "wall_execute_s", "forward_s", "prepare_s", "rpc_s", "scheduler_s", "detokenize_s")
    return {k: sum(s.get(k, 0.0) for s in samples) / len(samples) for k in keys}


def cpu_share(samples: list[dict]) -> dict[str, float] | None:
    """Of the stepping thread's wall time over all steps: the share it ran on a core and
    the share it waited for one (None without schedstat numbers)."""
    wall = sum(s["step_s"] for s in samples)
    if not wall or not all("runq_s" in s for s in samples):
        return None
    return {"cpu": sum(s["cpu_s"] for s in samples) / wall, "runq": sum(s["runq_s"] for s in samples) / wall}


def profile_swaps(engine, counts: tuple[int, ...], repeats: int, basis: str) -> list[dict]:
    """Time the executor's swap copies of n blocks each way (idle engine: swap out blocks
    0..n-1, then back in, which restores them). Skipped without a swap pool."""
    cache = engine.scheduler.cache_config
    limit = min(cache.num_gpu_blocks, cache.num_cpu_blocks)
    clock = time.thread_time if basis == "cpu" else time.perf_counter
    rpc = engine.executor.collective_rpc
    samples = []
    for r in range(repeats + 1):                       # round 0 warms up
        timed = []
        for n in counts:
            if n > limit:
                continue
            mapping = [(i, i) for i in range(n)]
            t0 = clock()
            rpc("swap_out", (mapping,))
            t1 = clock()
            rpc("swap_in", (mapping,))
            t2 = clock()
            timed += [{"blocks": n, "seconds": t1 - t0, "direction": "out"},
                      {"blocks": n, "seconds": t2 - t1, "direction": "in"}]
        if r:
            samples += timed
    return samples


def profile(engine, *, quick: bool, repeats: int, folds: int = 5, time_basis: str = "auto", log=print) -> dict:
    from realexec.twin.step_recorder import StepRecorder

    basis = time_basis_for(engine, time_basis)

    chunk = engine.scheduler.config.max_num_batched_tokens
    work = grid(chunk, quick)
    runner = _Runner(engine)
    load_before = os.getloadavg()
    with StepRecorder(engine, worker_timings=True) as rec:
        for kind in ("prefill", "decode", "mixed"):            # warm-up: one of each, discarded
            runner.run(*next(w for w in work if w[0] == kind))
        rec.records.clear()
        t0 = time.perf_counter()
        for r in range(repeats):
            for kind, p in work:
                runner.run(kind, p)
            log(f"  repeat {r + 1}/{repeats}: {len(rec.steps)} steps, {time.perf_counter() - t0:.1f}s")
        steps = rec.steps
    samples = [sample_of(s, basis) for s in steps]
    model = fit_step_cost(samples, k=folds)
    swaps = profile_swaps(engine, SWAP_BLOCKS_QUICK if quick else SWAP_BLOCKS, repeats, basis)
    if swaps:
        model["swap"] = fit_swap_cost(swaps, engine.executor.collective_rpc("bytes_per_block")[0], k=folds)
    model["profile"] = {
        "model": engine.args.model or "SmolLM2-135M-Instruct", "device": str(engine.args.device),
        "host": platform.node(), "tensor_parallel_size": engine.args.tensor_parallel_size,
        "backend": engine.executor.backend, "dtype": engine.args.dtype, "cpu_threads": engine.args.cpu_threads,
        "engine": {"block_size": engine.args.block_size, "max_num_batched_tokens": chunk,
                   "max_num_seqs": engine.scheduler.config.max_num_seqs,
                   "num_gpu_blocks": engine.scheduler.cache_config.num_gpu_blocks},
        "loadavg_1m": [load_before[0], os.getloadavg()[0]],   # before / after: how shared the machine was
        "quick": quick, "repeats": repeats, "grid": [[k, p] for k, p in work],
        "time_basis": basis, "cpu_share": cpu_share(samples), "overhead_mean_s": overhead_breakdown(samples)}
    model["samples"] = samples
    return model


def format_report(model: dict) -> str:
    basis = model["profile"].get("time_basis", "wall")
    lines = [f"time basis: {basis} ("
             + ("CPU seconds of the stepping thread: a step's cost on a core of its own" if basis == "cpu"
                else "wall seconds") + ")",
             "held-out relative error per family (mean / p90), k-fold over the samples:"]
    for part, phases in model["parts"].items():
        for phase in PHASES:
            entry = phases.get(phase)
            if entry is None:
                continue
            lines.append(f"  {part:9s} {phase:8s} chosen: {entry['family']}")
            for fam, e in entry["held_out"].items():
                mark = "*" if fam == entry["family"] else " "
                lines.append(f"    {mark} {fam:22s} {e['mean'] * 100:6.2f}% / {e['p90'] * 100:6.2f}%  (n={e['n']})")
    lines.append("held-out error of the whole step time (execute + overhead), chosen families:")
    for phase, e in model["held_out_step"].items():
        lines.append(f"  {phase:8s} mean {e['mean'] * 100:.2f}%  median {e['median'] * 100:.2f}%  "
                     f"p90 {e['p90'] * 100:.2f}%  (n={e['n']})")
    lines.append("same-shape repeats vs the mean of the others (the machine's noise floor for any shape model):")
    for phase, e in model.get("repeat_noise", {}).items():
        lines.append(f"  {phase:8s} mean {e['mean'] * 100:.2f}%  median {e['median'] * 100:.2f}%  "
                     f"p90 {e['p90'] * 100:.2f}%  (n={e['n']})")
    lo, hi = model["profile"]["loadavg_1m"]
    lines.append(f"machine load average (1 min) before / after: {lo:.2f} / {hi:.2f} on {os.cpu_count()} CPUs")
    swap = model.get("swap")
    if swap:
        a, b = swap["coef"]
        e = swap["held_out"]
        lines.append(f"swap copy (each way): {a * 1e3:.3f} ms + {b * 1e3:.4f} ms per block of {swap['block_bytes']} "
                     f"bytes; held-out error mean {e['mean'] * 100:.1f}% p90 {e['p90'] * 100:.1f}% (n={e['n']})")
    share = model["profile"].get("cpu_share")
    if share:
        lines.append(f"the stepping thread ran {share['cpu'] * 100:.0f}% of the steps' wall time and waited "
                     f"for a core {share['runq'] * 100:.0f}% (other processes on this machine)")
    o = model["profile"]["overhead_mean_s"]
    lines.append("mean per step (ms): " + ", ".join(f"{k[:-2]} {v * 1e3:.2f}" for k, v in o.items()))
    return "\n".join(lines)


def engine_section(engine, max_num_batched_tokens: int | None) -> dict:
    """The engine configuration `realexec serve` runs with the profile's flags (the field
    names SimConfig and EngineArgs share; `sim run --cost-model` simulates it by default). `max_num_batched_tokens`
    is the one the flags give (None: serve's default), not the profile grid's chunk."""
    from core.config import default_max_num_batched_tokens
    sched, cache, args = engine.scheduler.config, engine.scheduler.cache_config, engine.args
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(sched.enable_chunked_prefill, sched.max_model_len)
    return {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "max_model_len": sched.max_model_len, "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "enable_chunked_prefill": sched.enable_chunked_prefill,
            "enable_prefix_caching": cache.enable_prefix_caching, "watermark": cache.watermark,
            "swap_space": args.swap_space, "queue_policy": args.queue_policy, "preemption_mode": args.preemption_mode,
            "victim_policy": args.victim_policy, "eviction_policy": args.eviction_policy}


def run(args) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.folds < 2:
        raise ValueError(f"--folds must be >= 2, got {args.folds}")
    engine_args = engine_args_from_namespace(args)
    if engine_args.pipeline_parallel_size > 1:
        raise ValueError("profile times one batch per step; with pipeline-parallel-size > 1 batches overlap "
                         "(profile one stage's layers instead)")
    served_batched = engine_args.max_num_batched_tokens          # what serve would use (None: its default)
    if engine_args.max_num_batched_tokens is None:
        engine_args.max_num_batched_tokens = QUICK_CHUNK if args.quick else FULL_CHUNK
    engine_args.validate()
    from realexec.engine.llm_engine import LLMEngine, freeze_startup_heap, keep_freed_memory

    engine = LLMEngine(engine_args)
    freeze_startup_heap()              # as `serve` does: no full garbage collection inside a timed step
    keep_freed_memory()                # as `serve` does: no page faults for every step's activations
    try:
        print(f"profiling {engine_args.model or 'SmolLM2-135M-Instruct'} "
              f"({'quick' if args.quick else 'full'} grid, {args.repeats} repeats)", file=sys.stderr)
        model = profile(engine, quick=args.quick, repeats=args.repeats, folds=args.folds,
                        time_basis=args.time_basis, log=lambda m: print(m, file=sys.stderr))
        model["engine"] = engine_section(engine, served_batched)
    finally:
        engine.shutdown()
    for phase in PHASES:
        if not any(phase_of(s["seqs"], s["tokens"]) == phase for s in model["samples"]):
            raise ValueError(f"the profile has no {phase} steps")
    check_model(model, args.out)      # the schema `--cost-model` reads (core.cost.schema): never write what it refuses
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(model, f, indent=1)
    print(format_report(model))
    print(f"wrote {len(model['samples'])} samples and the fitted model to {args.out}")
    return 0
