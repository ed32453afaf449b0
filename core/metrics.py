"""Serving metrics shared by the simulator and the real server.

Names follow vLLM's `bench serve` (ttft, tpot, itl, e2el; mean/median/p99) and its
Prometheus metrics. Pure Python so the core stays dependency-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from core.sched.request import Request, RequestStatus


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values`, interpolated linearly between the
    two nearest order statistics: numpy's default (`numpy.percentile(values, q)`, method
    "linear"), the definition vLLM's `bench serve` reports. This is the project's one
    percentile; every p50/p90/p99 goes through it.

    `values` need not be sorted (an already sorted list is sorted again in O(n)).
    No values gives NaN (numpy warns and gives NaN too): a statistic of nothing is not
    zero. q outside [0, 100] or NaN is a ValueError.
    """
    if not 0.0 <= q <= 100.0:               # also refuses NaN
        raise ValueError(f"percentile: q must be in [0, 100], got {q!r}")
    v = sorted(values)
    if not v:
        return float("nan")
    # numpy's arithmetic, step by step, so results agree to the last bit: the virtual
    # index (n - 1) * q/100, and a lerp taken from the nearer end (monotone in q).
    k = (len(v) - 1) * (q / 100.0)
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    t = k - lo
    a, b = v[lo], v[hi]
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def describe(values: Iterable[float], percentiles=(50, 90, 99)) -> dict[str, float]:
    v = sorted(values)
    out = {"mean": (sum(v) / len(v)) if v else float("nan")}
    for p in percentiles:
        out["median" if p == 50 else f"p{p}"] = percentile(v, p)
    return out


@dataclass
class RequestRecord:
    """One finished request, flattened (also a CSV row for the simulator)."""
    request_id: str
    status: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    num_preemptions: int
    num_swaps: int
    queue_time: float
    token_times: list[float]
    reject_reason: str | None = None       # why the scheduler rejected it (core.sched.scheduler._never_fits)

    @classmethod
    def from_request(cls, r: Request) -> "RequestRecord":
        m = r.metrics
        outs = [s.num_output_tokens for s in r.all_seqs()]
        return cls(r.request_id, r.status.value, m.arrival_time, m.first_scheduled_time, m.first_token_time,
                   m.finished_time, r.num_prompt_tokens, max(outs) if outs else 0, m.num_cached_prompt_tokens,
                   m.num_preemptions, m.num_swaps, m.queue_time, m.token_times, r.reject_reason)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2el(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's definition)."""
        if self.num_output_tokens < 2 or self.first_token_time is None or not self.token_times:
            return None
        return (self.token_times[-1] - self.first_token_time) / (len(self.token_times) - 1) \
            if len(self.token_times) > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency per output token (the vLLM paper's s/token)."""
        if self.e2el is None or self.num_output_tokens == 0:
            return None
        return self.e2el / self.num_output_tokens


def summarize(records: list[RequestRecord], duration: float | None = None) -> dict:
    """Aggregate metrics over finished requests (rejected/aborted are counted, not timed)."""
    done = [r for r in records if r.status in (RequestStatus.FINISHED_STOPPED.value,
                                                 RequestStatus.FINISHED_LENGTH.value)]
    if duration is None:
        ends = [r.finished_time for r in done if r.finished_time is not None]
        starts = [r.arrival_time for r in records]
        duration = (max(ends) - min(starts)) if ends and starts else 0.0
    out_tokens = sum(r.num_output_tokens for r in done)
    in_tokens = sum(r.num_prompt_tokens for r in done)
    summary = {
        "completed": len(done),
        "rejected": sum(r.status == RequestStatus.FINISHED_REJECTED.value for r in records),
        "aborted": sum(r.status == RequestStatus.FINISHED_ABORTED.value for r in records),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "num_preemptions": sum(r.num_preemptions for r in records),
        "prefix_cached_prompt_tokens": sum(r.num_cached_prompt_tokens for r in done),
    }
    series = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itls],
        "e2el": [r.e2el for r in done if r.e2el is not None],
        "normalized_latency": [r.normalized_latency for r in done if r.normalized_latency is not None],
    }
    for name, values in series.items():
        for stat, value in describe(values).items():
            summary[f"{stat}_{name}"] = value
    return summary
