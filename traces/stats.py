"""Summary statistics of a trace (what ``python -m traces stats`` prints)."""
from __future__ import annotations

import statistics

from .model import Trace


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics
    (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(values: list[int]) -> dict[str, float]:
    return {"mean": statistics.fmean(values) if values else 0.0,
            "median": percentile(values, 50), "p99": percentile(values, 99)}


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
