"""`python -m sim run TRACE ...`, `python -m sim sweep TRACE --rates ...`,
`python -m sim compare TRACE --policies ... --rates ...` and `python -m sim sharing TRACE`.

Bad input (unreadable or malformed trace, unknown model/hardware/policy, impossible
cache sizing, bad flag values) prints `error: ...` on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

from policies import REGISTRY
from sim.explore import compare, search
from sim.twin import calibrate, replay, validate
from sim.config import (SimConfig, add_config_args, config_from_args, nonneg_float, nonneg_int, positive_float,
                        positive_int, with_measured_engine)
from sim.engine import ResolvedConfig, resolve, with_fitting_hardware
from sim.run import simulate
from sim.results import build_summary, format_summary, reject_lines, write_results
from sim.workloads import apply_workload
from traces import LOADERS, Trace, TraceError, load_trace

SWEEP_COLUMNS = (
    "rate", "policy", "completed", "rejected", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "mean_ttft", "median_ttft", "p90_ttft", "p99_ttft", "mean_tpot", "median_tpot",
    "p99_tpot", "mean_itl", "p99_itl", "mean_e2el", "median_e2el", "p99_e2el", "mean_normalized_latency",
    "median_normalized_latency", "p99_normalized_latency", "num_preemptions", "num_swaps",
    "prefix_cache_hit_rate", "kv_usage_mean", "kv_usage_max",
    "token_states_share", "reserved_share", "internal_frag_share", "external_frag_share", "sharing_saving",
)


DEFAULT_RUN_DIR = "results/run"


class UsageError(Exception):
    """Bad input found after argument parsing; reported as `error: ...`, exit 2."""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file (twinserve JSON, ShareGPT, Azure/BurstGPT/Vidur CSV, Mooncake JSONL)")
    p.add_argument("--format", default="auto", choices=["auto", *LOADERS], help="trace format (default: auto)")
    groups = add_config_args(p)          # deployment, policies, workload (n, beam width, seed), simulator
    g = groups["workload"]
    g.add_argument("--burstiness", type=positive_float, metavar="B", default=1.0,
                   help="gamma shape of the gaps with --rate (1 = Poisson; default: 1)")
    g.add_argument("--time-scale", type=positive_float, metavar="S", default=None,
                   help="multiply the trace's own timestamps (2 = half the rate)")
    g.add_argument("--num-requests", type=positive_int, metavar="N", default=None,
                   help="first N requests (the trace is replayed if N is larger)")
    g.add_argument("--shared-prefix-len", type=nonneg_int, metavar="L", default=0,
                   help="prepend one L-token system prompt (identical token ids) to every request / "
                        "conversation (the paper used 80 and 341; default: 0 = off)")
    g.add_argument("--multi-turn", action="store_true",
                   help="group consecutive requests into conversations: a turn's prompt carries the previous "
                        "turn's prompt + output; it arrives when that turn has finished (see sim/workloads.py)")
    g.add_argument("--max-turns", type=positive_int, metavar="K", default=4,
                   help="--multi-turn: conversations of 2..K turns (default: 4)")
    g.add_argument("--think-time", type=nonneg_float, metavar="S", default=0.0,
                   help="--multi-turn: seconds between a turn's finish and the next turn (default: 0)")
    g = groups["simulator"]
    g.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sim",
        description="Discrete-event simulation of paged-KV LLM serving: the twinserve core scheduler "
                    "and block manager on a simulated clock priced by a roofline cost model.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,sweep,compare,sharing,search,replay,validate,calibrate}")
    run = sub.add_parser("run", help="simulate one trace and write results",
                         description="Simulate one trace; writes requests.csv, summary.json and "
                                     "timeseries.csv to --out and prints a summary table.")
    _add_common(run)
    run.add_argument("--rate", type=positive_float, metavar="R", default=None,
                     help="re-time arrivals to this mean rate in req/s (default: the trace's own times)")
    run.add_argument("--out", default=None, metavar="DIR",
                     help=f"results directory (default: {DEFAULT_RUN_DIR}/, or the first free {DEFAULT_RUN_DIR}-N/ "
                          f"when it holds an earlier run); an existing DIR with results is refused unless "
                          f"--overwrite")
    run.add_argument("--overwrite", action="store_true", help="write over the results already in --out DIR")
    run.add_argument("--plot", action="store_true",
                     help="also write latency_cdfs.png, batch_size.png and kv_usage.png into the results directory")
    _add_fleet(run)
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
    _add_ray(sweep)

    cmp = sub.add_parser("compare", help="compare policies over request rates: table, CSV, plots",
                         description="Run the trace at each rate under each policy and print a comparison "
                                     "table (throughput, normalized latency, TTFT, TPOT, preemptions, the KV "
                                     "memory breakdown, prefix hit rate) and the highest rate each policy "
                                     "sustains under a normalized-latency bound; write it as CSV.")
    _add_common(cmp)
    cmp.add_argument("--policies", action="append", required=True, metavar="VARIANTS",
                     help="comma-separated policies: registry names (paged,orca-oracle,orca-pow2,orca-max), "
                          "KIND=NAME items joined by '+' (allocation=orca-max, queue=sjf+preemption=swap), "
                          "prefix-caching; the flags give everything a variant does not name (repeatable)")
    cmp.add_argument("--rates", required=True, metavar="R1,R2,...", help="comma-separated request rates (req/s)")
    cmp.add_argument("--latency-bound", type=positive_float, metavar="S", default=None,
                     help="normalized-latency bound (s/token) for the sustainable-rate table "
                          "(default: 4x the lowest mean normalized latency in the grid)")
    cmp.add_argument("--out", default="results/compare.csv", metavar="CSV", help="CSV to write (default: %(default)s)")
    cmp.add_argument("--plot", default=None, metavar="DIR",
                     help="write latency_vs_rate.png and memory_breakdown.png (at the highest rate) to DIR")
    cmp.add_argument("--save-runs", default=None, metavar="DIR",
                     help="also write each run's result files under DIR/rate<R>-<policy>/")

    sh = sub.add_parser("sharing", help="KV memory saved by sharing: parallel sampling, beam search, shared prefix",
                        description="Blocks saved by sharing = 1 - (GPU blocks in use) / (sum of block-table "
                                    "lengths, i.e. the blocks the same sequences would hold without sharing), "
                                    "time-integrated over each run; for a shared prefix also the throughput "
                                    "with vs without prefix caching. Paged allocation.")
    _add_common(sh)
    sh.add_argument("--rate", type=positive_float, metavar="R", default=None,
                    help="re-time arrivals to this rate (default: the trace's own times)")
    sh.add_argument("--ns", default="2,4,6", metavar="N1,N2,...", help="parallel samples (default: %(default)s; '' = none)")
    sh.add_argument("--beam-widths", default="2,4,6", metavar="W1,...", help="beam widths (default: %(default)s)")
    sh.add_argument("--prefix-lens", default="80,341", metavar="L1,...",
                    help="shared system prompt lengths (default: %(default)s)")
    sh.add_argument("--out", default="results/sharing.csv", metavar="CSV", help="CSV to write (default: %(default)s)")
    sh.add_argument("--plot", default=None, metavar="DIR", help="write sharing_savings.png to DIR")
    search.add_parser(sub)
    replay.add_parser(sub)
    validate.add_parser(sub)
    calibrate.add_parser(sub)
    return parser


def _add_fleet(p: argparse.ArgumentParser) -> None:
    from sim.cluster.disagg import LINKS
    g = p.add_argument_group("fleet (sim.cluster.fleet, sim.cluster.disagg)")
    g.add_argument("--replicas", type=positive_int, metavar="N", default=1,
                   help="N replicas of the deployment behind --router, on one clock (default: 1)")
    g.add_argument("--router", default=None, choices=list(REGISTRY["router"]),
                   help="which replica takes each request (default: round-robin)")
    g.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="P prefill and D decode replicas; the KV moves over --link (replaces --replicas)")
    g.add_argument("--link", default="nvlink", choices=list(LINKS),
                   help="--disaggregate: KV transfer link preset (default: nvlink)")
    g.add_argument("--link-bandwidth", type=positive_float, metavar="GBPS", default=None,
                   help="--disaggregate: link bandwidth in GB/s per GPU (default: the preset's)")
    g.add_argument("--slo-ttft", type=positive_float, metavar="S", default=None,
                   help="fleet runs: report goodput, requests meeting TTFT <= S and --slo-tpot")
    g.add_argument("--slo-tpot", type=positive_float, metavar="S", default=None, help="(see --slo-ttft)")


def _add_ray(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true", help="run the points as Ray tasks (local cores by default)")
    p.add_argument("--ray-address", default=None, metavar="ADDR", help="an existing Ray cluster (implies --ray)")


def _config(args: argparse.Namespace) -> SimConfig:
    """The flags' SimConfig; with --cost-model, the engine it was measured on fills the
    flags not given (a given one that differs is named in a warning)."""
    try:
        explicit = getattr(args, "explicit", None)
        return with_fitting_hardware(with_measured_engine(config_from_args(args), explicit), explicit)
    except ValueError as e:
        raise UsageError(str(e)) from None


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The SimConfig fields the command line `argv` (command first) gives a value: the
    command's parser run again over a namespace pre-filled with a marker (argparse only
    fills in defaults that a namespace lacks)."""
    import dataclasses
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = action.choices[argv[0]]
    unset = object()
    fields = {f.name for f in dataclasses.fields(SimConfig)}
    ns = argparse.Namespace(**{a.dest: unset for a in sub._actions if a.dest in fields})
    with contextlib.redirect_stderr(io.StringIO()):    # the first parse said it all (deprecated spellings)
        sub.parse_args(argv[1:], namespace=ns)
    return {k for k, v in vars(ns).items() if v is not unset}


def _resolve(config: SimConfig) -> ResolvedConfig:
    try:
        return resolve(config)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _load(args: argparse.Namespace, rate: float | None, max_model_len: int | None = None,
          shared_prefix_len: int | None = None) -> Trace:
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
    if not args.multi_turn and (args.max_turns != 4 or args.think_time):
        raise UsageError("--max-turns and --think-time need --multi-turn")
    try:
        return apply_workload(trace, shared_prefix_len=args.shared_prefix_len if shared_prefix_len is None
                              else shared_prefix_len, multi_turn=args.multi_turn, max_turns=args.max_turns,
                              think_time=args.think_time, seed=args.seed, max_model_len=max_model_len)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run_dir(out: str | None, overwrite: bool) -> Path:
    """Where `sim run` writes. Like Vidur (a fresh directory per run) the default never
    overwrites: results/run/, else the first free results/run-N/. A directory the user
    names is theirs: refused if it holds results, unless --overwrite."""
    def used(path: Path) -> bool:
        return path.exists() and (not path.is_dir() or any(path.iterdir()))
    if out is not None:
        path = Path(out)
        if path.exists() and not path.is_dir():
            raise UsageError(f"--out {out}: is a file, not a directory")
        if used(path) and not overwrite:
            raise UsageError(f"--out {out}: already holds results; add --overwrite to replace them, or name "
                             f"another directory")
        return path
    path, n = Path(DEFAULT_RUN_DIR), 1
    while used(path) and not overwrite:
        n += 1
        path = Path(f"{DEFAULT_RUN_DIR}-{n}")
    if n > 1:
        print(f"note: {DEFAULT_RUN_DIR}/ holds an earlier run; writing {path}/ (--out DIR to choose)", file=sys.stderr)
    return path


def _finish_run(args: argparse.Namespace, out: Path, summary: dict, text: str, wall: float) -> int:
    print(text)
    for line in reject_lines(summary):       # why requests were rejected, and what to change
        print(line)
    if args.plot:
        from plots import figures          # matplotlib only when asked (never from the engine)
        title = f"{Path(args.trace).name}: {text.splitlines()[0].split(':')[0].removesuffix(', each')}"
        for path in figures.run_figures(out, title=title):
            print(f"wrote {path}")
    print(f"results in {out}/ (simulated in {wall:.2f} s wall)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    out = run_dir(args.out, args.overwrite)
    resolved = _resolve(_config(args))
    trace = _load(args, args.rate, resolved.scheduler.max_model_len)
    if args.replicas > 1 or args.router or args.disaggregate:
        if resolved.config.pipeline_parallel_size > 1:
            raise UsageError("--pipeline-parallel-size simulates one pipelined replica; fleets (--replicas, --router, --disaggregate) "
                             "run one-stage replicas only")
        if resolved.config.async_scheduling:
            raise UsageError("--async-scheduling simulates one replica; fleets (--replicas, --router, --disaggregate) "
                             "run replicas that schedule one step at a time")
        return _run_fleet(args, resolved, trace, out)
    if args.slo_ttft or args.slo_tpot:
        raise UsageError("--slo-ttft/--slo-tpot report a fleet's goodput: add --replicas, --router or --disaggregate")
    started = time.perf_counter()
    result = simulate(resolved, trace, progress=not args.quiet)
    wall = time.perf_counter() - started
    summary = write_results(result, out)
    return _finish_run(args, out, summary, format_summary(summary), wall)


def _run_fleet(args: argparse.Namespace, resolved: ResolvedConfig, trace: Trace, out: Path) -> int:
    from sim.cluster.disagg import DisaggConfig, DisaggFleet, parse_split
    from sim.cluster.fleet import Fleet, FleetConfig, format_fleet_summary, write_fleet_results
    if (args.slo_ttft is None) != (args.slo_tpot is None):
        raise UsageError("give both --slo-ttft and --slo-tpot")
    slo = (args.slo_ttft, args.slo_tpot) if args.slo_ttft else None
    try:
        if args.disaggregate:
            if args.replicas > 1:
                raise ValueError("--disaggregate P:D sets the replica counts; drop --replicas")
            p, d = parse_split(args.disaggregate)
            dconf = DisaggConfig(resolved.config, p, d, args.link, args.link_bandwidth, args.router or "round-robin")
            fleet = DisaggFleet(dconf, trace, progress=not args.quiet)
        else:
            fleet = Fleet(FleetConfig(resolved.config, args.replicas, args.router or "round-robin"), trace,
                          progress=not args.quiet, resolved=resolved)
    except ValueError as e:
        raise UsageError(str(e)) from None
    started = time.perf_counter()
    result = fleet.run()
    wall = time.perf_counter() - started
    summary = write_fleet_results(result, out, slo)
    return _finish_run(args, out, summary, format_fleet_summary(summary), wall)


def parse_policies(specs: list[str] | None) -> list[tuple[str, dict[str, str]]]:
    """'queue=fcfs,queue=sjf+preemption=swap,orca-max' -> [(label, overrides), ...] (sim.explore.compare)."""
    if not specs:
        return [("", {})]
    try:
        variants = compare.parse_variants(specs)
    except compare.VariantError as e:
        raise UsageError(f"--policies: {e}") from None
    if not variants:
        raise UsageError("--policies: no policy variant given")
    return variants


def parse_rates(text: str) -> list[float]:
    rates = []
    for item in text.split(","):
        try:
            rates.append(positive_float(item.strip()))
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
    traces = {rate: _load(args, rate, runs[0][1].scheduler.max_model_len) for rate in rates}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    points = []
    for rate, (label, resolved) in itertools.product(rates, runs):
        name = f"rate{rate:g}" + (f"-{label.replace('=', '_').replace('+', '-')}" if label else "")
        points.append((resolved, traces[rate], str(Path(args.save_runs) / name) if args.save_runs else None))
    from sim.explore.points import run_points
    summaries = run_points(sweep_point, points, use_ray=args.ray or bool(args.ray_address),
                           ray_address=args.ray_address, desc="sweep", progress=not args.quiet)
    for (rate, (label, _)), summary in zip(itertools.product(rates, runs), summaries):
        row = {"rate": rate, "policy": label or "/".join(
            f"{summary['config'][k]}" for k in ("queue_policy", "preemption_mode", "victim_policy", "eviction_policy"))}
        row.update({k: summary.get(k) for k in SWEEP_COLUMNS[2:]})
        extra = compare.row_from_summary(summary, rate, row["policy"])
        row.update({k: extra[k] for k in SWEEP_COLUMNS[-5:]})
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


def sweep_point(resolved: ResolvedConfig, trace: Trace, save_dir: str | None) -> dict:
    """One sweep run (a Ray task with --ray): its summary, and its result files if asked."""
    result = simulate(resolved, trace)
    return write_results(result, save_dir) if save_dir else build_summary(result)


def _write_csv(path: str | Path, columns, rows: list[dict]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    return out


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{flag}: values must be >= 1, got {text!r}")
    return values


def cmd_compare(args: argparse.Namespace) -> int:
    rates = parse_rates(args.rates)
    variants = parse_policies(args.policies)
    base = _config(args)
    try:
        configs = compare.variant_configs(base, variants)
    except ValueError as e:
        raise UsageError(str(e)) from None
    max_len = _resolve(configs[0][1]).scheduler.max_model_len
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))

    def save(rate, label, result):
        if args.save_runs:
            write_results(result, Path(args.save_runs) / f"rate{rate:g}-{label.replace('=', '_').replace('+', '-')}")

    rows = compare.run_grid(base, variants, rates, lambda r: _load(args, r, max_len), on_run=save, progress=log)
    out = _write_csv(args.out, compare.COMPARE_COLUMNS, rows)
    print(compare.format_table(rows))
    lat = [r["mean_normalized_latency"] for r in rows if r.get("mean_normalized_latency") is not None]
    bound = args.latency_bound or (4 * min(lat) if lat else None)
    if bound:
        print()
        print(compare.format_sustainable(rows, bound))
    if args.plot:
        compare.plot_comparison(rows, args.plot, config=base, trace=args.trace, bound=bound)
        print(f"plots in {args.plot}/")
    print(f"wrote {out}")
    return 0


def cmd_sharing(args: argparse.Namespace) -> int:
    if args.allocation != "paged":
        raise UsageError("sharing measures paged allocation (orca-* regions share nothing); drop --allocation")
    if args.n != 1 or args.beam_width or args.shared_prefix_len:
        raise UsageError("sharing sets --n, --beam-width and --shared-prefix-len itself: use --ns, "
                         "--beam-widths and --prefix-lens")
    ns, widths, lens = _ints(args.ns, "--ns"), _ints(args.beam_widths, "--beam-widths"), \
        _ints(args.prefix_lens, "--prefix-lens")
    base = replace(_config(args), allocation="paged")
    resolved = _resolve(base)
    max_len = resolved.scheduler.max_model_len
    trace = _load(args, args.rate, max_len)
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    try:
        rows = compare.sharing_rows(base, trace, ns=ns, beam_widths=widths, prefix_lens=lens,
                                    prefix_trace=lambda L: _load(args, args.rate, max_len, shared_prefix_len=L),
                                    progress=log)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = _write_csv(args.out, compare.SHARING_COLUMNS, rows)
    print(compare.format_sharing(rows))
    if args.plot:
        from plots import figures
        figures.sharing_savings(rows, Path(args.plot) / "sharing_savings.png")
        print(f"plots in {args.plot}/")
    print(f"wrote {out}")
    return 0


def _cmd_search(args: argparse.Namespace) -> int:
    try:
        return search.cmd_search(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _cmd_replay(args: argparse.Namespace) -> int:
    try:
        return replay.cmd_replay(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        return validate.cmd_validate(args)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None


def _cmd_calibrate(args: argparse.Namespace) -> int:
    try:
        return calibrate.cmd_calibrate(args)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None


def _fmt_ms(v) -> str:
    return "      -" if v is None else f"{v * 1e3:7.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.explicit = explicit_dests(parser, argv)
    try:
        return {"run": cmd_run, "sweep": cmd_sweep, "compare": cmd_compare, "sharing": cmd_sharing,
                "search": _cmd_search, "replay": _cmd_replay,
                "validate": _cmd_validate, "calibrate": _cmd_calibrate}[args.command](args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                     # e.g. the results directory cannot be written
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
