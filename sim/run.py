"""`simulate`: run a trace on a deployment with the engine it needs (one batch at a time,
or P batches in flight through pipeline stages)."""
from __future__ import annotations

from sim.config import SimConfig
from sim.engine import ResolvedConfig, SimEngine, SimResult, resolve
from sim.async_scheduling import AsyncSimEngine
from sim.cluster.pipeline_parallel import PipelineSimEngine
from traces import Trace


def simulate(config: SimConfig | ResolvedConfig, trace: Trace, *, progress: bool = False) -> SimResult:
    """Run `trace` on the deployment `config` and return the result."""
    resolved = config if isinstance(config, ResolvedConfig) else resolve(config)
    cfg = resolved.config
    engine = PipelineSimEngine if cfg.pipeline_parallel_size > 1 else AsyncSimEngine if cfg.async_scheduling else SimEngine
    return engine(resolved, trace, progress=progress).run()
