"""Policy comparisons and sharing experiments (`python -m sim compare` / `sim sharing`).

Policy variants are named like the registry: `KIND=NAME` items joined by '+'
(`allocation=orca-max`, `queue=sjf+preemption=swap`), or bare registry names, looked up
across kinds (`paged`, `orca-oracle`, `sjf+swap`); `prefix-caching` (or
`prefix-caching=on|off`) switches the prefix cache. A variant changes only what it names;
the rest comes from the command's flags.

Everything here returns plain rows (dicts); `plots.figures` draws them.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from policies import REGISTRY
from sim.config import POLICY_FIELDS
from sim.engine import SimConfig, SimResult, resolve
from sim.run import simulate
from sim.memory import CATEGORIES
from sim.results import build_summary
from traces import Trace

PREFIX_FLAG = "prefix-caching"
# bare name -> (kind, name); every registry name is unique across kinds
BARE_NAMES = {name: (kind, name) for kind, names in REGISTRY.items() for name in names}

COMPARE_COLUMNS = (
    "rate", "policy", "completed", "rejected", "request_throughput", "output_throughput",
    "mean_normalized_latency", "median_normalized_latency", "p99_normalized_latency",
    "mean_ttft", "p99_ttft", "mean_tpot", "p99_tpot", "mean_e2el", "p99_e2el",
    "num_preemptions", "num_swaps", "kv_usage_mean",
    "token_states_share", "reserved_share", "internal_frag_share", "external_frag_share",
    "prefix_cache_hit_rate", "sharing_saving", "sim_time",
)


class VariantError(ValueError):
    """A policy variant string that names no registry policy."""


def parse_variant(text: str) -> dict:
    """'queue=sjf+preemption=swap' / 'orca-max' / 'paged+prefix-caching' -> SimConfig overrides."""
    settings: dict = {}
    for item in text.split("+"):
        item = item.strip()
        kind, sep, name = item.partition("=")
        kind, name = kind.strip().lower(), name.strip().lower()
        if not sep:
            name = kind
            if name in (PREFIX_FLAG, "no-" + PREFIX_FLAG):
                settings["enable_prefix_caching"] = name == PREFIX_FLAG
                continue
            if name not in BARE_NAMES:
                raise VariantError(f"unknown policy {item!r}: expected KIND=NAME (KIND one of "
                                   f"{', '.join(REGISTRY)}), a registry name ({', '.join(BARE_NAMES)}) "
                                   f"or {PREFIX_FLAG}")
            kind, name = BARE_NAMES[name]
        elif kind == PREFIX_FLAG:
            if name not in ("on", "off", "true", "false", "1", "0"):
                raise VariantError(f"{PREFIX_FLAG}= takes on or off, got {name!r}")
            settings["enable_prefix_caching"] = name in ("on", "true", "1")
            continue
        elif kind not in REGISTRY:
            raise VariantError(f"expected KIND=NAME with KIND one of {', '.join(REGISTRY)} or {PREFIX_FLAG}, "
                               f"got {item!r}")
        if name not in REGISTRY[kind]:
            raise VariantError(f"unknown {kind} policy {name!r}; choose from: {', '.join(REGISTRY[kind])}")
        if POLICY_FIELDS.get(kind, kind) in settings:
            raise VariantError(f"{text!r} names the {kind} policy twice")
        settings[POLICY_FIELDS.get(kind, kind)] = name
    return settings


def parse_variants(specs: Iterable[str] | None) -> list[tuple[str, dict]]:
    """Comma-separated variants (several specs allowed) -> [(label, overrides)]."""
    variants = []
    for spec in specs or ():
        for text in spec.split(","):
            text = text.strip()
            if text:
                variants.append((text, parse_variant(text)))
    return variants


def variant_configs(base: SimConfig, variants: list[tuple[str, dict]]) -> list[tuple[str, SimConfig]]:
    """Each variant applied to `base`, resolved (ValueError on an impossible combination,
    e.g. an orca-* allocation with prefix caching)."""
    out = []
    for label, settings in variants:
        config = replace(base, **settings)
        try:
            resolve(config)
        except ValueError as e:
            raise ValueError(f"policy {label!r}: {e}") from None
        out.append((label, config))
    return out


def row_from_summary(summary: dict, rate: float | None, label: str) -> dict:
    """One comparison row (COMPARE_COLUMNS) from a run's summary."""
    row = {"rate": rate, "policy": label}
    for k in COMPARE_COLUMNS[2:]:
        if k in summary:
            row[k] = summary[k]
    shares = summary.get("memory_breakdown", {}).get("shares", {})
    for c in CATEGORIES:
        row[f"{c}_share"] = shares.get(c)
    row["sharing_saving"] = summary.get("kv_sharing", {}).get("saving")
    return row


def run_grid(base: SimConfig, variants: list[tuple[str, dict]], rates: list[float],
             trace_at: Callable[[float], Trace], *, on_run: Callable[[float, str, SimResult], None] | None = None,
             progress: Callable[[str], None] | None = None) -> list[dict]:
    """Simulate every (rate, variant); rows in rate-major order. `trace_at(rate)` gives the
    trace re-timed to a rate; `on_run` sees each result (e.g. to save its files)."""
    configs = variant_configs(base, variants or [("", {})])
    traces = {rate: trace_at(rate) for rate in rates}
    rows = []
    for rate in rates:
        for label, config in configs:
            if progress:
                progress(f"rate {rate:g} req/s{', ' + label if label else ''} ...")
            result = simulate(config, traces[rate])
            if on_run:
                on_run(rate, label, result)
            rows.append(row_from_summary(build_summary(result), rate, label or default_label(config)))
    return rows


def plot_comparison(rows: list[dict], plot_dir: str | Path, *, config: SimConfig, trace: str,
                    bound: float | None) -> list[Path]:
    """`sim compare --plot`: latency_vs_rate.png and memory_breakdown.png (at the highest
    rate), titled with the trace file and the deployment (model, hardware, TP)."""
    from plots import figures      # matplotlib only when plotting

    plot_dir = Path(plot_dir)
    gpus = f"{config.tensor_parallel_size}x " if config.tensor_parallel_size > 1 else ""
    setting = f"{Path(trace).name}: {config.model} on {gpus}{config.hardware}"
    top = max(r["rate"] for r in rows)
    return [
        figures.latency_vs_rate(rows, plot_dir / "latency_vs_rate.png", bound=bound,
                                title=f"Normalized latency vs request rate\n{setting}"),
        figures.memory_breakdown({r["policy"]: {c: r[f"{c}_share"] or 0.0 for c in figures.BREAKDOWN_ORDER}
                                  for r in rows if r["rate"] == top}, plot_dir / "memory_breakdown.png",
                                 title=f"KV memory in use, time-averaged, at {top:g} req/s\n{setting}"),
    ]


def default_label(config: SimConfig) -> str:
    parts = [config.allocation, config.queue_policy, config.preemption_mode, config.victim_policy]
    if config.enable_prefix_caching:
        parts.append(f"prefix-cache/{config.eviction_policy}")
    return "/".join(parts)


def sustainable_rate(rows: list[dict], policy: str, bound: float,
                     metric: str = "mean_normalized_latency") -> float | None:
    """Highest request rate whose `metric` stays <= bound: the largest swept rate under the
    bound, extended by linear interpolation towards the first rate above it (rates past
    the first violation do not count). None if even the lowest rate violates it."""
    pts = sorted((r["rate"], r[metric]) for r in rows if r["policy"] == policy and r.get(metric) is not None)
    best = None
    for k, (rate, value) in enumerate(pts):
        if value <= bound:
            best = rate
            continue
        if k > 0 and best is not None:
            r0, v0 = pts[k - 1]
            best = r0 + (rate - r0) * (bound - v0) / (value - v0)
        break
    return best


def format_table(rows: list[dict]) -> str:
    """The comparison table: one line per (rate, policy)."""
    width = max([len("policy")] + [len(str(r["policy"])) for r in rows])
    head = (f"{'rate':>6}  {'policy':<{width}}  {'req/s':>6}  {'norm s/tok':>10}  {'p99 norm':>9}  "
            f"{'TTFT s':>7}  {'TPOT ms':>7}  {'preempt':>7}  {'tokens':>6}  {'reserv':>6}  {'intern':>6}  "
            f"{'extern':>6}  {'hit':>5}")
    lines = [head, "-" * len(head)]

    def f(v, spec, scale=1.0):
        return "-" if v is None else format(v * scale, spec)

    for r in rows:
        lines.append(
            f"{r['rate']:>6g}  {r['policy']:<{width}}  {f(r.get('request_throughput'), '6.2f'):>6}  "
            f"{f(r.get('mean_normalized_latency'), '10.4f'):>10}  {f(r.get('p99_normalized_latency'), '9.3f'):>9}  "
            f"{f(r.get('mean_ttft'), '7.2f'):>7}  {f(r.get('mean_tpot'), '7.1f', 1e3):>7}  "
            f"{r.get('num_preemptions', 0):>7}  "
            + "  ".join(f"{f(r.get(c + '_share'), '5.1%'):>6}" for c in CATEGORIES)
            + f"  {f(r.get('prefix_cache_hit_rate'), '4.0%'):>5}")
    return "\n".join(lines)


def format_sustainable(rows: list[dict], bound: float, metric: str = "mean_normalized_latency") -> str:
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    rates = {p: sustainable_rate(rows, p, bound, metric) for p in policies}
    lines = [f"highest request rate with {metric} <= {bound:g} s/token:"]
    ref = rates[policies[0]]
    for p in policies:
        r = rates[p]
        top = max(x["rate"] for x in rows if x["policy"] == p)
        over = "  (bound never exceeded: >= this)" if r is not None and r >= top else ""
        rel = f"  ({r / ref:.2f}x {policies[0]})" if r and ref and p != policies[0] and not over else ""
        lines.append(f"  {p:<24} {'-' if r is None else f'{r:.2f} req/s'}{over}{rel}")
    return "\n".join(lines)


# -- sharing experiments ------------------------------------------------------------------

SHARING_COLUMNS = ("workload", "width", "saving", "mean_physical_blocks", "mean_logical_blocks",
                   "request_throughput", "mean_normalized_latency", "num_preemptions", "prefix_cache_hit_rate")


def sharing_rows(base: SimConfig, trace: Trace, *, ns: Iterable[int] = (), beam_widths: Iterable[int] = (),
                 prefix_lens: Iterable[int] = (), prefix_trace: Callable[[int], Trace] | None = None,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """KV blocks saved by sharing (sim.memory: 1 - physical / logical block-seconds, i.e.
    the same run counted with shared blocks once vs once per table) for parallel sampling
    (n), beam search (width) and a shared system prompt (its length; prefix caching on).
    Paged allocation. Keep the load below saturation: a recompute preemption of a
    multi-sequence request re-prefills each sequence separately (sharing is lost), so an
    overloaded run measures preemptions as much as sharing (rows report their count)."""
    rows = []

    def run(config: SimConfig, tr: Trace) -> dict:
        return build_summary(simulate(config, tr))

    def row(workload: str, width: int, s: dict) -> dict:
        sh = s["kv_sharing"]
        return {"workload": workload, "width": width, "saving": sh["saving"],
                "mean_physical_blocks": sh["mean_physical_blocks"], "mean_logical_blocks": sh["mean_logical_blocks"],
                "request_throughput": s["request_throughput"],
                "mean_normalized_latency": s.get("mean_normalized_latency"),
                "num_preemptions": s["num_preemptions"], "prefix_cache_hit_rate": s["prefix_cache_hit_rate"]}

    paged = replace(base, allocation="paged", n=1, beam_width=0)
    for n in ns:
        if progress:
            progress(f"parallel sampling n={n} ...")
        rows.append(row("parallel sampling", n, run(replace(paged, n=n), trace)))
    for k in beam_widths:
        if progress:
            progress(f"beam search width={k} ...")
        rows.append(row("beam search", k, run(replace(paged, beam_width=k), trace)))
    for length in prefix_lens:
        if prefix_trace is None:
            raise ValueError("prefix lengths need prefix_trace(length)")
        if progress:
            progress(f"shared prefix {length} tokens ...")
        rows.append(row("shared prefix", length, run(replace(paged, enable_prefix_caching=True), prefix_trace(length))))
    return rows


def format_sharing(rows: list[dict]) -> str:
    lines = [f"{'workload':<18} {'n/width/len':>11}  {'saving':>7}  {'blocks':>8}  {'unshared':>8}  {'req/s':>6}  "
             f"{'preempt':>7}  {'hit rate':>8}"]
    for r in rows:
        lines.append(f"{r['workload']:<18} {r['width']:>11}  {r['saving']:>7.1%}  {r['mean_physical_blocks']:>8.1f}  "
                     f"{r['mean_logical_blocks']:>8.1f}  {r['request_throughput']:>6.2f}  {r['num_preemptions']:>7}  "
                     f"{r['prefix_cache_hit_rate']:>8.1%}")
    return "\n".join(lines)
