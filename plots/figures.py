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
                    ylabel: str = "Normalized latency (s/token)", ymax: float | None = None) -> Path:
    """One line per policy: `metric` against `rate` (the vLLM paper's Figure 12 style)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault(str(r[group]), []).append((float(r["rate"]), float(r[metric])))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ymax is not None:
        ax.set_ylim(0, ymax)
    ax.grid(alpha=0.3)
    ax.legend(title=group)
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
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_title(title)
    return _save(fig, out)


def memory_breakdown(shares: Mapping[str, Mapping[str, float]], out: str | Path,
                     *, title: str = "Where the KV cache memory goes") -> Path:
    """Stacked bars of the paper's Figure 2 categories, as % of the KV memory in use."""
    names = list(shares)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bottom = [0.0] * len(names)
    for cat in BREAKDOWN_ORDER:
        vals = [100 * float(shares[n].get(cat, 0.0)) for n in names]
        bars = ax.bar(names, vals, bottom=bottom, color=BREAKDOWN_COLORS[cat], label=BREAKDOWN_LABELS[cat])
        for bar, v, b in zip(bars, vals, bottom):
            if v >= 6:
                ax.text(bar.get_x() + bar.get_width() / 2, b + v / 2, f"{v:.1f}", ha="center", va="center",
                        fontsize=8, color="white")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, 100)
    ax.set_ylabel("KV cache memory in use (%)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, out)


def sharing_savings(rows: Iterable[Mapping], out: str | Path, *, x: str = "width",
                    title: str = "Memory saved by sharing KV blocks") -> Path:
    """Memory saving (%) against the number of parallel samples / beam width, one line per workload."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault(str(r["workload"]), []).append((float(r[x]), 100 * float(r["saving"])))
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for name, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("Parallel samples n / beam width k")
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


def latency_cdfs(samples: Mapping[str, Mapping[str, list[float]]], out: str | Path,
                 *, metrics: tuple[str, ...] = ("ttft", "tpot")) -> Path:
    """Empirical CDFs of per-request latencies (one panel per metric, one line per policy)."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for name, by_metric in samples.items():
            v = sorted(by_metric.get(metric, []))
            if v:
                ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric.upper()} (s)")
        ax.set_ylabel("Fraction of requests")
        ax.set_title(f"{metric.upper()} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out)
