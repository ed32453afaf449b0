"""The PagedAttention experiments behind `plots/figures/` (run by `python -m plots` and by
`plots/policy_comparison.ipynb`).

Each experiment runs the simulator's own CLI (`python -m sim compare|sharing|run`, in a
subprocess) into a results directory and draws from the files it writes -- plots read
result files and never import the simulator:

  allocation     ShareGPT on OPT-13B / A100-40G (the paper's Section 6.2 setting): paged vs
                 orca-oracle / orca-pow2 / orca-max over request rates; one run per
                 policy at `focus_rate` (a load that fills memory) for the time series and
                 latency CDFs
  sharing        parallel sampling n, beam width k, shared system prompt: KV blocks saved
  shared_prefix  a shared system prompt of 80 / 341 tokens, prefix caching on vs off

`SCALES["small"]` is what CI runs (seconds); `SCALES["full"]` makes the committed figures.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from plots import figures

ROOT = Path(__file__).resolve().parents[1]
TRACE = "traces/sharegpt.json"
DEPLOYMENT = ["--model", "OPT-13B", "--hardware", "A100-40G"]
ALLOCATIONS = ("paged", "orca-oracle", "orca-pow2", "orca-max")
SETTING = "ShareGPT, OPT-13B on A100-40G"      # the workload and deployment, for the titles
LATENCY_BOUND = 0.1          # s/token: a few times the unloaded ~0.025 s/token

SCALES = {
    "small": {
        "allocation": {"num_requests": 120, "rates": [0.5, 2, 4], "focus_rate": 2},
        "sharing": {"num_requests": 30, "rate": 0.25, "ns": [2, 4], "beam_widths": [2, 4], "prefix_lens": [80, 341]},
        "shared_prefix": {"num_requests": 120, "rates": [1, 3], "prefix_lens": [341]},
    },
    "full": {
        "allocation": {"num_requests": 1000, "rates": [0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4],
                       "focus_rate": 2},
        "sharing": {"num_requests": 300, "rate": 0.25, "ns": [2, 4, 6], "beam_widths": [2, 4, 6],
                    "prefix_lens": [80, 341]},
        "shared_prefix": {"num_requests": 600, "rates": [0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4], "prefix_lens": [80, 341]},
    },
}

FIGURES = {
    "allocation": ["latency_vs_rate_allocation.png", "memory_breakdown_allocation.png",
                   "memory_over_time_allocation.png", "usage_over_time_paged.png", "usage_over_time_orca-oracle.png",
                   "latency_cdfs_allocation.png"],
    "sharing": ["sharing_savings.png"],
    "shared_prefix": ["latency_vs_rate_shared_prefix.png"],
}


def sim(*args: str) -> str:
    """Run `python -m sim ARGS` from the repository root; its stdout (raises on failure)."""
    proc = subprocess.run([sys.executable, "-m", "sim", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m sim {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout


def _rates(rates) -> str:
    return ",".join(f"{r:g}" for r in rates)


# -- running ---------------------------------------------------------------------------------

def run_allocation(scale: str, results: Path) -> str:
    p = SCALES[scale]["allocation"]
    results = Path(results)
    out = sim("compare", TRACE, *DEPLOYMENT, "--num-requests", p["num_requests"], "--policies", ",".join(ALLOCATIONS),
              "--rates", _rates(p["rates"]), "--latency-bound", LATENCY_BOUND, "--quiet",
              "--out", results / "allocation.csv")
    for policy in ALLOCATIONS:
        sim("run", TRACE, *DEPLOYMENT, "--num-requests", p["num_requests"], "--rate", p["focus_rate"],
            "--allocation", policy, "--quiet", "--out", results / "focus" / policy)
    (results / "focus" / "rate.json").write_text(json.dumps({"rate": p["focus_rate"]}) + "\n")
    return out


def run_sharing(scale: str, results: Path) -> str:
    p = SCALES[scale]["sharing"]
    return sim("sharing", TRACE, *DEPLOYMENT, "--num-requests", p["num_requests"], "--rate", p["rate"],
               "--ns", _rates(p["ns"]), "--beam-widths", _rates(p["beam_widths"]),
               "--prefix-lens", _rates(p["prefix_lens"]), "--quiet", "--out", Path(results) / "sharing.csv")


def run_shared_prefix(scale: str, results: Path) -> str:
    p = SCALES[scale]["shared_prefix"]
    outs = []
    for length in p["prefix_lens"]:
        outs.append(sim("compare", TRACE, *DEPLOYMENT, "--num-requests", p["num_requests"],
                        "--shared-prefix-len", length, "--policies", "paged,paged+prefix-caching",
                        "--rates", _rates(p["rates"]), "--latency-bound", LATENCY_BOUND, "--quiet",
                        "--out", Path(results) / f"shared_prefix_{length}.csv"))
    return "\n".join(outs)


RUNNERS = {"allocation": run_allocation, "sharing": run_sharing, "shared_prefix": run_shared_prefix}


# -- drawing ---------------------------------------------------------------------------------

def draw_allocation(results: Path, out: Path) -> list[Path]:
    results, out = Path(results), Path(out)
    rows = figures.read_csv(results / "allocation.csv")
    focus = {p: figures.read_csv(results / "focus" / p / "timeseries.csv") for p in ALLOCATIONS}
    requests = {p: figures.read_csv(results / "focus" / p / "requests.csv") for p in ALLOCATIONS}
    summaries = {p: json.loads((results / "focus" / p / "summary.json").read_text()) for p in ALLOCATIONS}
    rate = json.loads((results / "focus" / "rate.json").read_text())["rate"]
    shares = {p: summaries[p]["memory_breakdown"]["shares"] for p in ALLOCATIONS}
    paths = [
        figures.latency_vs_rate(rows, out / "latency_vs_rate_allocation.png", bound=LATENCY_BOUND,
                                title=f"Paged vs contiguous KV allocation\n{SETTING}"),
        figures.memory_breakdown(shares, out / "memory_breakdown_allocation.png",
                                 title=f"KV memory in use, time-averaged ({SETTING}, {rate:g} req/s)"),
        figures.memory_over_time(focus, out / "memory_over_time_allocation.png",
                                 title=f"KV memory over time, % of all slots ({SETTING}, {rate:g} req/s)"),
    ]
    for p in ("paged", "orca-oracle"):
        paths.append(figures.usage_over_time(focus[p], out / f"usage_over_time_{p}.png",
                                             title=f"KV cache usage and queues: {p} ({SETTING}, {rate:g} req/s)"))
    samples = {p: {m: [r[m] for r in requests[p] if isinstance(r.get(m), float)] for m in ("ttft", "tpot")}
               for p in ALLOCATIONS}
    paths.append(figures.latency_cdfs(samples, out / "latency_cdfs_allocation.png",
                                      title=f"Latency CDFs at {rate:g} req/s ({SETTING})"))
    return paths


def draw_sharing(results: Path, out: Path) -> list[Path]:
    rows = figures.read_csv(Path(results) / "sharing.csv")
    return [figures.sharing_savings(rows, Path(out) / "sharing_savings.png",
                                    title=f"KV blocks saved by sharing ({SETTING})")]


def draw_shared_prefix(results: Path, out: Path) -> list[Path]:
    rows, styles = [], {}
    colors = figures.PALETTE
    paths = sorted(Path(results).glob("shared_prefix_*.csv"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    for k, path in enumerate(paths):
        length = int(path.stem.rsplit("_", 1)[1])
        for r in figures.read_csv(path):
            cached = "prefix-caching" in r["policy"]
            r["policy"] = f"{length}-token prefix, {'prefix caching' if cached else 'no prefix caching'}"
            styles[r["policy"]] = {"color": colors[k % len(colors)], "linestyle": "-" if cached else "--"}
            rows.append(r)
    return [figures.latency_vs_rate(rows, Path(out) / "latency_vs_rate_shared_prefix.png", bound=LATENCY_BOUND,
                                    styles=styles, title=f"Shared system prompt, prefix caching on/off\n{SETTING}")]


DRAWERS = {"allocation": draw_allocation, "sharing": draw_sharing, "shared_prefix": draw_shared_prefix}


def run_all(scale: str, results: Path, out: Path, only: list[str] | None = None, log=print) -> list[Path]:
    """Run every experiment at `scale` into `results` and draw the figures into `out`."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose from {', '.join(SCALES)}")
    paths = []
    for name in only or list(RUNNERS):
        if log:
            log(f"== {name} ({scale})")
        text = RUNNERS[name](scale, Path(results))
        if log:
            log(text.rstrip())
        paths += DRAWERS[name](Path(results), Path(out))
    return paths
