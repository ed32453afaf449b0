"""Paged attention on the CPU in one C++/OpenMP call per layer: the CPU default backend.

Every sequence of a step (decodes, whole prefills, chunks after a cached or prefix-hit
context) is handled by one call of `csrc/paged_attention.cpp`, which also writes the
step's new K/V into the cache. It reads K/V block by block through the block tables (no
gather into new tensors, no Python loop over sequences), spreads (sequence, kv head,
query tile) work items over torch's OpenMP threads, and keeps the query heads of a GQA
group together so each key block is loaded once per group.

The kernel is a plain C ABI library built on first use (`realexec.cpu_build`, shared with
the fused elementwise ops) with the system C++ compiler (`$CXX`, else g++/c++; about
1-2 s) into `$TWINSERVE_CACHE_DIR/kernels/` (default ~/.cache/twinserve), keyed by the
source, the flags and this CPU's feature flags (-march=native), and loaded with ctypes:
no build-time dependency on torch and no torch headers to compile. It links libgomp.so.1,
the soname torch's own OpenMP runtime is loaded under, so both share one thread pool and
torch.set_num_threads applies to both.

Only fp32 on the CPU runs the kernel; other dtypes and the cache-less profiling run fall
back to the torch reference (`TorchAttentionBackend`, also the tests' oracle).
"""
from __future__ import annotations

import ctypes
import threading
import warnings
from pathlib import Path

import torch

from realexec import cpu_build

from .metadata import AttentionMetadata, check_layer_options
from .torch_backend import TorchAttentionBackend

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_HINT = "--attention-backend torch runs without one"
ABI_VERSION = 2
# Query tokens per work item: rows = tile x GQA group; measured on SmolLM2 shapes (group 3).
DEFAULT_TILE_ROWS = 48

_ERRORS = {-1: "bad head counts, head size, block size or tile",
           -2: "a slot_mapping entry lies outside the KV cache",
           -3: "query_start_loc is not an increasing offset list within the batch",
           -4: "a block table entry a sequence reads lies outside the KV cache (or the table is too narrow)",
           -5: "bad sliding window or soft cap"}
_lock = threading.Lock()
_lib = None


class KernelBuildError(cpu_build.BuildError):
    """The C++ paged-attention kernel could not be compiled or loaded."""


def build(verbose: bool = False) -> Path:
    """Compile the kernel into the cache (if not there yet) and return the library's path
    (realexec.cpu_build: keyed by source, flags and CPU; atomic rename into place)."""
    return cpu_build.build(SOURCE, "the CPU attention kernel", hint=_HINT, error=KernelBuildError,
                           verbose=verbose)


def load_library():
    """The compiled kernel as a ctypes library (built on first use; once per process)."""
    global _lib
    with _lock:
        if _lib is None:
            lib = cpu_build.load(build(), "the CPU attention kernel", "twinserve_paged_attention_abi_version",
                                 ABI_VERSION, KernelBuildError)
            fn = lib.twinserve_paged_attention_f32
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [p, i64, p, i64, p, i64, p, p, p, i64, p, i64, p, p, i64,
                           i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_float, i64, p]
            fn.restype = ctypes.c_int
            _lib = lib
        return _lib


class CpuAttentionBackend:
    """Batched paged attention on the CPU (fp32): one kernel call per layer and step."""
    name = "cpu"

    def __init__(self, tile_rows: int = DEFAULT_TILE_ROWS) -> None:
        if tile_rows < 1:
            raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
        self.tile_rows = tile_rows
        self._fn = load_library().twinserve_paged_attention_f32
        self.reference = TorchAttentionBackend()
        self._md: AttentionMetadata | None = None
        self._step: tuple = ()

    def _step_args(self, md: AttentionMetadata) -> tuple:
        """The metadata as contiguous tensors of the kernel's dtypes, once per step (every
        layer gets the same metadata object); the tensors are kept alive in self._step."""
        if md is not self._md:
            slots = md.slot_mapping.to(torch.int64).contiguous()
            tables = md.block_tables.to(torch.int32).contiguous()
            qsl = md.query_start_loc.to(torch.int32).contiguous()
            lens = md.seq_lens.to(torch.int32).contiguous()
            if tables.dim() != 2 or qsl.numel() != lens.numel() + 1:
                raise ValueError(f"attention metadata: block_tables {tuple(tables.shape)}, query_start_loc "
                                 f"{tuple(qsl.shape)} and seq_lens {tuple(lens.shape)} do not describe one batch")
            self._step = (slots, tables, qsl, lens)
            self._md = md
        return self._step

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                md: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """The torch backend's contract, sliding window and logit soft cap included."""
        check_layer_options(sliding_window, logits_soft_cap)
        if (k_cache is None or q.device.type != "cpu" or q.dtype != torch.float32
                or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32):
            return self.reference.forward(q, k, v, k_cache, v_cache, md, scale, sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        if k_cache.shape[3] != head_dim or k_cache.shape[1] != md.block_size or num_heads % num_kv_heads:
            raise ValueError(f"q {tuple(q.shape)} does not fit a KV cache of {tuple(k_cache.shape)}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache tensors must be contiguous")
        # The kernel takes one token stride per tensor; heads and head_dim must be packed.
        q = q if q.stride()[1:] == (head_dim, 1) else q.contiguous()
        k = k if k.stride()[1:] == (head_dim, 1) else k.contiguous()
        v = v if v.stride()[1:] == (head_dim, 1) else v.contiguous()
        slots, tables, qsl, lens = self._step_args(md)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        tile = max(1, self.tile_rows // (num_heads // num_kv_heads))
        rc = self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                      k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), num_tokens,
                      tables.data_ptr(), tables.stride(0), qsl.data_ptr(), lens.data_ptr(), lens.numel(),
                      num_heads, num_kv_heads, head_dim, md.block_size, k_cache.shape[0], scale,
                      sliding_window or 0, float(logits_soft_cap or 0.0), tile, out.data_ptr())
        if rc != 0:
            raise ValueError(f"CPU attention kernel: {_ERRORS.get(rc, f'code {rc}')} (q {tuple(q.shape)}, "
                             f"cache {tuple(k_cache.shape)}, {md.num_seqs} sequences)")
        return out


def default_cpu_backend():
    """The CPU default: the kernel backend, or (no compiler, build failed) the torch
    reference with a warning saying why."""
    try:
        return CpuAttentionBackend()
    except KernelBuildError as e:
        warnings.warn(f"{e}\nfalling back to the slower torch attention backend", RuntimeWarning, stacklevel=2)
        return TorchAttentionBackend()
