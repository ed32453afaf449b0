"""Configuration search: which deployments meet the SLOs at a load, and with how few GPUs.

    python -m sim search TRACE --qps 8 --slo-ttft-p90 0.5 --slo-tpot-p90 0.05 --hardware H100 --max-gpus 8

Enumerates TP degree x replicas x max_num_seqs x chunk size (max_num_batched_tokens),
and with `--disaggregate-splits` every P:D split of the replicas, within `--max-gpus`.
For each point it finds, by binary search over the request rate, the highest QPS at
which the p90 TTFT and p90 TPOT both meet their SLOs (Vidur-Search / DistServe style):
one probe = the trace's first `--num-requests` requests re-timed to that rate (Poisson,
`--seed`) and simulated; a probe with rejected requests fails. A point is feasible when
that capacity reaches `--qps`. Each point costs at most 2 + `--iterations` probes, so
the search is bounded; points run as Ray tasks with `--ray`.

Output: the feasible points ranked by GPUs, then QPS per GPU (a table and `--out` CSV
with every point), and `--plot` a Pareto figure (capacity vs GPUs).
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from core.metrics import summarize
from sim.config import DEFAULT_HARDWARE, DEFAULT_MODEL
from sim.engine import SimConfig, resolve
from sim.run import simulate
from core.cost.specs import HARDWARE, MODELS
from traces import Trace, TraceError, load_trace, retime

SEARCH_COLUMNS = ("label", "tp", "replicas", "prefill", "decode", "max_num_seqs", "max_num_batched_tokens",
                  "gpus", "feasible", "capacity_qps", "qps_per_gpu", "p90_ttft_at_qps", "p90_tpot_at_qps",
                  "probes", "error")


@dataclass(frozen=True)
class SearchPoint:
    tp: int
    replicas: int                  # all replicas (prefill + decode when split)
    max_num_seqs: int
    chunk: int                     # max_num_batched_tokens
    prefill: int = 0               # > 0: disaggregated prefill:decode = prefill:(replicas - prefill)

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    @property
    def label(self) -> str:
        shape = f"{self.prefill}P:{self.replicas - self.prefill}D" if self.prefill else f"{self.replicas}x"
        return f"{shape} TP{self.tp} seqs{self.max_num_seqs} chunk{self.chunk}"


@dataclass
class SearchSpec:
    base: SimConfig
    qps: float
    slo_ttft_p90: float
    slo_tpot_p90: float
    max_gpus: int
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    max_num_seqs: tuple[int, ...] = (64, 256)
    chunks: tuple[int, ...] = (512, 2048)
    disaggregate: bool = False
    router: str = "least-requests"
    num_requests: int = 300
    seed: int = 0
    iterations: int = 5
    max_factor: float = 4.0        # the search looks for capacities up to max_factor x qps

    def validate(self) -> None:
        for name in ("qps", "slo_ttft_p90", "slo_tpot_p90"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
        if self.max_gpus < 1:
            raise ValueError(f"--max-gpus must be >= 1, got {self.max_gpus}")
        if self.num_requests < 1 or self.iterations < 0:
            raise ValueError("--num-requests must be >= 1 and --iterations >= 0")


def enumerate_points(spec: SearchSpec) -> tuple[list[SearchPoint], list[tuple[SearchPoint, str]]]:
    """(points to simulate, [(point, why skipped)]) in a fixed order."""
    points, skipped = [], []
    for tp in spec.tp_degrees:
        for mns in spec.max_num_seqs:
            for chunk in spec.chunks:
                probe = SearchPoint(tp, 1, mns, chunk)
                try:
                    resolve(config_for(spec, probe))
                except ValueError as e:
                    skipped.append((probe, str(e)))
                    continue
                for r in range(1, spec.max_gpus // tp + 1):
                    points.append(SearchPoint(tp, r, mns, chunk))
                    if spec.disaggregate:
                        points.extend(SearchPoint(tp, r, mns, chunk, p) for p in range(1, r))
    points.sort(key=lambda p: (p.gpus, p.tp, p.prefill, p.max_num_seqs, p.chunk))
    return points, skipped


def config_for(spec: SearchSpec, point: SearchPoint) -> SimConfig:
    return replace(spec.base, tensor_parallel_size=point.tp, max_num_seqs=point.max_num_seqs, max_num_batched_tokens=point.chunk)


def probe(spec: SearchSpec, point: SearchPoint, trace: Trace, qps: float) -> tuple[bool, float, float]:
    """Simulate the point at `qps`: (meets both SLOs, p90 TTFT, p90 TPOT)."""
    timed = retime(trace, rate=qps, num_requests=spec.num_requests, seed=spec.seed)
    config = config_for(spec, point)
    if point.prefill:
        from sim.cluster.disagg import DisaggConfig, simulate_disagg
        records = simulate_disagg(DisaggConfig(config, point.prefill, point.replicas - point.prefill,
                                               router=spec.router), timed).records
    elif point.replicas > 1:
        from sim.cluster.fleet import FleetConfig, simulate_fleet
        records = simulate_fleet(FleetConfig(config, point.replicas, spec.router), timed).records
    else:
        records = simulate(resolve(config), timed).records
    s = summarize(records)
    ttft, tpot = s["p90_ttft"], s["p90_tpot"]
    ok = (s["rejected"] == 0 and s["completed"] == len(records)
          and ttft <= spec.slo_ttft_p90 and (math.isnan(tpot) or tpot <= spec.slo_tpot_p90))
    return ok, ttft, tpot


def evaluate(spec: SearchSpec, point: SearchPoint, trace: Trace) -> dict:
    """One point: feasibility at the target and the highest QPS meeting the SLOs (binary
    search in [0, max_factor x qps], `iterations` halvings after the bracketing probes)."""
    row = {"label": point.label, "tp": point.tp, "replicas": point.replicas, "prefill": point.prefill,
           "decode": point.replicas - point.prefill if point.prefill else 0, "max_num_seqs": point.max_num_seqs,
           "max_num_batched_tokens": point.chunk, "gpus": point.gpus, "error": ""}
    try:
        ok, ttft, tpot = probe(spec, point, trace, spec.qps)
        row.update(feasible=ok, p90_ttft_at_qps=ttft, p90_tpot_at_qps=tpot)
        probes = 1
        if ok:
            lo, hi = spec.qps, spec.qps * spec.max_factor
            probes += 1
            if probe(spec, point, trace, hi)[0]:
                lo = hi                        # capacity >= the top of the range
        else:
            lo, hi = 0.0, spec.qps
        if lo < hi:
            for _ in range(spec.iterations):
                mid = (lo + hi) / 2
                probes += 1
                if probe(spec, point, trace, mid)[0]:
                    lo = mid
                else:
                    hi = mid
        row.update(capacity_qps=lo, qps_per_gpu=lo / point.gpus, probes=probes)
    except (ValueError, RuntimeError) as e:    # e.g. a prompt longer than this point's context
        row.update(feasible=False, capacity_qps=0.0, qps_per_gpu=0.0, probes=0, p90_ttft_at_qps=None,
                   p90_tpot_at_qps=None, error=str(e))
    return row


def search(spec: SearchSpec, trace: Trace, *, use_ray: bool = False, ray_address: str | None = None,
           progress: bool = True) -> tuple[list[dict], list[tuple[SearchPoint, str]]]:
    """Every point's row (enumeration order) and the points skipped as impossible."""
    from sim.explore.points import run_points
    spec.validate()
    points, skipped = enumerate_points(spec)
    rows = run_points(evaluate, [(spec, p, trace) for p in points], use_ray=use_ray, ray_address=ray_address,
                      desc="search", progress=progress)
    return rows, skipped


def ranked(rows: list[dict]) -> list[dict]:
    """Feasible rows: fewest GPUs first, then most QPS per GPU."""
    return sorted((r for r in rows if r["feasible"]), key=lambda r: (r["gpus"], -r["qps_per_gpu"], r["label"]))


def pareto(rows: list[dict]) -> list[dict]:
    """Points no other point beats on both fewer-or-equal GPUs and higher-or-equal capacity."""
    front, best = [], -1.0
    for r in sorted(rows, key=lambda r: (r["gpus"], -r["capacity_qps"])):
        if r["capacity_qps"] > best:
            front.append(r)
            best = r["capacity_qps"]
    return front


def format_table(spec: SearchSpec, rows: list[dict], limit: int = 15) -> str:
    good = ranked(rows)
    lines = [f"{len(good)} of {len(rows)} configurations meet p90 TTFT <= {spec.slo_ttft_p90 * 1e3:g} ms and "
             f"p90 TPOT <= {spec.slo_tpot_p90 * 1e3:g} ms at {spec.qps:g} req/s "
             f"({spec.base.model} on {spec.base.hardware}, <= {spec.max_gpus} GPUs)"]
    if good:
        lines.append(f"{'rank':>4}  {'configuration':<30} {'GPUs':>4} {'max QPS':>8} {'QPS/GPU':>8} "
                     f"{'p90 TTFT ms':>11} {'p90 TPOT ms':>11}")
        for i, r in enumerate(good[:limit], 1):
            cap = f"{r['capacity_qps']:.2f}" + ("+" if r["capacity_qps"] >= spec.qps * spec.max_factor else "")
            lines.append(f"{i:>4}  {r['label']:<30} {r['gpus']:>4} {cap:>8} {r['qps_per_gpu']:>8.2f} "
                         f"{r['p90_ttft_at_qps'] * 1e3:>11.1f} {r['p90_tpot_at_qps'] * 1e3:>11.1f}")
        if len(good) > limit:
            lines.append(f"      ... {len(good) - limit} more in the CSV")
    return "\n".join(lines)


def plot_pareto(spec: SearchSpec, rows: list[dict], out: str | Path) -> Path:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colo = [r for r in rows if not r["prefill"]]
    dis = [r for r in rows if r["prefill"]]
    ax.scatter([r["gpus"] for r in colo], [r["capacity_qps"] for r in colo], s=18, alpha=0.6,
               label="co-located", color="#1565c0")
    if dis:
        ax.scatter([r["gpus"] for r in dis], [r["capacity_qps"] for r in dis], s=18, alpha=0.6, marker="s",
                   label="disaggregated P:D", color="#ef6c00")
    front = pareto(rows)
    ax.step([r["gpus"] for r in front], [r["capacity_qps"] for r in front], where="post", color="black",
            lw=1.2, label="Pareto front")
    for r in front:
        ax.annotate(r["label"], (r["gpus"], r["capacity_qps"]), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    ax.axhline(spec.qps, color="#c62828", ls="--", lw=1, label=f"target {spec.qps:g} req/s")
    ax.set_xlabel("GPUs")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("max req/s meeting the p90 SLOs")
    ax.set_title(f"Config search: {spec.base.model} on {spec.base.hardware} "
                 f"(TTFT {spec.slo_ttft_p90 * 1e3:g} ms, TPOT {spec.slo_tpot_p90 * 1e3:g} ms)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# -- CLI ------------------------------------------------------------------------------------------
def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{flag}: integers >= 1 expected, got {text!r}")
    return values


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("search", help="find deployments meeting TTFT/TPOT SLOs at a load, fewest GPUs first",
                       description=__doc__.split("\n\n")[2])
    p.add_argument("trace", help="trace file (its prompts and output lengths; arrivals are re-timed)")
    p.add_argument("--format", default="auto", help="trace format (default: auto)")
    p.add_argument("--qps", type=float, required=True, help="target request rate (req/s)")
    p.add_argument("--slo-ttft-p90", type=float, required=True, metavar="S", help="p90 TTFT bound in seconds")
    p.add_argument("--slo-tpot-p90", type=float, required=True, metavar="S", help="p90 TPOT bound in seconds")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help=f"{', '.join(HARDWARE)} (default: %(default)s)")
    p.add_argument("--max-gpus", type=int, required=True, help="GPUs available")
    p.add_argument("--tp-degrees", default="1,2,4,8", help="(default: %(default)s)")
    p.add_argument("--max-num-seqs", default="64,256", help="values to try (default: %(default)s)")
    p.add_argument("--chunk-sizes", default="512,2048", help="max_num_batched_tokens values (default: %(default)s)")
    p.add_argument("--disaggregate-splits", action="store_true", help="also try every prefill:decode split")
    p.add_argument("--router", default="least-requests", help="router of multi-replica points (default: %(default)s)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="every probed deployment reuses KV blocks of identical prompt prefixes")
    p.add_argument("--num-requests", type=int, default=300, help="requests per probe (default: %(default)s)")
    p.add_argument("--iterations", type=int, default=5, help="binary-search halvings per point (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="arrival seed (default: 0)")
    p.add_argument("--ray", action="store_true", help="run the points as Ray tasks (local cores unless --ray-address)")
    p.add_argument("--ray-address", default=None, metavar="ADDR", help="an existing Ray cluster (implies --ray)")
    p.add_argument("--out", default="results/search.csv", metavar="CSV", help="(default: %(default)s)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the Pareto figure here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def cmd_search(args: argparse.Namespace) -> int:
    """Returns the exit status; raises ValueError with a message on bad input."""
    try:
        spec = SearchSpec(
            SimConfig(model=args.model, hardware=args.hardware, enable_prefix_caching=args.enable_prefix_caching),
            qps=args.qps, slo_ttft_p90=args.slo_ttft_p90, slo_tpot_p90=args.slo_tpot_p90, max_gpus=args.max_gpus,
            tp_degrees=_ints(args.tp_degrees, "--tp-degrees"), max_num_seqs=_ints(args.max_num_seqs, "--max-num-seqs"),
            chunks=_ints(args.chunk_sizes, "--chunk-sizes"), disaggregate=args.disaggregate_splits,
            router=args.router, num_requests=args.num_requests, seed=args.seed, iterations=args.iterations)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None
    spec.validate()
    resolve(spec.base)                              # unknown model/hardware: say so before loading
    from policies import make
    make("router", spec.router)
    try:
        trace = load_trace(args.trace, args.format)
    except TraceError as e:
        raise ValueError(str(e)) from None
    rows, skipped = search(spec, trace, use_ray=args.ray or bool(args.ray_address), ray_address=args.ray_address,
                           progress=not args.quiet)
    for point, why in skipped:
        print(f"skipped TP{point.tp} seqs{point.max_num_seqs} chunk{point.chunk}: {why}", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SEARCH_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in SEARCH_COLUMNS})
    print(format_table(spec, rows))
    if args.plot:
        print(f"Pareto figure: {plot_pareto(spec, rows, args.plot)}")
    print(f"wrote {out}")
    return 0
