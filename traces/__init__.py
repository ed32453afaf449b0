"""Request traces for twinserve: one record type, loaders for public trace formats,
re-timing, and the committed ``sharegpt.json`` (see README.md).

    from traces import load_trace
    trace = load_trace("traces/sharegpt.json")                      # format detected
    trace = load_trace("traces/azure_conv_2023.vidur.csv", rate=8.0, num_requests=500)

Pure Python: loading never imports torch, transformers or tokenizers (only
``traces.build`` does, to tokenize ShareGPT).
"""
from .formats import LOADERS, detect_format, load_trace, register_format
from .model import Trace, TraceError, TraceRequest
from .mooncake import HashedBlockTokens
from .retime import arrival_times, retime
from .stats import trace_stats
from .twinserve_json import dumps_trace, save_trace

__all__ = [
    "LOADERS", "HashedBlockTokens", "Trace", "TraceError", "TraceRequest", "arrival_times", "detect_format",
    "dumps_trace", "load_trace", "register_format", "retime", "save_trace", "trace_stats",
]
