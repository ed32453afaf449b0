"""Where a CPU engine's step time goes, by operator, and how close each gets to the machine.

`bench throughput --op-breakdown` runs the generate loop with a timer around every call of
the model's operators (in this process: the uni executor on the CPU):

  projections  every Linear / RowParallelLinear (fused qkv, o, fused gate/up, down; MoE
               routers and experts' dense layers): FLOPs 2 x rows x in x out, also by the
               step's row count (1-3 rows take MKL's GEMV, more the packed GEMM; see
               realexec/models/linear.py), the shapes the scheduler actually produced;
  LM head      compute_logits (one row per sampled sequence): FLOPs 2 x rows x hidden x vocab;
  attention    the attention backend's call (K/V written into the cache, then read): bytes
               of K and V the step's sequences read (context length x K/V row x 2);
  norms, activation, rotary   the fused elementwise ops of realexec.models.cpu_ops (RMSNorm,
               residual add + RMSNorm, SiLU(gate)*up, rotary of q and k);
  rest         the loop's wall time minus the above: embedding, sampling, the scheduler,
               input preparation, detokenization, Python.

The rates are set against the machine measured in the same process right after the run
(`machine_peaks`): a large square fp32 GEMM (GFLOP/s) and a sum over 256 MiB (GB/s read
from memory), so a share of each peak says how much faster that operator could get here.
CPU ops run synchronously, so a call's wall time is its cost; on a GPU it would be the
launch time, hence CPU only.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from realexec.models.linear import weight_shape

CATEGORIES = ("projections", "LM head", "attention", "norms", "activation", "rotary")
# Row-count buckets of projection calls: (label, lowest rows, highest rows).
ROW_BUCKETS = (("1-3", 1, 3), ("4-31", 4, 31), ("32-127", 32, 127), ("128-511", 128, 511),
               ("512+", 512, 1 << 62))


class _Tally:
    __slots__ = ("seconds", "calls", "flops", "bytes")

    def __init__(self):
        self.seconds, self.calls, self.flops, self.bytes = 0.0, 0, 0, 0


class OpBreakdown:
    """A context manager that times `model`'s operator calls while it is entered.

    Hooks go on the projection modules, wrappers on the attention backends' `forward`, the
    model's `compute_logits` and the fused ops of realexec.models.cpu_ops (the model looks
    them up there at each call); all are removed on exit. None of the timed calls nests in
    another, so the times add."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.tally = {c: _Tally() for c in CATEGORIES}
        self.by_rows: dict[str, _Tally] = defaultdict(_Tally)
        self._undo: list = []

    # -- installing and removing ------------------------------------------------------
    def __enter__(self) -> "OpBreakdown":
        from realexec.models import cpu_ops

        try:
            backends = {}
            for m in self.model.modules():
                if getattr(m, "projects", False):
                    self._hook(m, self._projection_done)
                backend = getattr(m, "backend", None)
                if backend is not None and hasattr(backend, "forward"):
                    backends[id(backend)] = backend
            for backend in backends.values():
                self._wrap_attr(backend, "forward", lambda f: self._timed(f, "attention", self._attention_work))
            self._wrap_attr(self.model, "compute_logits", lambda f: self._timed(f, "LM head", self._logits_work))
            for name, category in (("rms_norm", "norms"), ("add_rms_norm", "norms"),
                                   ("silu_and_mul", "activation"), ("apply_rotary_qk", "rotary")):
                self._wrap_attr(cpu_ops, name, lambda f, c=category: self._timed(f, c))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def _hook(self, module: torch.nn.Module, done) -> None:
        started = []

        def pre(mod, args):
            started.append(time.perf_counter())

        def post(mod, args, out):
            done(mod, args[0], time.perf_counter() - started.pop())

        handles = (module.register_forward_pre_hook(pre), module.register_forward_hook(post))
        self._undo.append(lambda: [h.remove() for h in handles])

    def _wrap_attr(self, owner, name: str, make) -> None:
        """owner.name = make(original) until exit; an instance's own attribute is restored
        as it was (or deleted, when the original came from its class)."""
        had_own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original) if had_own else delattr(owner, name))

    # -- what each call adds ----------------------------------------------------------
    def _projection_done(self, module, x: torch.Tensor, seconds: float) -> None:
        rows = x.numel() // x.shape[-1]
        out_features, in_features = weight_shape(module.weight)
        flops = 2 * rows * in_features * out_features
        for t in (self.tally["projections"], self.by_rows[_row_bucket(rows)]):
            t.seconds += seconds
            t.calls += 1
            t.flops += flops

    def _timed(self, fn, category: str, work=None):
        """fn, timed into `category`; work(*args, **kwargs) -> (flops, bytes) of the call."""
        t = self.tally[category]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t.seconds += time.perf_counter() - t0
                t.calls += 1
                if work is not None:
                    flops, nbytes = work(*args, **kwargs)
                    t.flops += flops
                    t.bytes += nbytes
        return timed

    @staticmethod
    def _attention_work(q, k, v, k_cache, v_cache, md, *args, **kwargs) -> tuple[int, int]:
        if k_cache is None:
            return 0, 0
        row = k_cache[0, 0].numel() * k_cache.element_size()   # [blocks, block_size, kv_heads, D]: one K row
        return 0, 2 * row * sum(md.seq_lens_cpu)

    def _logits_work(self, hidden, *args, **kwargs) -> tuple[int, int]:
        weight = self.model.head_weight()
        if weight is None:
            return 0, 0
        return 2 * (hidden.numel() // hidden.shape[-1]) * weight.shape[0] * weight.shape[1], 0

    # -- the result -------------------------------------------------------------------
    def report(self, wall_seconds: float, peaks: dict | None = None) -> dict:
        """{"wall_s", "ops": {category: {seconds, share, calls, gflop, gflops, gb, gbps,
        share_of_peak}}, "rest": {...}, "projections_by_rows": {...}, "peaks"}."""
        peaks = peaks or {}

        def row(t: _Tally) -> dict:
            r = {"seconds": t.seconds, "share": t.seconds / wall_seconds if wall_seconds else 0.0, "calls": t.calls}
            if t.flops:
                r["gflop"] = t.flops / 1e9
                r["gflops"] = t.flops / 1e9 / t.seconds if t.seconds else 0.0
                if peaks.get("gemm_gflops"):
                    r["share_of_peak"] = r["gflops"] / peaks["gemm_gflops"]
            if t.bytes:
                r["gb"] = t.bytes / 1e9
                r["gbps"] = t.bytes / 1e9 / t.seconds if t.seconds else 0.0
                if peaks.get("read_gbps"):
                    r["share_of_peak"] = r["gbps"] / peaks["read_gbps"]
            return r

        ops = {c: row(t) for c, t in self.tally.items()}
        timed = sum(t.seconds for t in self.tally.values())
        rest = max(0.0, wall_seconds - timed)
        by_rows = {label: row(self.by_rows[label]) for label, *_ in ROW_BUCKETS if label in self.by_rows}
        return {"wall_s": wall_seconds, "ops": ops,
                "rest": {"seconds": rest, "share": rest / wall_seconds if wall_seconds else 0.0},
                "projections_by_rows": by_rows, "peaks": peaks}


def _row_bucket(rows: int) -> str:
    for label, lo, hi in ROW_BUCKETS:
        if lo <= rows <= hi:
            return label
    return ROW_BUCKETS[0][0]


def machine_peaks(threads: int | None = None, rounds: int = 5) -> dict:
    """This process's CPU right now: the best of `rounds` large square fp32 GEMMs (2048^3;
    MKL's, and oneDNN's and MKL's on a pre-packed weight where torch has them: the fastest,
    1.2-1.3x plain MKL's on the AVX-512 dev hosts) and of `rounds` sums over 256 MiB of random
    floats (memory read, not the zero page)."""
    from realexec.models.linear import mkl_available, packable, packed_parameter, project

    if threads:
        torch.set_num_threads(threads)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    gemms = [lambda: torch.mm(a, b)]
    for gemm in ("onednn", "mkl") if mkl_available() else ("onednn",):
        if packable(b, gemm):
            packed = packed_parameter(b, 1, gemm)
            gemms.append(lambda p=packed: project(a, p))
    best_gemm = float("inf")
    for gemm in gemms:
        gemm()
        best_gemm = min(best_gemm, *(_seconds(gemm) for _ in range(rounds)))
    x = torch.randn(64 << 20)            # 256 MiB
    x.sum()
    best_read = min(_seconds(x.sum) for _ in range(rounds))
    return {"gemm_gflops": 2 * n ** 3 / best_gemm / 1e9, "read_gbps": x.numel() * 4 / best_read / 1e9,
            "threads": torch.get_num_threads()}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def format_report(rep: dict) -> str:
    peaks = rep["peaks"]
    lines = [f"op breakdown of the generate loop ({rep['wall_s']:.1f} s wall"
             + (f"; this CPU now: large GEMM {peaks['gemm_gflops']:.0f} GFLOP/s, memory read "
                f"{peaks['read_gbps']:.1f} GB/s, {peaks['threads']} threads" if peaks else "") + "):",
             f"  {'op':<12} {'seconds':>8} {'share':>6} {'calls':>8}  {'work':>14} {'rate':>14} {'of peak':>7}"]

    def line(name: str, r: dict) -> str:
        work = rate = peak = ""
        if "gflop" in r:
            work, rate = f"{r['gflop']:.1f} GFLOP", f"{r['gflops']:.1f} GFLOP/s"
        elif "gb" in r:
            work, rate = f"{r['gb']:.1f} GB K/V", f"{r['gbps']:.1f} GB/s"
        if "share_of_peak" in r:
            peak = f"{100 * r['share_of_peak']:.0f}%"
        calls = f"{r['calls']:>8}" if "calls" in r else " " * 8
        return f"  {name:<12} {r['seconds']:8.2f} {100 * r['share']:5.1f}% {calls}  {work:>14} {rate:>14} {peak:>7}"

    for name, r in rep["ops"].items():
        lines.append(line(name, r))
    lines.append(line("rest", rep["rest"]))
    if rep["projections_by_rows"]:
        lines.append("  projections by the call's rows (tokens of the step):")
        for label, r in rep["projections_by_rows"].items():
            lines.append(line(f"  {label}", r))
    return "\n".join(lines)
