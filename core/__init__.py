"""twinserve core: the paged KV block manager and the iteration-level scheduler.

Pure Python (no torch, simpy or numpy): both the simulator and the real executor
drive this same code.
"""
from core.config import CacheConfig, SchedulerConfig
from core.engine import EngineCore, Executor
from core.kv.block_hash import block_hasher, register_block_hasher
from core.kv.kv_cache_manager import KVCacheManager, SwapSpaceExhaustedError
from core.sched.request import Request, RequestStatus, Sequence
from core.sampling_params import InvalidRequestError, SamplingParams
from core.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput, StepResult
from core.sched.scheduler import Scheduler

__all__ = [
    "CacheConfig", "SchedulerConfig", "EngineCore", "Executor", "KVCacheManager", "SwapSpaceExhaustedError",
    "block_hasher", "register_block_hasher", "Request", "RequestStatus", "Sequence", "InvalidRequestError", "SamplingParams",
    "ModelRunnerOutput", "ScheduledSeq", "Scheduler", "SchedulerOutput", "StepResult",
]
