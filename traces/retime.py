"""Re-timing a loaded trace: resize it, rescale its clock or draw new arrivals."""
from __future__ import annotations

import random
from dataclasses import replace

from .model import Trace, TraceRequest, finalize


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` arrival times starting at 0 with mean rate ``rate`` (req/s): Poisson
    (exponential gaps) when ``burstiness == 1``, else gamma gaps with shape
    ``burstiness`` and the same mean (< 1: burstier, > 1: more regular), as in
    vLLM's ``bench serve --burstiness``."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    return times


def replay(requests: list[TraceRequest], n: int) -> list[TraceRequest]:
    """The first ``n`` requests, or, if ``n`` is larger, the trace played again and
    again: copy k starts one mean inter-arrival gap after copy k-1 ends (1 s for a
    one-request trace) and its ids get a ``#k`` suffix."""
    if n <= len(requests):
        return requests[:n]
    if not requests:
        raise ValueError("cannot replay an empty trace")
    duration = requests[-1].arrival_time - requests[0].arrival_time
    period = duration + (duration / (len(requests) - 1) if len(requests) > 1 else 1.0)
    out = []
    for i in range(n):
        copy, r = divmod(i, len(requests))
        base = requests[r]
        out.append(base if copy == 0 else replace(
            base, request_id=f"{base.request_id}#{copy}", arrival_time=base.arrival_time + copy * period))
    return out


def retime(trace: Trace, rate: float | None = None, burstiness: float = 1.0, time_scale: float | None = None,
           num_requests: int | None = None, seed: int = 0) -> Trace:
    """Return a re-timed copy of ``trace`` (the order of requests is kept):

    - ``num_requests``: keep the first N, or replay the trace to reach N (see ``replay``);
    - ``rate``: new arrivals at this mean rate, see ``arrival_times`` (``burstiness``,
      ``seed``);
    - ``time_scale``: multiply the original timestamps (2 = half the rate).
    ``rate`` and ``time_scale`` exclude each other. Arrivals stay sorted from 0.
    """
    if rate is not None and time_scale is not None:
        raise ValueError("give rate or time_scale, not both")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if burstiness != 1.0 and rate is None:
        raise ValueError("burstiness needs a rate")
    if time_scale is not None and not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")

    requests, steps = list(trace.requests), []
    if num_requests is not None:
        requests = replay(requests, num_requests)
        steps.append(f"num_requests={num_requests}")
    if rate is not None:
        times = arrival_times(len(requests), rate, burstiness, seed)
        steps.append(f"{'Poisson' if burstiness == 1.0 else f'gamma(shape={burstiness:g})'} arrivals "
                     f"at {rate:g} req/s, seed {seed}")
    elif time_scale is not None:
        times = [r.arrival_time * time_scale for r in requests]
        steps.append(f"time_scale={time_scale:g}")
    else:
        times = [r.arrival_time for r in requests]
    retimed = [replace(r, arrival_time=t) for r, t in zip(requests, times)]
    source = trace.source + (f" | retimed: {', '.join(steps)}" if steps else "")
    return finalize(retimed, source)
