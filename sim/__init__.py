"""twinserve simulator: the core scheduler and block manager on a SimPy clock.

    from sim import SimConfig, simulate, write_results
    from traces import load_trace
    result = simulate(SimConfig(model="Llama-2-13B", hardware="A100-40G"), load_trace("traces/sharegpt.json"))
    summary = write_results(result, "results/run")

`sim` never imports `realexec`; the two backends share only `core` and `policies`.
"""
from sim.config import DEFAULT_HARDWARE, DEFAULT_MODEL, SimConfig
from sim.engine import ResolvedConfig, SimEngine, SimResult, resolve
from sim.run import simulate
from sim.executor import SimExecutor
from sim.results import build_summary, format_summary, write_results

__all__ = [
    "DEFAULT_HARDWARE", "DEFAULT_MODEL", "ResolvedConfig", "SimConfig", "SimEngine", "SimExecutor", "SimResult",
    "build_summary", "format_summary", "resolve", "simulate", "write_results",
]
