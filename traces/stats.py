"""Summary statistics of a trace (what ``python -m traces stats`` prints)."""
from __future__ import annotations

import statistics

from core.metrics import percentile

from .model import Trace


def summarize(values: list[int]) -> dict[str, float]:
    if not values:                          # an empty trace's lengths print as 0, not nan
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    return {"mean": statistics.fmean(values), "median": percentile(values, 50), "p99": percentile(values, 99)}


def trace_stats(trace: Trace) -> dict:
    """count, duration (s, first to last arrival), rate (req/s: 1 / mean inter-arrival
    gap), and mean/median/p99 of prompt and output lengths."""
    n, duration = len(trace), trace.duration
    return {
        "count": n,
        "duration": duration,
        "rate": (n - 1) / duration if duration > 0 else float("inf") if n > 1 else 0.0,
        "prompt_len": summarize([r.prompt_len for r in trace]),
        "output_len": summarize([r.output_len for r in trace]),
    }


def format_stats(stats: dict) -> str:
    def lengths(s: dict) -> str:
        return f"mean {s['mean']:.1f}, median {s['median']:g}, p99 {s['p99']:g}"

    return "\n".join([
        f"requests:   {stats['count']}",
        f"duration:   {stats['duration']:.3f} s",
        f"rate:       {stats['rate']:.3f} req/s",
        f"prompt_len: {lengths(stats['prompt_len'])}",
        f"output_len: {lengths(stats['output_len'])}",
    ])
