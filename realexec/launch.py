"""Which executor runs the model: `--distributed-executor-backend uni | mp | ray`.

Kept apart from `realexec.executor` (the base class every executor extends) so that the
dependencies point one way: launch -> {executor, mp_executor, ray_executor} -> executor.
"""
from __future__ import annotations

from realexec.config import EngineArgs
from realexec.executor import ExecutorBase, UniprocExecutor


def check_parallel_config(args: EngineArgs) -> None:
    """Refuse a tensor-parallel degree the model cannot split, before any worker starts."""
    from realexec.loader import read_model_config
    from realexec.parallel import check_tensor_parallel
    check_tensor_parallel(read_model_config(args.model), args.tensor_parallel_size)


def make_executor(args: EngineArgs) -> ExecutorBase:
    backend = args.executor_backend()
    if args.tensor_parallel_size > 1:
        check_parallel_config(args)
    if backend == "uni":
        return UniprocExecutor(args)
    if backend == "mp":
        from realexec.mp_executor import MultiprocExecutor
        return MultiprocExecutor(args)
    from realexec.ray_executor import RayExecutor
    return RayExecutor(args)


