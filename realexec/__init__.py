"""twinserve's real executor: a torch/Triton engine over the shared core.

    from realexec import LLM, SamplingParams, EngineArgs

Exports resolve lazily, so `import realexec.kernels` or `realexec.attention` stays light.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "realexec.engine.llm",
    "LLMEngine": "realexec.engine.llm_engine",
    "RequestOutput": "realexec.engine.llm_engine",
    "CompletionOutput": "realexec.engine.llm_engine",
    "EngineArgs": "realexec.config",
    "SamplingParams": "core",
    "InvalidRequestError": "core",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
