"""Figures for policy comparisons (matplotlib, PNG). Inputs are plain rows/dicts — the
CSV/JSON files `python -m sim` writes — so plots never import the simulator.

Every function returns the path it wrote.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Iterable, Mapping

from core.metrics import percentile  # the one percentile (tests and callers use figures.percentile)

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")            # headless: CI and notebooks without a display
import matplotlib.pyplot as plt  # noqa: E402

# Okabe & Ito's colour-blind-safe palette (yellow last: weak on white), with a marker per
# series so that lines stay apart in greyscale too.
OKABE_ITO = {"blue": "#0072B2", "vermillion": "#D55E00", "green": "#009E73", "orange": "#E69F00",
             "purple": "#CC79A7", "sky": "#56B4E9", "yellow": "#F0E442", "black": "#000000"}
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#000000", "#F0E442")
MARKERS = ("o", "s", "D", "v", "P", "X", "<", ">")

BREAKDOWN_ORDER = ("token_states", "reserved", "internal_frag", "external_frag")
BREAKDOWN_LABELS = {"token_states": "Token states", "reserved": "Reservation",
                    "internal_frag": "Internal fragmentation", "external_frag": "External fragmentation"}
BREAKDOWN_COLORS = {"token_states": OKABE_ITO["green"], "reserved": OKABE_ITO["yellow"],
                    "internal_frag": OKABE_ITO["orange"], "external_frag": OKABE_ITO["vermillion"]}
BREAKDOWN_TEXT = {"token_states": "white", "reserved": "black", "internal_frag": "black", "external_frag": "white"}
CDF_PERCENTILE = 99    # latency CDFs cut their x axis here when the tail beyond it
OUTLIER_STRETCH = 1.5  # would stretch the axis more than this factor (one outlier squashing the rest)


def series_style(i: int) -> dict:
    """Colour and marker of the i-th series."""
    return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)]}


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


def _save(fig, out: str | Path, layout: bool = True) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if layout:
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
    paper's plots stop short of the overloaded tail) unless `ymax` says otherwise. Points
    above the axis are drawn as open triangles on its top edge, labelled with their value.
    `styles`: extra matplotlib line properties per series name (color, linestyle, ...)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get(metric) in (None, ""):
            continue
        series.setdefault(str(r[group]), []).append((float(r["rate"]), float(r[metric])))
    if bound is not None and ymax is None:
        ymax = 6 * bound
    fig, ax = plt.subplots(figsize=(7.6, 4.4))
    off_chart: dict[float, int] = {}          # labels already stacked under the top edge at each x
    for i, (name, pts) in enumerate(series.items()):
        pts.sort()
        style = {**series_style(i), **(styles or {}).get(name, {})}
        inside = [k for k, (_, y) in enumerate(pts) if ymax is None or y <= ymax]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, markersize=6, markevery=inside, **style)
        # the line is clipped at the axes, its markers are not (half-cut markers on the edges)
        ax.plot([pts[k][0] for k in inside], [pts[k][1] for k in inside], linestyle="none", marker=style["marker"],
                color=style["color"], markersize=6, clip_on=False, zorder=3)
        for x, y in pts:
            if ymax is not None and y > ymax:   # off the chart: an open triangle on the top edge
                ax.plot([x], [ymax], linestyle="none", marker="^", markersize=7, markerfacecolor="white",
                        color=style["color"], clip_on=False, zorder=4)
                below = off_chart[x] = off_chart.get(x, 0) + 1
                ax.annotate(f"{y:.3g}", (x, ymax), textcoords="offset points", xytext=(0, -2 - 9 * below),
                            ha="center", fontsize=7, color=style["color"], zorder=5,
                            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none",
                                  "alpha": 0.85})
    if bound is not None:
        ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label=f"bound {bound:.3g} s/token")
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if ymax is not None:
        ax.set_ylim(0, ymax)
        ax.plot([], [], linestyle="none", marker="^", markerfacecolor="white", color="grey",
                label=f"above {ymax:.3g} (value shown)")
    ax.set_xlim(left=0, right=max((p[0] for pts in series.values() for p in pts), default=1) * 1.04)
    ax.grid(alpha=0.3)
    ax.legend(title=group, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, out)


def usage_over_time(rows: Iterable[Mapping], out: str | Path, *, title: str = "KV cache usage and queues") -> Path:
    """KV usage (%) on the left axis; running / waiting / swapped requests on the right."""
    rows = list(rows)
    t = [float(r["time"]) for r in rows]
    usage_color = OKABE_ITO["blue"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.step(t, [100 * float(r["kv_usage"]) for r in rows], where="post", color=usage_color, label="KV usage (%)")
    ax.set_ylim(0, 105)
    ax.set_xlabel("Time (s)")
    ax.set_ylabel("KV cache usage (%)", color=usage_color)
    ax2 = ax.twinx()
    for key, color, dash in (("running", OKABE_ITO["green"], "-"), ("waiting", OKABE_ITO["vermillion"], "--"),
                             ("swapped", OKABE_ITO["purple"], ":")):
        if rows and key in rows[0]:
            ax2.step(t, [float(r[key]) for r in rows], where="post", color=color, linestyle=dash, alpha=0.9,
                     label=key)
    ax2.set_ylabel("Requests (running / waiting / swapped)")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=10)
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
                        fontsize=9, color=BREAKDOWN_TEXT[cat], fontweight="bold")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, 100)
    ax.set_xlabel("KV allocation policy")
    ax.set_ylabel("KV cache memory in use (%)")
    ax.set_title(title, fontsize=10)
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
    for i, (name, pts) in enumerate(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, clip_on=False, **series_style(i))
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
        bars = ax.bar(labels, [p[1] for p in prefix], color=OKABE_ITO["purple"])
        for bar, (_, v) in zip(bars, prefix):
            ax.text(bar.get_x() + bar.get_width() / 2, v + 1.5, f"{v:.1f}%", ha="center", fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_xlabel("Shared system prompt length")
        ax.set_ylabel("KV blocks saved by sharing (%)")
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
        ax.set_ylabel("% of KV slots")
        ax.set_xlabel("Time (s)")
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="upper right", ncol=2)
    fig.suptitle(title)
    return _save(fig, out)


def latency_cdfs(samples: Mapping[str, Mapping[str, list[float]]], out: str | Path,
                 *, metrics: tuple[str, ...] = ("ttft", "tpot"), title: str | None = None,
                 clip_percentile: float = CDF_PERCENTILE) -> Path:
    """Empirical CDFs of per-request latencies (one panel per metric, one line per policy).
    When the largest value is over 1.5x the largest `clip_percentile` percentile of the
    series, the x axis ends at that percentile and its label says so: one outlier cannot
    squash the rest."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.9), squeeze=False)
    if title:
        fig.suptitle(title)
    for ax, metric in zip(axes[0], metrics):
        lo, hi, top = float("inf"), 0.0, 0.0
        for i, (name, by_metric) in enumerate(samples.items()):
            v = sorted(by_metric.get(metric, []))
            if v:
                ax.plot(v, [(k + 1) / len(v) for k in range(len(v))], label=name,
                        color=PALETTE[i % len(PALETTE)], linestyle=("-", "--", "-.", ":")[i % 4])
                lo, hi, top = min(lo, v[0]), max(hi, percentile(v, clip_percentile)), max(top, v[-1])
        label = f"{metric.upper()} (s)"
        if top > 0:
            cut = top > OUTLIER_STRETCH * hi   # a far tail would squash the rest: end the axis at the percentile
            right = hi if cut else top
            if lo > 0 and right > 20 * lo:     # log scale only where the values span decades
                ax.set_xscale("log")
            if cut:
                label += f", axis cut at the p{clip_percentile:g} (max {top:.3g} s)"
            ax.set_xlim(right=right)
        ax.set_xlabel(label)
        ax.set_ylabel("Fraction of requests")
        ax.set_title(f"{metric.upper()} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, out)


def grouped_bars(rows: Iterable[Mapping], out: str | Path, series: str,
                 panels: tuple[tuple[str, str, float, bool], ...], *, title: str) -> Path:
    """Grouped bars: one group per load (`load` label), one bar per value of `series`, one
    panel per (key, label, scale, log axis)."""
    rows = list(rows)
    loads = list(dict.fromkeys(r["load"] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4), squeeze=False)
    width = 0.8 / len(names)
    for ax, (key, label, scale, log) in zip(axes[0], panels):
        for j, name in enumerate(names):
            vals = [next((r[key] * scale for r in rows if r["load"] == load and r[series] == name), 0.0)
                    for load in loads]
            ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(loads))], vals, width,
                   label=name, color=PALETTE[j % len(PALETTE)])
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(loads)))
        ax.set_xticklabels(loads, fontsize=8)
        ax.set_xlabel("offered load", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))          # room for one legend row below the panels
    fig.legend(handles, labels, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    return _save(fig, out, layout=False)


def router_comparison(rows: Iterable[Mapping], out: str | Path, *, title: str = "Routers") -> Path:
    """Routers side by side per load (rows: `sim run --replicas N --router R` summaries
    plus `load` and `router`)."""
    return grouped_bars(rows, out, "router", (
        ("p90_ttft", "p90 TTFT (s)", 1.0, False), ("mean_tpot", "mean TPOT (ms)", 1e3, False),
        ("prefix_cache_hit_rate", "prefix-cache hit rate (%)", 100.0, False),
        ("slo_attainment", "requests meeting the SLOs (%)", 100.0, False)), title=title)


def disagg_comparison(rows: Iterable[Mapping], out: str | Path, *, title: str = "Disaggregation") -> Path:
    """Deployments (co-located replicas, P:D splits and links) side by side per load (rows:
    fleet summaries plus `load` and `variant`)."""
    return grouped_bars(rows, out, "variant", (
        ("p90_ttft", "p90 TTFT (s, log)", 1.0, True), ("p90_tpot", "p90 TPOT (ms, log)", 1e3, True),
        ("slo_attainment", "requests meeting the SLOs (%)", 100.0, False),
        ("goodput_per_gpu", "goodput per GPU (req/s)", 1.0, False)), title=title)


def pp_vs_tp(rows: Iterable[Mapping], out: str | Path, *, title: str = "Pipeline vs tensor parallelism") -> Path:
    """Three panels against the request rate, one line per parallel layout (`layout`, e.g.
    "TP4 x PP2"): output throughput; TTFT and TPOT at p50 (solid) and p90 (dashed), on a
    log axis (overloaded points run to seconds). Rows: `sim run` summaries plus `layout`
    and `rate`."""
    rows = list(rows)
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.0))
    panels = (("output_throughput", None, "Output throughput (tok/s)", 1.0, False),
              ("median_ttft", "p90_ttft", "TTFT (ms)", 1e3, True),
              ("median_tpot", "p90_tpot", "TPOT (ms)", 1e3, True))
    for ax, (p50, p90, label, scale, log) in zip(axes, panels):
        for i, layout in enumerate(layouts):
            pts = sorted((float(r["rate"]), r) for r in rows if r["layout"] == layout)
            xs = [x for x, _ in pts]
            style = series_style(i)
            ax.plot(xs, [r[p50] * scale for _, r in pts], label=layout if p90 is None else f"{layout} p50",
                    markersize=5, **style)
            if p90 is not None:
                ax.plot(xs, [r[p90] * scale for _, r in pts], linestyle="--", markersize=4,
                        markerfacecolor="white", label=f"{layout} p90", **style)
        ax.set_xlabel("Request rate (req/s)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
                lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
        ax.grid(alpha=0.3, which="both" if log else "major")
    axes[0].legend(fontsize=8, title="layout (8 GPUs)", title_fontsize=8)
    axes[1].plot([], [], color="grey", label="p50")
    axes[1].plot([], [], color="grey", linestyle="--", label="p90")
    handles = axes[1].get_legend_handles_labels()
    keep = [k for k, name in enumerate(handles[1]) if name in ("p50", "p90")]
    axes[1].legend([handles[0][k] for k in keep], [handles[1][k] for k in keep], fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, out)


def series_over_time(series: Mapping[str, Iterable[Mapping]], columns: Mapping[str, str], out: str | Path,
                     *, title: str, scale: Mapping[str, float] | None = None) -> Path:
    """One panel per column of timeseries.csv rows (`columns`: column -> axis label), one
    step line per series (a run, or each replica of a fleet); `scale` multiplies a column
    (e.g. 100 for a fraction shown in %)."""
    series = {name: list(rows) for name, rows in series.items()}
    fig, axes = plt.subplots(len(columns), 1, figsize=(7.5, 2.2 * len(columns) + 0.8), sharex=True, squeeze=False)
    for ax, (column, label) in zip(axes[:, 0], columns.items()):
        k = (scale or {}).get(column, 1.0)
        for i, (name, rows) in enumerate(series.items()):
            ax.step([float(r["time"]) for r in rows], [k * float(r[column]) for r in rows], where="post",
                    color=PALETTE[i % len(PALETTE)], linestyle=("-", "--", "-.", ":")[i % 4], label=name,
                    linewidth=1.0)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7, loc="upper right", ncol=min(4, len(series)))
    axes[-1, 0].set_xlabel("Simulated time (s)")
    fig.suptitle(title, fontsize=10)
    return _save(fig, out)


def run_figures(run_dir: str | Path, *, title: str) -> list[Path]:
    """The figures of one `sim run` result directory, written into it: latency_cdfs.png
    (TTFT, TPOT, E2EL of the completed requests), batch_size.png (sequences and tokens per
    step) and kv_usage.png (KV usage and the queues; a fleet's replicas one line each)."""
    run_dir = Path(run_dir)
    requests = read_csv(run_dir / "requests.csv")
    steps = read_csv(run_dir / "timeseries.csv")
    done = [r for r in requests if r["status"] in ("stop", "length")]
    samples = {"completed requests": {m: [r[col] for r in done if isinstance(r.get(col), float)]
                                      for m, col in (("ttft", "ttft"), ("tpot", "tpot"),
                                                     ("e2el", "request_e2e_time"))}}
    if steps and "replica" in steps[0]:
        series: dict[str, list] = {}
        for r in steps:
            series.setdefault(f"replica {int(r['replica'])}", []).append(r)
    else:
        series = {"run": steps}
    paths = [latency_cdfs(samples, run_dir / "latency_cdfs.png", metrics=("ttft", "tpot", "e2el"),
                          title=f"Latency CDFs, {len(done):,} completed requests\n{title}"),
             series_over_time(series, {"batch_size": "Sequences per step", "batch_tokens": "Tokens per step"},
                              run_dir / "batch_size.png", title=f"Batch size over time\n{title}")]
    if len(series) == 1:
        paths.append(usage_over_time(steps, run_dir / "kv_usage.png", title=f"KV cache usage and queues\n{title}"))
    else:
        paths.append(series_over_time(series, {"kv_usage": "KV cache usage (%)", "running": "Running requests",
                                               "waiting": "Waiting requests"}, run_dir / "kv_usage.png",
                                      title=f"KV cache usage and queues per replica\n{title}",
                                      scale={"kv_usage": 100.0}))
    return paths


def write_json(path: str | Path, data) -> Path:
    """JSON as the figures' data files are committed: sorted keys, one-space indent, a
    final newline, so that rerunning an experiment rewrites a file only if a value changed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path
