"""plots.figures (and `sim compare --plot`): what a reader of each figure relies on --
titles that say what was run, rounded numbers, nothing silently off the chart, axes cut
at a stated percentile, every panel labelled, a colour-blind-safe palette."""
from __future__ import annotations

import pytest
from matplotlib.colors import to_hex

from plots import figures
from sim import SimConfig
from sim.explore.compare import plot_comparison

OKABE_ITO = {c.lower() for c in figures.OKABE_ITO.values()}
GREY = to_hex("grey")


@pytest.fixture
def drawn(monkeypatch) -> list:
    """Every figure a plots.figures function saves (still inspectable after plt.close)."""
    figs = []
    save = figures._save

    def keep(fig, out, *args, **kwargs):
        figs.append(fig)
        return save(fig, out, *args, **kwargs)

    monkeypatch.setattr(figures, "_save", keep)
    return figs


LATENCY = {"paged": [0.026, 0.03, 0.04, 0.116], "orca-max": [0.03, 0.48, 1.33, 1.63]}
RATES = [0.5, 1, 2, 4]


def compare_rows() -> list[dict]:
    rows = []
    for policy, values in LATENCY.items():
        for rate, v in zip(RATES, values):
            shares = {"token_states": 0.9, "reserved": 0.0, "internal_frag": 0.1, "external_frag": 0.0}
            rows.append({"rate": rate, "policy": policy, "mean_normalized_latency": v,
                         **{f"{c}_share": x for c, x in shares.items()}})
    return rows


def texts(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in ax.texts] + ([t.get_text() for t in legend.get_texts()] if legend else [])


def test_compare_plot_titles_rounded_bound_and_points_off_the_chart(drawn, tmp_path):
    config = SimConfig(model="Llama-3-8B", hardware="H100", tensor_parallel_size=2)
    paths = plot_comparison(compare_rows(), tmp_path, config=config, trace="traces/azure_conv_2023.vidur.csv",
                            bound=0.10252411)
    assert [p.name for p in paths] == ["latency_vs_rate.png", "memory_breakdown.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    latency, breakdown = (fig.axes[0] for fig in drawn)
    for ax in (latency, breakdown):
        assert "azure_conv_2023.vidur.csv: Llama-3-8B on 2x H100" in ax.get_title()
    assert "at 4 req/s" in breakdown.get_title()
    labels = texts(latency)
    assert "bound 0.103 s/token" in labels and not any("0.102524" in t for t in labels)
    ymax = latency.get_ylim()[1]
    assert ymax == pytest.approx(6 * 0.10252411)
    # the two orca-max points above the axis: open triangles on its top edge, with their values
    edge = [line for line in latency.get_lines() if line.get_marker() == "^" and list(line.get_ydata()) == [ymax]]
    assert len(edge) == 2 and {"1.33", "1.63"} <= set(labels)
    # every point inside the axes has an unclipped marker (no half-cut markers at the edges)
    unclipped = {(x, y) for line in latency.get_lines() if not line.get_clip_on() and line.get_marker() not in
                 ("^", "None", "", None) for x, y in zip(line.get_xdata(), line.get_ydata())}
    inside = {(r, v) for values in LATENCY.values() for r, v in zip(RATES, values) if v <= ymax}
    assert inside <= unclipped


def test_latency_cdf_axis_cut_at_a_stated_percentile(drawn, tmp_path):
    tpot = [0.05 + 0.0005 * i for i in range(199)] + [30.0]          # one 30 s outlier
    figures.latency_cdfs({"paged": {"ttft": [0.1, 0.2, 0.3], "tpot": tpot}}, tmp_path / "cdf.png")
    ttft_ax, tpot_ax = drawn[0].axes
    p99 = figures.percentile(sorted(tpot), 99)
    assert tpot_ax.get_xlim()[1] == pytest.approx(p99) and p99 < 1
    assert "cut at the p99" in tpot_ax.get_xlabel() and "max 30 s" in tpot_ax.get_xlabel()
    assert "cut" not in ttft_ax.get_xlabel()                         # nothing hidden there: not said


def all_figures(tmp_path) -> None:
    series = [{"time": t, "kv_usage": t / 10, "running": t, "waiting": 10 - t, "swapped": 1,
               "token_states": 0.5, "reserved": 0.2, "internal_frag": 0.1, "external_frag": 0.05}
              for t in range(10)]
    figures.latency_vs_rate(compare_rows(), tmp_path / "a.png", bound=0.1)
    figures.usage_over_time(series, tmp_path / "b.png")
    figures.memory_breakdown({"paged": {"token_states": 0.97, "internal_frag": 0.03},
                              "orca-max": {"token_states": 0.2, "reserved": 0.1, "internal_frag": 0.7}},
                             tmp_path / "c.png")
    figures.sharing_savings([{"workload": "parallel sampling", "width": w, "saving": 0.1 * w} for w in (2, 4)]
                            + [{"workload": "beam search", "width": w, "saving": 0.2 * w} for w in (2, 4)]
                            + [{"workload": "shared prefix", "width": 80, "saving": 0.3}], tmp_path / "d.png")
    figures.memory_over_time({"paged": series, "orca-max": series}, tmp_path / "e.png")
    figures.latency_cdfs({"paged": {"ttft": [0.1, 0.2], "tpot": [0.02, 0.03]},
                          "orca-max": {"ttft": [0.3, 0.9], "tpot": [0.05, 0.04]}}, tmp_path / "f.png")
    fleet = {"p90_ttft": 0.5, "mean_tpot": 0.02, "p90_tpot": 0.03, "prefix_cache_hit_rate": 0.1,
             "slo_attainment": 0.9, "goodput_per_gpu": 2.0}
    figures.router_comparison([{**fleet, "load": f"{x} req/s", "router": r} for x in (1, 2)
                               for r in ("round-robin", "prefix-aware")], tmp_path / "g.png")
    figures.disagg_comparison([{**fleet, "load": f"{x} req/s", "variant": v} for x in (1, 2)
                               for v in ("4 co-located", "2P:2D nvlink")], tmp_path / "h.png")


def test_every_panel_has_axis_labels(drawn, tmp_path):
    all_figures(tmp_path)
    assert len(drawn) == 8
    for fig in drawn:
        main_axes = []
        for ax in fig.axes:
            twin = any(other.get_position().bounds == ax.get_position().bounds for other in main_axes)
            assert ax.get_ylabel(), (fig.axes[0].get_title(), "no y label")
            assert twin or ax.get_xlabel(), (ax.get_title(), "no x label")   # a twinx shares its x label
            main_axes.append(ax)


def test_figures_use_the_colour_blind_safe_palette(drawn, tmp_path):
    all_figures(tmp_path)
    used = set()
    for fig in drawn:
        for ax in fig.axes:
            used |= {to_hex(line.get_color()) for line in ax.get_lines() if line.get_xdata() is not None
                     and len(line.get_xdata())}
            used |= {to_hex(patch.get_facecolor()) for patch in ax.patches}
            used |= {to_hex(c) for coll in ax.collections for c in coll.get_facecolor()}
    assert used and used <= OKABE_ITO | {GREY, "#ffffff"}, used - OKABE_ITO
