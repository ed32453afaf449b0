"""`python -m sim run TRACE ...` and `python -m sim sweep TRACE --rates ...`.

Bad input (unreadable or malformed trace, unknown model/hardware/policy, impossible
cache sizing, bad flag values) prints `error: ...` on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

from policies import REGISTRY
from sim.engine import DEFAULT_HARDWARE, DEFAULT_MODEL, ResolvedConfig, SimConfig, resolve, simulate
from sim.results import build_summary, format_summary, write_results
from sim.specs import HARDWARE, MODELS
from traces import LOADERS, Trace, TraceError, load_trace

SWEEP_COLUMNS = (
    "rate", "policy", "completed", "rejected", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "mean_ttft", "median_ttft", "p90_ttft", "p99_ttft", "mean_tpot", "median_tpot",
    "p99_tpot", "mean_itl", "p99_itl", "mean_e2el", "median_e2el", "p99_e2el", "mean_normalized_latency",
    "median_normalized_latency", "p99_normalized_latency", "num_preemptions", "num_swaps",
    "prefix_cache_hit_rate", "kv_usage_mean", "kv_usage_max",
)


class UsageError(Exception):
    """Bad input found after argument parsing; reported as `error: ...`, exit 2."""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _fraction(text: str) -> float:
    v = _positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file (twinserve JSON, ShareGPT, Azure/BurstGPT/Vidur CSV, Mooncake JSONL)")
    p.add_argument("--format", default="auto", choices=["auto", *LOADERS], help="trace format (default: auto)")
    g = p.add_argument_group("deployment")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME", help=f"model spec: {', '.join(MODELS)} (default: %(default)s)")
    g.add_argument("--hardware", default=DEFAULT_HARDWARE, metavar="NAME",
                   help=f"accelerator: {', '.join(HARDWARE)} (default: %(default)s)")
    g.add_argument("--tp", type=_positive_int, metavar="N", default=1, help="tensor-parallel degree (default: 1)")
    g.add_argument("--num-gpu-blocks", type=_positive_int, metavar="N", default=None,
                   help="KV blocks in the GPU pool (default: sized from memory like vLLM)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, metavar="F", default=0.9, help="(default: 0.9)")
    g.add_argument("--swap-space-gib", type=_nonneg_float, metavar="GIB", default=4.0,
                   help="CPU swap space per GPU in GiB (default: 4)")
    g.add_argument("--block-size", type=_positive_int, metavar="N", default=16, help="tokens per KV block (default: 16)")
    g.add_argument("--max-num-seqs", type=_positive_int, metavar="N", default=256, help="(default: 256)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N", default=None,
                   help="token budget per step (default: 2048; max(2048, max-model-len) without chunked prefill)")
    g.add_argument("--max-model-len", type=_positive_int, metavar="N", default=None,
                   help="(default: the model's, capped at what the KV cache holds)")
    g.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                   help="schedule each prompt in one step")
    g.add_argument("--enable-prefix-caching", action="store_true", help="reuse cached prompt blocks")
    g = p.add_argument_group("policies")
    for kind, flag in (("queue", "--queue"), ("preemption", "--preemption"), ("victim", "--victim"),
                       ("eviction", "--eviction")):
        names = list(REGISTRY[kind])
        g.add_argument(flag, default=names[0], choices=names, help=f"(default: {names[0]})")
    g = p.add_argument_group("workload")
    g.add_argument("--burstiness", type=_positive_float, metavar="B", default=1.0,
                   help="gamma shape of the gaps with --rate (1 = Poisson; default: 1)")
    g.add_argument("--time-scale", type=_positive_float, metavar="S", default=None,
                   help="multiply the trace's own timestamps (2 = half the rate)")
    g.add_argument("--num-requests", type=_nonneg_int, metavar="N", default=None,
                   help="first N requests (the trace is replayed if N is larger)")
    g.add_argument("--seed", type=int, metavar="S", default=0, help="arrival and beam-model seed (default: 0)")
    g.add_argument("--n", type=_positive_int, metavar="N", default=1, help="parallel samples per request (default: 1)")
    g.add_argument("--beam-width", type=_nonneg_int, metavar="W", default=0, help="beam search width, 0 = off (default: 0)")
    g = p.add_argument_group("simulator")
    g.add_argument("--no-event-skipping", dest="event_skipping", action="store_false",
                   help="run every decode step one by one (slower; same results)")
    g.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sim",
        description="Discrete-event simulation of paged-KV LLM serving: the twinserve core scheduler "
                    "and block manager on a simulated clock priced by a roofline cost model.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,sweep}")
    run = sub.add_parser("run", help="simulate one trace and write results",
                         description="Simulate one trace; writes requests.csv, summary.json and "
                                     "timeseries.csv to --out and prints a summary table.")
    _add_common(run)
    run.add_argument("--rate", type=_positive_float, metavar="R", default=None,
                     help="re-time arrivals to this mean rate in req/s (default: the trace's own times)")
    run.add_argument("--out", default="results/run", metavar="DIR", help="results directory (default: %(default)s)")
    sweep = sub.add_parser("sweep", help="simulate over rates (and policies); one CSV table",
                           description="Run the trace at several request rates (and policy variants) and "
                                       "write one CSV row per run with the key summary columns.")
    _add_common(sweep)
    sweep.add_argument("--rates", required=True, metavar="R1,R2,...", help="comma-separated request rates, e.g. 1,2,4,8")
    sweep.add_argument("--policies", action="append", default=None, metavar="VARIANTS",
                       help="comma-separated policy variants, each KIND=NAME joined by '+', e.g. "
                            "'queue=fcfs,queue=sjf+preemption=swap' (repeatable; default: the flags)")
    sweep.add_argument("--out", default="results/sweep.csv", metavar="CSV", help="CSV table to write (default: %(default)s)")
    sweep.add_argument("--save-runs", default=None, metavar="DIR",
                       help="also write each run's result files under DIR/<rate>-<policy>/")
    return parser


def _config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model, hardware=args.hardware, tp=args.tp, num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, swap_space_gib=args.swap_space_gib,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_chunked_prefill=args.chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        queue=args.queue, preemption=args.preemption, victim=args.victim, eviction=args.eviction,
        n=args.n, beam_width=args.beam_width, seed=args.seed, event_skipping=args.event_skipping)


def _resolve(config: SimConfig) -> ResolvedConfig:
    try:
        return resolve(config)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _load(args: argparse.Namespace, rate: float | None) -> Trace:
    if rate is not None and args.time_scale is not None:
        raise UsageError("give --rate or --time-scale, not both")
    if args.burstiness != 1.0 and rate is None:
        raise UsageError("--burstiness needs --rate")
    try:
        trace = load_trace(args.trace, args.format, rate=rate, burstiness=args.burstiness,
                           time_scale=args.time_scale, num_requests=args.num_requests, seed=args.seed)
    except TraceError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:                # re-timing options
        raise UsageError(f"{args.trace}: {e}") from None
    if not trace.requests:
        raise UsageError(f"{args.trace}: the trace has no requests")
    return trace


def cmd_run(args: argparse.Namespace) -> int:
    resolved = _resolve(_config(args))
    trace = _load(args, args.rate)
    started = time.perf_counter()
    result = simulate(resolved, trace, progress=not args.quiet)
    wall = time.perf_counter() - started
    summary = write_results(result, args.out)
    print(format_summary(summary))
    print(f"results in {args.out}/ (simulated in {wall:.2f} s wall)")
    return 0


def parse_policies(specs: list[str] | None) -> list[tuple[str, dict[str, str]]]:
    """'queue=fcfs,queue=sjf+preemption=swap' -> [(label, {kind: name}), ...]."""
    if not specs:
        return [("", {})]
    variants = []
    for spec in specs:
        for variant in spec.split(","):
            variant = variant.strip()
            if not variant:
                continue
            settings = {}
            for item in variant.split("+"):
                kind, sep, name = item.partition("=")
                kind, name = kind.strip(), name.strip()
                if not sep or kind not in REGISTRY:
                    raise UsageError(f"--policies: expected KIND=NAME with KIND one of {', '.join(REGISTRY)}, "
                                     f"got {item!r}")
                if name.lower() not in REGISTRY[kind]:
                    raise UsageError(f"--policies: unknown {kind} policy {name!r}; choose from: "
                                     f"{', '.join(REGISTRY[kind])}")
                settings[kind] = name.lower()
            variants.append((variant, settings))
    if not variants:
        raise UsageError("--policies: no policy variant given")
    return variants


def parse_rates(text: str) -> list[float]:
    rates = []
    for item in text.split(","):
        try:
            rates.append(_positive_float(item.strip()))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"--rates: {item.strip()!r}: {e}") from None
    return rates


def cmd_sweep(args: argparse.Namespace) -> int:
    rates = parse_rates(args.rates)
    variants = parse_policies(args.policies)
    base = _config(args)
    runs = []
    for label, settings in variants:
        runs.append((label, _resolve(replace(base, **settings))))
    traces = {rate: _load(args, rate) for rate in rates}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for rate, (label, resolved) in itertools.product(rates, runs):
        if not args.quiet:
            print(f"rate {rate:g} req/s{', ' + label if label else ''} ...", file=sys.stderr)
        result = simulate(resolved, traces[rate], progress=not args.quiet)
        if args.save_runs:
            name = f"rate{rate:g}" + (f"-{label.replace('=', '_').replace('+', '-')}" if label else "")
            summary = write_results(result, Path(args.save_runs) / name)
        else:
            summary = build_summary(result)
        row = {"rate": rate, "policy": label or "/".join(
            f"{summary['config'][k]}" for k in ("queue", "preemption", "victim", "eviction"))}
        row.update({k: summary.get(k) for k in SWEEP_COLUMNS[2:]})
        rows.append(row)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWEEP_COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    for row in rows:
        print(f"rate {row['rate']:>6g}  {row['policy']:<28} {row['request_throughput']:8.2f} req/s  "
              f"TTFT p99 {_fmt_ms(row['p99_ttft'])}  TPOT mean {_fmt_ms(row['mean_tpot'])}  "
              f"norm {_fmt_ms(row['mean_normalized_latency'])}/tok  preempt {row['num_preemptions']}")
    print(f"wrote {out}")
    return 0


def _fmt_ms(v) -> str:
    return "      -" if v is None else f"{v * 1e3:7.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return cmd_run(args) if args.command == "run" else cmd_sweep(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                     # e.g. the results directory cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
