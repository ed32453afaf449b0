"""Figures for policy comparisons (matplotlib, PNG). Inputs are plain rows/dicts — the
CSV/JSON files `python -m sim` writes — so plots never import the simulator.

Every function returns the path it wrote.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterable, Mapping

import matplotlib

matplotlib.use("Agg")            # headless: CI and notebooks without a display
import matplotlib.pyplot as plt  # noqa: E402

BREAKDOWN_ORDER = ("token_states", "reserved", "internal_frag", "external_frag")
BREAKDOWN_LABELS = {"token_states": "Token states", "reserved": "Reservation",
                    "internal_frag": "Internal fragmentation", "external_frag": "External fragmentation"}
BREAKDOWN_COLORS = {"token_states": "#2e7d32", "reserved": "#fbc02d", "internal_frag": "#ef6c00",
                    "external_frag": "#c62828"}


def read_csv(path: str | Path) -> list[dict]:
    """Rows of a CSV with numeric-looking fields converted to float."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for k, v in row.items():
            try:
                row[k] = float(v)
            except (TypeError, ValueError):
                pass
    return rows


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def latency_vs_rate(rows: Iterable[Mapping], out: str | Path, *, metric: str = "mean_normalized_latency",
                    group: str = "policy", title: str = "Normalized latency vs request rate",
                    ylabel: str = "Normalized latency (s/token)", ymax: float | None = None,
                    bound: float | None = None, styles: Mapping[str, Mapping] | None = None) -> Path:
    """One line per policy: `metric` against `rate` (the vLLM paper's Figure 12 style).
    `bound`: a dashed line at that latency; the y axis then stops at 6x the bound (as the
    paper's plots stop short of the overloaded tail) unless `ymax` says otherwise.
    `styles`: extra matplotlib line properties per series name (color, linestyle, ...)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get(metric) in (None, ""):
            continue
        series.setdefault(str(r[group]), []).append((float(r["rate"]), float(r[metric])))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, **(styles or {}).get(name, {}))
    if bound is not None:
        ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label=f"bound {bound:g} s/token")
        if ymax is None:
            ymax = 6 * bound
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ymax is not None:
        ax.set_ylim(0, ymax)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(title=group, fontsize=8)
    return _save(fig, out)


def usage_over_time(rows: Iterable[Mapping], out: str | Path, *, title: str = "KV cache usage and queues") -> Path:
    """KV usage (%) on the left axis; running / waiting / swapped requests on the right."""
    rows = list(rows)
    t = [float(r["time"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.step(t, [100 * float(r["kv_usage"]) for r in rows], where="post", color="#1565c0", label="KV usage (%)")
    ax.set_ylim(0, 105)
    ax.set_xlabel("Time (s)")
    ax.set_ylabel("KV cache usage (%)", color="#1565c0")
    ax2 = ax.twinx()
    for key, color in (("running", "#2e7d32"), ("waiting", "#c62828"), ("swapped", "#6a1b9a")):
        if rows and key in rows[0]:
            ax2.step(t, [float(r[key]) for r in rows], where="post", color=color, alpha=0.8, label=key)
    ax2.set_ylabel("Requests")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_title(title)
    return _save(fig, out)


def memory_breakdown(shares: Mapping[str, Mapping[str, float]], out: str | Path,
                     *, title: str = "Where the KV cache memory goes") -> Path:
    """Stacked bars of the paper's Figure 2 categories, as % of the KV memory in use."""
    names = list(shares)
    fig, ax = plt.subplots(figsize=(8.2, 4.4))
    bottom = [0.0] * len(names)
    for cat in BREAKDOWN_ORDER:
        vals = [100 * float(shares[n].get(cat, 0.0)) for n in names]
        bars = ax.bar(names, vals, bottom=bottom, color=BREAKDOWN_COLORS[cat], label=BREAKDOWN_LABELS[cat])
        for bar, v, b in zip(bars, vals, bottom):
            if v >= 4:
                ax.text(bar.get_x() + bar.get_width() / 2, b + v / 2, f"{v:.1f}%", ha="center", va="center",
                        fontsize=9, color="black" if cat == "reserved" else "white", fontweight="bold")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, 100)
    ax.set_ylabel("KV cache memory in use (%)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, out)


def sharing_savings(rows: Iterable[Mapping], out: str | Path, *, x: str = "width",
                    title: str = "Memory saved by sharing KV blocks") -> Path:
    """Memory saving (%) against the number of parallel samples / beam width, one line per
    workload (the paper's Figure 15); rows of workload "shared prefix" (x = prefix length)
    go to a bar panel on the right."""
    series: dict[str, list[tuple[float, float]]] = {}
    prefix: list[tuple[float, float]] = []
    for r in rows:
        pt = (float(r[x]), 100 * float(r["saving"]))
        if r["workload"] == "shared prefix":
            prefix.append(pt)
        else:
            series.setdefault(str(r["workload"]), []).append(pt)
    fig, axes = plt.subplots(1, 2 if prefix else 1, figsize=(9.6 if prefix else 6.0, 4.0), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]} if prefix else None)
    ax = axes[0][0]
    for name, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for px, py in pts:
            ax.annotate(f"{py:.1f}%", (px, py), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("Parallel samples n / beam width k")
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="upper left")
    if prefix:
        ax = axes[0][1]
        prefix.sort()
        labels = [f"{int(p[0])} tokens" for p in prefix]
        bars = ax.bar(labels, [p[1] for p in prefix], color="#6a1b9a")
        for bar, (_, v) in zip(bars, prefix):
            ax.text(bar.get_x() + bar.get_width() / 2, v + 1.5, f"{v:.1f}%", ha="center", fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_xlabel("Shared system prompt")
        ax.set_title("Shared prefix (prefix caching)")
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, out)


def memory_over_time(series: Mapping[str, Iterable[Mapping]], out: str | Path,
                     *, title: str = "KV memory over time") -> Path:
    """One panel per policy: the Figure 2 categories as stacked areas (% of all KV slots)
    over time, from timeseries.csv rows (token_states, reserved, internal_frag, external_frag)."""
    names = list(series)
    fig, axes = plt.subplots(len(names), 1, figsize=(7.5, 1.9 * len(names) + 0.8), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        rows = list(series[name])
        t = [float(r["time"]) for r in rows]
        ys = [[100 * float(r[c]) for r in rows] for c in BREAKDOWN_ORDER]
        ax.stackplot(t, *ys, step="post", colors=[BREAKDOWN_COLORS[c] for c in BREAKDOWN_ORDER],
                     labels=[BREAKDOWN_LABELS[c] for c in BREAKDOWN_ORDER], alpha=0.9)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of KV")
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("Time (s)")
    fig.suptitle(title)
    return _save(fig, out)


def latency_cdfs(samples: Mapping[str, Mapping[str, list[float]]], out: str | Path,
                 *, metrics: tuple[str, ...] = ("ttft", "tpot"), title: str | None = None) -> Path:
    """Empirical CDFs of per-request latencies (one panel per metric, one line per policy)."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
    if title:
        fig.suptitle(title)
    for ax, metric in zip(axes[0], metrics):
        lo, hi = float("inf"), 0.0
        for name, by_metric in samples.items():
            v = sorted(by_metric.get(metric, []))
            if v:
                ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
                lo, hi = min(lo, v[0]), max(hi, v[-1])
        if lo > 0 and hi > 20 * lo:        # log scale only where the values span decades
            ax.set_xscale("log")
        ax.set_xlabel(f"{metric.upper()} (s)")
        ax.set_ylabel("Fraction of requests")
        ax.set_title(f"{metric.upper()} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out)


def router_comparison(rows: Iterable[Mapping], out: str | Path, *, title: str = "Routers",
                      panels: tuple[tuple[str, str, float], ...] = (
                          ("p90_ttft", "p90 TTFT (s)", 1.0), ("mean_tpot", "mean TPOT (ms)", 1e3),
                          ("prefix_cache_hit_rate", "prefix-cache hit rate (%)", 100.0),
                          ("slo_attainment", "requests meeting the SLOs (%)", 100.0))) -> Path:
    """Grouped bars: one group per load (`load` label), one bar per `router`, one panel per
    metric (rows as `sim run --replicas N --router R` summaries, plus `load`)."""
    rows = list(rows)
    loads = list(dict.fromkeys(r["load"] for r in rows))
    routers = list(dict.fromkeys(r["router"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4), squeeze=False)
    width = 0.8 / len(routers)
    colors = ["#90a4ae", "#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a"]
    for ax, (key, label, scale) in zip(axes[0], panels):
        for j, router in enumerate(routers):
            vals = [next((r[key] * scale for r in rows if r["load"] == load and r["router"] == router), 0.0)
                    for load in loads]
            ax.bar([i + (j - (len(routers) - 1) / 2) * width for i in range(len(loads))], vals, width,
                   label=router, color=colors[j % len(colors)])
        ax.set_xticks(range(len(loads)))
        ax.set_xticklabels(loads, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, out)
