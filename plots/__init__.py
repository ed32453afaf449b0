"""Figures of policy comparisons (`plots.figures`, matplotlib PNGs from the simulator's
result files), the experiments behind them (`plots.experiments`), `python -m plots` to
regenerate `plots/figures/`, and the notebook `plots/policy_comparison.ipynb`."""
