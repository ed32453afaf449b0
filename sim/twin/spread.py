"""`python -m sim.twin.spread DIR...`: how reproducible a twin session's errors are, by
slice size and by rounds, from sessions of `python -m sim.twin.tables` already served.

A p90 over 10 requests is one request: a session's error on it moves with that request.
This command asks, on the sessions given, what a session would have reported with fewer
requests per run or fewer rounds: per scenario, for the first k requests of every
validation run (k up to the slice served; requests arrive in the same order, so the first
10 of a 30-request run are the 10-request slice at the same load, next to a few more
later arrivals) and for every choice of r of a session's rounds, the session's error (the
mean of those rounds' predictions against the mean of their real runs, each over its
first k requests). Printed per metric: the root mean square and the largest |error| over
all sessions and choices (what one session reports, typically and at worst), and the
share of them that meet the issue's target. Reads each session's <scenario>/report.json
(per-request latencies, written by twin_tables); serves and simulates nothing. Also prints
each session's error and the pooled one (all sessions' rounds together).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

METRICS = [f"{q}_{m}" for m in ("ttft", "tpot", "e2el") for q in ("median", "p90")]


def target(metric: str) -> float:
    """The issue's bound on |error|: 5% for medians, 10% for p90s."""
    return 0.10 if metric.startswith("p90") else 0.05


def session_errors(report: dict, k: int, rounds: int) -> list[dict[str, float]]:
    """The session's error per metric over its validation runs' first `k` requests, for
    every choice of `rounds` of its rounds."""
    from sim.twin.validate import first_requests_stats, mean_stats, rel_errors

    def predicted(lat: dict) -> dict[str, float]:          # the mean over the jitter draws, if any
        return mean_stats([first_requests_stats(d, k) for d in lat.get("sim_draws") or [lat["sim"]]])

    per_round = [(first_requests_stats(r["latencies"]["real"], k), predicted(r["latencies"]))
                 for r in report["rounds"]]
    out = []
    for chosen in itertools.combinations(per_round, rounds):
        out.append(rel_errors(mean_stats([s for _, s in chosen]), mean_stats([r for r, _ in chosen])))
    return out


def spread(reports: list[dict], k: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per metric over all sessions and choices of rounds: rms, max |error| and the share
    within the target."""
    errs = [e for rep in reports for e in session_errors(rep, k, rounds)]
    return {m: {"rms": math.sqrt(sum(e[m] ** 2 for e in errs) / len(errs)), "max": max(abs(e[m]) for e in errs),
                "met": sum(abs(e[m]) <= target(m) for e in errs) / len(errs), "n": len(errs)} for m in METRICS}


def slice_sizes(n: int) -> list[int]:
    """First-k sizes to compare: multiples of 10 up to the slice served, and the slice itself."""
    return sorted({k for k in range(10, n + 1, 10)} | {n})


def table(reports: list[dict]) -> str:
    n = min(len(r["rounds"][0]["latencies"]["real"]) for r in reports)
    most = min(len(r["rounds"]) for r in reports)
    head = ["first k requests", "rounds", "choices"] + [f"{m} rms / max (met)" for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in slice_sizes(n):
        for r in range(1, most + 1):
            s = spread(reports, k, r)
            lines.append(f"| {k} | {r} | {s[METRICS[0]]['n']} | " + " | ".join(
                f"{s[m]['rms'] * 100:.1f} / {s[m]['max'] * 100:.1f}% ({s[m]['met'] * 100:.0f}%)" for m in METRICS)
                + " |")
    return "\n".join(lines)


def pooled_table(names: list[str], reports: list[dict]) -> str:
    """Per metric each session's error (its rounds' mean prediction against its real runs'
    mean) and the pooled one (every round's prediction against every real run), each with
    the real runs' noise (largest distance from their mean; pooled, it holds the drift
    between sessions); where every session has it, next to it the error at the validation
    runs' own speed (twin_tables' host-term oracle: what is left is the model's)."""
    from sim.twin.validate import mean_stats, rel_errors, run_noise

    at_speed = all(r.get("at_run_speed") for r in reports)
    cols = [(n, r["sim"], r.get("at_run_speed"), r["real"]) for n, r in zip(names, reports)]
    cols.append((f"pooled, {sum(len(r['real']) for r in reports)} rounds", [s for r in reports for s in r["sim"]],
                 [s for r in reports for s in r.get("at_run_speed") or []], [x for r in reports for x in r["real"]]))
    lines = ["| metric | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for m in ["output_throughput"] + METRICS:
        cells = []
        for _, sim, oracle, real in cols:
            ref = mean_stats(real)
            err, noise = rel_errors(mean_stats(sim), ref)[m], run_noise(real)[m]
            both = f"{err * 100:+.1f}"
            if at_speed:
                both += f" \\| {rel_errors(mean_stats(oracle), ref)[m] * 100:+.1f}"
            cells.append(f"{both}% ({noise * 100:.1f})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.twin.spread", description=__doc__.split("\n\n")[0])
    p.add_argument("sessions", nargs="+", metavar="DIR", help="twin_tables output folders")
    p.add_argument("--scenarios", nargs="+", default=["light", "queueing"])
    args = p.parse_args(argv)
    for name in args.scenarios:
        reports = []
        for d in args.sessions:
            path = Path(d) / name / "report.json"
            if not path.exists():
                p.error(f"{path}: no report (run `python -m sim.twin.tables --out {d}` first)")
            rep = json.loads(path.read_text())
            if not rep["rounds"] or "latencies" not in rep["rounds"][0]:
                p.error(f"{path}: no per-request latencies (written by twin_tables since twin14d; "
                        f"`--reuse-real` rewrites it)")
            reports.append(rep)
        print(f"**{name}** ({len(reports)} sessions): a session's error over its runs' first k requests and r of "
              f"its rounds, rms / largest |error| over sessions and choices of rounds (share within the target)\n")
        print(table(reports) + "\n")
        print(f"**{name}**: error of the mean prediction against the mean real run | the same at the validation "
              f"runs' own speed, where recorded (noise: the real runs' largest distance from their mean, %)\n")
        print(pooled_table([Path(d).name for d in args.sessions], reports) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
