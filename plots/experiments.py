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
  routers        4 replicas of Llama-3.1-8B / H100 behind each router on the Mooncake
                 conversation trace (real shared prefixes), at half and at its own rate
  disagg         prefill/decode splits vs 4 co-located replicas of Llama-3-8B / H100 on the
                 Azure conversation trace re-timed 8x and 10x faster: SLO attainment and
                 goodput per GPU (DistServe's comparison)

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
        "routers": {"num_requests": 120, "time_scales": [2.0, 1.0]},
        "disagg": {"num_requests": 200, "time_scales": [0.125], "variants": ["4 co-located", "2P:2D nvlink"]},
    },
    "full": {
        "allocation": {"num_requests": 1000, "rates": [0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4],
                       "focus_rate": 2},
        "sharing": {"num_requests": 300, "rate": 0.25, "ns": [2, 4, 6], "beam_widths": [2, 4, 6],
                    "prefix_lens": [80, 341]},
        "shared_prefix": {"num_requests": 600, "rates": [0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4], "prefix_lens": [80, 341]},
        "routers": {"num_requests": 2000, "time_scales": [2.0, 1.0]},
        "disagg": {"num_requests": 4000, "time_scales": [0.125, 0.1],
                   "variants": ["4 co-located", "1P:3D nvlink", "2P:2D nvlink", "2P:2D infiniband", "2P:2D pcie",
                                "3P:1D nvlink"]},
    },
}

FIGURES = {
    "allocation": ["latency_vs_rate_allocation.png", "memory_breakdown_allocation.png",
                   "memory_over_time_allocation.png", "usage_over_time_paged.png", "usage_over_time_orca-oracle.png",
                   "latency_cdfs_allocation.png"],
    "sharing": ["sharing_savings.png"],
    "shared_prefix": ["latency_vs_rate_shared_prefix.png"],
    "routers": ["routers_mooncake.png"],
    "disagg": ["disagg_azure.png"],
}

# Fleets (README "Fleets"): the workloads, deployments and SLOs of the two comparisons.
ROUTERS = ("round-robin", "least-requests", "least-kv", "prefix-aware")
ROUTER_TRACE = "traces/mooncake_conversation.jsonl.gz"
ROUTER_DEPLOYMENT = ["--model", "Llama-3.1-8B", "--hardware", "H100", "--enable-prefix-caching"]
ROUTER_SLO = (2.0, 0.1)                 # TTFT, TPOT seconds
DISAGG_TRACE = "traces/azure_conv_2023.vidur.csv"
DISAGG_DEPLOYMENT = ["--model", "Llama-3-8B", "--hardware", "H100"]
DISAGG_SLO = (0.5, 0.0135)              # tighter TPOT than co-located batches reach
SERIES = {"routers": "router", "disagg": "variant"}     # what a comparison's bars are
FLEET_KEYS = ("mean_ttft", "p90_ttft", "p99_ttft", "mean_tpot", "p90_tpot", "prefix_cache_hit_rate",
              "request_throughput", "goodput", "goodput_per_gpu", "slo_attainment", "num_preemptions")


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
            "--allocation", policy, "--quiet", "--overwrite", "--out", results / "focus" / policy)
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


def _fleet_comparison(name: str, trace: str, deployment: list, slo: tuple[float, float], num_requests: int,
                      time_scales: list[float], variants: dict[str, list], results: Path, line) -> str:
    """Run `sim run` for every (time scale, variant: its fleet flags) into results/<name>/
    and collect one row per run into results/<name>.json: the summary's FLEET_KEYS, the
    offered `rate` and its `load` label, the variant under SERIES[name]. Returns the runs'
    lines (`line(row)`)."""
    rows, lines = [], []
    for ts in time_scales:
        rate = _offered_rate(trace, num_requests, ts)
        for variant, flags in variants.items():
            out = Path(results) / name / f"x{ts:g}" / variant.replace(" ", "_").replace(":", "-")
            sim("run", trace, *deployment, "--num-requests", num_requests, "--time-scale", ts, *flags,
                "--slo-ttft", slo[0], "--slo-tpot", slo[1], "--quiet", "--overwrite", "--out", out)
            s = json.loads((out / "summary.json").read_text())
            row = {"load": f"{rate:.1f} req/s", "time_scale": ts, SERIES[name]: variant, "rate": rate}
            row.update({k: s.get(k) for k in FLEET_KEYS})
            row["per_replica"] = [r["num_requests"] for r in s["replicas"]]
            dis = s.get("disaggregation")
            row["transfer_ms"] = dis["mean_transfer_time"] * 1e3 if dis else 0.0
            row["wait_ms"] = dis["mean_wait_for_decode_memory"] * 1e3 if dis else 0.0
            rows.append(row)
            lines.append(line(row))
    figures.write_json(Path(results) / f"{name}.json", rows)
    return "\n".join(lines)


def _offered_rate(trace: str, num_requests: int, time_scale: float) -> float:
    """Requests per second of the trace's first `num_requests`, re-timed by `time_scale`."""
    from traces import load_trace, retime
    t = retime(load_trace(ROOT / trace), time_scale=time_scale, num_requests=num_requests)
    span = t.requests[-1].arrival_time - t.requests[0].arrival_time
    return (len(t.requests) - 1) / span if span > 0 else float("inf")


def run_routers(scale: str, results: Path) -> str:
    p = SCALES[scale]["routers"]
    variants = {router: ["--replicas", 4, "--router", router] for router in ROUTERS}
    return _fleet_comparison("routers", ROUTER_TRACE, ROUTER_DEPLOYMENT, ROUTER_SLO, p["num_requests"],
                             p["time_scales"], variants, results, lambda row: (
        f"{row['load']:>10}  {row['router']:<15} p90 TTFT {row['p90_ttft']:7.2f} s  mean TPOT "
        f"{row['mean_tpot'] * 1e3:6.1f} ms  hits {row['prefix_cache_hit_rate']:6.1%}  "
        f"meet SLOs {row['slo_attainment']:6.1%}"))


def _disagg_args(variant: str) -> list:
    """'4 co-located' -> 4 replicas behind least-requests; '2P:2D pcie' -> --disaggregate 2:2 --link pcie."""
    if variant.endswith("co-located"):
        return ["--replicas", int(variant.split()[0]), "--router", "least-requests"]
    split, link = variant.split()
    return ["--disaggregate", split.replace("P", "").replace("D", ""), "--link", link]


def run_disagg(scale: str, results: Path) -> str:
    p = SCALES[scale]["disagg"]
    variants = {v: _disagg_args(v) for v in p["variants"]}
    return _fleet_comparison("disagg", DISAGG_TRACE, DISAGG_DEPLOYMENT, DISAGG_SLO, p["num_requests"],
                             p["time_scales"], variants, results, lambda row: (
        f"{row['load']:>11}  {row['variant']:<17} p90 TTFT {row['p90_ttft'] * 1e3:8.0f} ms  p90 TPOT "
        f"{row['p90_tpot'] * 1e3:6.1f} ms  transfer {row['transfer_ms']:5.2f} ms  meet SLOs "
        f"{row['slo_attainment']:6.1%}  goodput/GPU {row['goodput_per_gpu']:5.2f}"))


RUNNERS = {"allocation": run_allocation, "sharing": run_sharing, "shared_prefix": run_shared_prefix,
           "routers": run_routers, "disagg": run_disagg}


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


def draw_routers(results: Path, out: Path) -> list[Path]:
    """The router figure, and its rows as routers_mooncake.json beside it."""
    rows = json.loads((Path(results) / "routers.json").read_text())
    Path(out).mkdir(parents=True, exist_ok=True)
    figures.write_json(Path(out) / "routers_mooncake.json", rows)
    return [figures.router_comparison(rows, Path(out) / "routers_mooncake.png",
                                      title="Routers: Mooncake conversation trace, 4x Llama-3.1-8B / H100, "
                                            "prefix caching")]


def draw_disagg(results: Path, out: Path) -> list[Path]:
    """The disaggregation figure, and its rows as disagg_azure.json beside it."""
    rows = json.loads((Path(results) / "disagg.json").read_text())
    Path(out).mkdir(parents=True, exist_ok=True)
    figures.write_json(Path(out) / "disagg_azure.json", rows)
    ttft, tpot = DISAGG_SLO
    return [figures.disagg_comparison(rows, Path(out) / "disagg_azure.png",
                                      title=f"Disaggregation vs co-location, 4 GPUs: Azure conv 2023, Llama-3-8B / H100 "
                                            f"(SLO TTFT {ttft * 1e3:g} ms, TPOT {tpot * 1e3:g} ms)")]


DRAWERS = {"allocation": draw_allocation, "sharing": draw_sharing, "shared_prefix": draw_shared_prefix,
           "routers": draw_routers, "disagg": draw_disagg}


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
