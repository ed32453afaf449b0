"""Cost of the core's hot path: schedule() + update() per decode step.

    python -m core.bench [--seqs 64,256,1024] [--steps 200] [--pp 2 | --async-scheduling]

Runs a steady decode batch (every sequence decoding, blocks of 16) with a trivial
executor, with prefix caching off and on, and prints microseconds per step and per
running sequence. The executor's own cost (building the token dict) is measured
separately and excluded. `--pp P` keeps P batches in flight (pipeline parallelism:
max_num_seqs = seqs / P per batch, each batch updated after the next P - 1 are
scheduled), so a step is one batch of seqs / P sequences. `--async-scheduling` keeps 2
batches in flight of every sequence each (each decode is scheduled while the one before
is in flight: the placeholder path).
"""
from __future__ import annotations

import argparse
import time
from collections import deque

from core import CacheConfig, ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig
from policies import PolicySet


def _engine(num_seqs: int, caching: bool, block_size: int = 16, hash_algo: str = "sha256", pp: int = 1,
            async_scheduling: bool = False) -> Scheduler:
    prompt_len, max_tokens = 128, 100_000
    max_model_len = 8192
    blocks = num_seqs * (max_model_len // block_size) // 4 + 64
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_seqs // pp, max_num_batched_tokens=max(num_seqs, 2048) * 2,
                        max_model_len=max_model_len, pipeline_parallel_size=pp, async_scheduling=async_scheduling),
        CacheConfig(block_size=block_size, num_gpu_blocks=blocks, enable_prefix_caching=caching,
                    prefix_caching_hash_algo=hash_algo),
        PolicySet(),
    )
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % 49152 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return sched


def _sample(out) -> ModelRunnerOutput:
    return ModelRunnerOutput(token_ids={s.seq.seq_id: [s.start % 49000 + 1] for s in out.scheduled if s.num_samples})


def measure(num_seqs: int, caching: bool, steps: int, hash_algo: str = "sha256", pp: int = 1,
            async_scheduling: bool = False) -> dict:
    sched = _engine(num_seqs, caching, hash_algo=hash_algo, pp=pp, async_scheduling=async_scheduling)
    if async_scheduling:
        return _measure_pipelined(sched, num_seqs, caching, steps, 2, per_batch=num_seqs)
    if pp > 1:
        return _measure_pipelined(sched, num_seqs, caching, steps, pp)
    # Warm up: admit everything and run a few decode steps.
    warm = 0
    while sched.num_waiting or warm < 5:
        out = sched.schedule()
        sched.update(out, _sample(out))
        warm += 1
    assert sched.num_running == num_seqs, "bench setup: not all sequences running"
    total = sample_time = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        result = _sample(out)
        t2 = time.perf_counter()
        sched.update(out, result)
        t3 = time.perf_counter()
        total += (t1 - t0) + (t3 - t2)
        sample_time += t2 - t1
    per_step = total / steps
    return {"seqs": num_seqs, "caching": caching, "us_per_step": per_step * 1e6,
            "us_per_seq": per_step * 1e6 / num_seqs, "executor_us_per_seq": sample_time / steps * 1e6 / num_seqs}


def _measure_pipelined(sched: Scheduler, num_seqs: int, caching: bool, steps: int, pp: int,
                       per_batch: int | None = None) -> dict:
    """P batches in flight: schedule until P fly, update the oldest; time both calls."""
    flying: deque = deque()
    warm = 0
    while sched.num_waiting or warm < 5 * pp:
        while len(flying) < pp:
            out = sched.schedule()
            if out.is_empty:
                break
            flying.append(out)
        out = flying.popleft()
        sched.update(out, _sample(out))
        warm += 1
    assert sched.num_running == num_seqs, "bench setup: not all sequences running"
    total = sample_time = 0.0
    per_batch = per_batch or num_seqs // pp
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        assert len(out.scheduled) == per_batch, f"bench setup: batches of {len(out.scheduled)}, not {per_batch}"
        flying.append(out)
        oldest = flying.popleft()
        result = _sample(oldest)
        t2 = time.perf_counter()
        sched.update(oldest, result)
        t3 = time.perf_counter()
        total += (t1 - t0) + (t3 - t2)
        sample_time += t2 - t1
    per_step = total / steps
    return {"seqs": num_seqs, "caching": caching, "us_per_step": per_step * 1e6,
            "us_per_seq": per_step * 1e6 / per_batch, "executor_us_per_seq": sample_time / steps * 1e6 / per_batch}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m core.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hash-algo", default="sha256", help="prefix-cache block hash: sha256 | builtin [sha256]")
    ap.add_argument("--pp", type=int, default=1, help="batches in flight (pipeline stages) [1]")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="2 batches in flight, every sequence in each (decodes scheduled ahead)")
    args = ap.parse_args(argv)
    if args.pp < 1:
        ap.error(f"--pp must be >= 1, got {args.pp}")
    if args.async_scheduling and args.pp > 1:
        ap.error("--async-scheduling runs one stage: drop --pp")
    target = 10.0
    print(f"{'running seqs':>12} {'prefix cache':>12} {'us/step':>10} {'us/seq/step':>12} {'vs target':>10}")
    for n in (int(x) for x in args.seqs.split(",")):
        for caching in (False, True):
            r = measure(n, caching, args.steps, args.hash_algo, args.pp, args.async_scheduling)
            print(f"{n:>12} {'on' if caching else 'off':>12} {r['us_per_step']:>10.1f} {r['us_per_seq']:>12.2f} "
                  f"{r['us_per_seq'] / target:>9.2f}x")
    print(f"target: <= {target:.0f} us per running sequence per decode step (schedule + update)")
    if args.pp > 1:
        print(f"--pp {args.pp}: {args.pp} batches in flight; a step is one batch of seqs / {args.pp} sequences, "
              f"us/seq/step per sequence of that batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
