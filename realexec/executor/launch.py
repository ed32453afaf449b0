"""Which executor runs the model: `--distributed-executor-backend uni | mp | ray`.

Kept apart from `realexec.executor.base` (the base class every executor extends) so that the
dependencies point one way: launch -> {executor, mp_executor, ray_executor} -> executor.
"""
from __future__ import annotations

from realexec.config import EngineArgs
from realexec.executor.base import ExecutorBase, UniprocExecutor


def check_parallel_config(args: EngineArgs) -> None:
    """Refuse a tensor-parallel degree the model cannot split, or pipeline stages its layers
    cannot fill, before any worker starts."""
    from realexec.models.loader import read_model_config
    from realexec.distributed import check_tensor_parallel, stage_layer_ranges
    cfg = read_model_config(args.model)
    check_tensor_parallel(cfg, args.tensor_parallel_size)
    stage_layer_ranges(cfg.num_hidden_layers, args.pipeline_parallel_size, args.pp_layer_partition)


def make_executor(args: EngineArgs) -> ExecutorBase:
    if args.simulate is not None:          # no model, no workers: steps priced by a cost model
        from realexec.executor.simulated import SimulatedExecutor
        return SimulatedExecutor(args)
    backend = args.executor_backend()
    if args.world_size > 1 or args.pp_layer_partition:
        check_parallel_config(args)
    if backend == "uni":
        return UniprocExecutor(args)
    if backend == "mp":
        from realexec.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(args)
    from realexec.executor.ray_executor import RayExecutor
    return RayExecutor(args)


