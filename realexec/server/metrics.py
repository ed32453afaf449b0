"""Prometheus metrics of the server, named like vLLM's with the `twinserve:` prefix.

Each app has its own CollectorRegistry (tests create several apps in one process).
Request-level counters and histograms are updated by the engine thread as outputs come
out (prometheus_client's metrics are thread-safe); engine-state gauges and the
scheduler's cumulative counters come from an `EngineStats` snapshot the engine thread
hands to `publish` after every loop iteration (one way: metrics never read the engine).
Rejections are counted by the HTTP layer under the error's code (errors.REJECTION_CODES).

| metric | type | vLLM name |
|---|---|---|
| twinserve:num_requests_running / _waiting / _swapped | gauge | vllm:num_requests_* |
| twinserve:kv_cache_usage_perc (0..1), twinserve:cpu_cache_usage_perc | gauge | vllm:kv_cache_usage_perc |
| twinserve:prefix_cache_queries_total / _hits_total (prompt tokens) | counter | vllm:prefix_cache_queries / _hits |
| twinserve:num_preemptions_total | counter | vllm:num_preemptions |
| twinserve:prompt_tokens_total / generation_tokens_total | counter | same |
| twinserve:request_success_total{finished_reason=stop,length,abort} | counter | same |
| twinserve:request_rejected_total{reason=<error code>} | counter | (ours) |
| twinserve:num_gpu_blocks, twinserve:num_used_gpu_blocks | gauge | (ours) |
| twinserve:time_to_first_token_seconds | histogram | same |
| twinserve:inter_token_latency_seconds (one per output step) | histogram | same (v0: time_per_output_token_seconds) |
| twinserve:request_time_per_output_token_seconds (one per request) | histogram | same |
| twinserve:e2e_request_latency_seconds, twinserve:request_queue_time_seconds | histogram | same |
| twinserve:request_prompt_tokens / request_generation_tokens | histogram | same |
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from realexec.server.errors import REJECTION_CODES

if TYPE_CHECKING:
    from realexec.engine.llm_engine import RequestOutput

# No `*_created` timestamp series next to every counter (vLLM does the same; it is a
# process-wide switch of prometheus_client).
prometheus_client.disable_created_metrics()

PREFIX = "twinserve:"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]

@dataclass(frozen=True)
class EngineStats:
    """What the engine thread publishes after each loop iteration (replaced whole)."""
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    kv_cache_usage_perc: float = 0.0
    cpu_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_gpu_blocks: int = 0
    num_used_gpu_blocks: int = 0
    num_pending: int = 0                # engine requests the server still routes outputs for


_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be admitted (new or preempted by recompute).",
    "num_requests_swapped": "Requests whose KV blocks are swapped out to CPU memory.",
    "kv_cache_usage_perc": "Fraction of KV-cache (GPU pool) blocks in use; 1 = full.",
    "cpu_cache_usage_perc": "Fraction of the CPU swap pool's blocks in use.",
    "num_gpu_blocks": "KV-cache (GPU pool) blocks in total.",
    "num_used_gpu_blocks": "KV-cache (GPU pool) blocks in use (0 when idle: nothing leaks).",
}
_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Preemptions (recompute or swap) so far.",
}


class _EngineStateCollector:
    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        stats, model_name = asdict(self.metrics.stats), self.metrics.model_name
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([model_name], float(stats[name]))
            yield g
        for name, doc in _COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([model_name], float(stats[name]))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, label = self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, label + list(labels), registry=reg)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=reg).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self._rejected = counter("request_rejected", "Requests refused before admission.", ["reason"])
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        for reason in REJECTION_CODES:
            self._rejected.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output steps of a request.",
                             ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output steps - 1).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time spent waiting (incl. after preemption).",
                                    E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request (all samples).", TOKEN_BUCKETS)
        self.stats = EngineStats()
        self.registry.register(_EngineStateCollector(self))

    def request_finished_reason(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def publish(self, stats: EngineStats) -> None:
        """Called by the engine thread; scrapes read whichever snapshot is current."""
        self.stats = stats

    def request_rejected(self, code: str) -> None:
        """Count one refused request under its error code (one of REJECTION_CODES)."""
        self._rejected.labels(self.model_name, code).inc()

    def output(self, out: "RequestOutput") -> None:
        """One RequestOutput (see `outputs`)."""
        self.outputs([out])

    def outputs(self, outs: "list[RequestOutput]") -> None:
        """Called by the engine thread with each step's RequestOutputs: the generated tokens
        are counted once per step (a counter update takes a lock), finished requests observed."""
        generated = 0
        for out in outs:
            for c in out.outputs:
                generated += len(c.token_ids_delta)
            if out.finished:
                self._finished(out)
        if generated:
            self.generation_tokens.inc(generated)

    def _finished(self, out: "RequestOutput") -> None:
        m = out.metrics
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.request_finished_reason(reason or "stop")
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        times = m.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        self.queue_time.observe(m.queue_time)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))

    def render(self) -> bytes:
        return generate_latest(self.registry)
