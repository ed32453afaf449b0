"""Fused elementwise ops of the Llama-family layers on the CPU, with the torch code as oracle.

On the CPU in fp32 a decoder layer's elementwise work is otherwise separate ATen ops (each
a pass over memory and a dispatch): RMSNorm, the residual add before the second norm,
SiLU(gate) * up, and the rotary embedding of q and k. `csrc/cpu_ops.cpp` does each in one
vectorized pass (OpenMP over rows for big calls), built and loaded like the attention kernel
(`realexec.cpu_build`). Every function here runs the C++ op only when all of these hold:
the tensors are fp32 on the CPU with supported shapes/strides, autograd is off (or nothing
requires grad), torch.compile is not tracing, the ops are enabled (`TWINSERVE_CPU_FUSED_OPS`
is not "0"; `enabled(False)` in tests) and the library built. Otherwise the exact torch code
runs, so GPU, bf16/fp16 and compiled paths are unchanged. No compiler: torch silently (the
attention backend already warns about it).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
ABI_VERSION = 2

_enabled = os.environ.get("TWINSERVE_CPU_FUSED_OPS", "1") != "0"
_lock = threading.Lock()
_lib = None
_tried = False
_is_compiling = torch.compiler.is_compiling
_F32 = torch.float32
_CONTIGUOUS = torch.contiguous_format


@contextlib.contextmanager
def enabled(on: bool):
    """Turn the fused ops on or off inside the block (tests: `enabled(False)` forces torch)."""
    global _enabled
    old, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = old


def _load():
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            from realexec import cpu_build
            try:
                lib = cpu_build.load(cpu_build.build(SOURCE, "the fused CPU ops"), "the fused CPU ops",
                                     "twinserve_cpu_ops_abi_version", ABI_VERSION)
            except cpu_build.BuildError:
                return None
            p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
            for name, args in (("twinserve_rms_norm_f32", [p, i64, p, p, i64, i64, f32]),
                               ("twinserve_add_rms_norm_f32", [p, p, p, p, p, i64, i64, f32]),
                               ("twinserve_silu_and_mul_f32", [p, i64, p, i64, i64]),
                               ("twinserve_rotary_qk_f32", [p, i64, p, i64, p, p, i64, p, p, i64, i64, i64, i64]),
                               ("twinserve_argmax_rows_f32", [p, i64, p, i64, i64]),
                               ("twinserve_cpu_ops_set_parallel_min", [i64])):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, None
            _lib = lib
        return _lib


def library():
    """The loaded C++ ops (built on first use), or None without a compiler or after a failed build."""
    return _lib if _tried else _load()


def _usable(*tensors: torch.Tensor):
    """The library when the C++ ops may run on `tensors`, else None (kept lean: this runs
    several times per layer and step)."""
    if not _enabled:
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype is not _F32 or not t.is_cpu or (grad and t.requires_grad):
            return None
    if _is_compiling():
        return None
    return _lib if _tried else _load()


def _rows(x: torch.Tensor):
    """x as (rows, row stride) when its last dim is contiguous and its leading dims flatten
    to one stride; else None."""
    if x.is_contiguous():
        d = x.shape[-1] if x.dim() else 0
        return (x.numel() // d, d) if d else None
    if x.dim() < 1 or x.stride(-1) != 1:
        return None
    if x.dim() == 1:
        return 1, x.shape[0]
    rows, stride = x.shape[-2], x.stride(-2)
    for d in range(x.dim() - 3, -1, -1):
        if x.shape[d] != 1 and x.stride(d) != x.shape[d + 1] * x.stride(d + 1):
            return None
        rows *= x.shape[d]
    return rows, stride


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32, scale in the model dtype (same rounding as the HF reference).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) (RMSNorm of realexec.models.llama)."""
    lib = _usable(x, weight)
    if lib is not None and weight.dim() == 1 and weight.is_contiguous() and weight.shape[0] == x.shape[-1]:
        rs = _rows(x)
        if rs is not None:
            out = torch.empty_like(x, memory_format=_CONTIGUOUS)   # (faster than torch.empty(x.shape))
            lib.twinserve_rms_norm_f32(x.data_ptr(), rs[1], weight.data_ptr(), out.data_ptr(), rs[0],
                                       x.shape[-1], eps)
            return out
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) in one pass: the decoder layer's residual add and the
    norm after it."""
    lib = _usable(h, delta, weight)
    if (lib is not None and h.dim() == 2 and h.shape == delta.shape and h.is_contiguous() and delta.is_contiguous()
            and weight.dim() == 1 and weight.is_contiguous() and weight.shape[0] == h.shape[1]):
        h_out, normed = torch.empty_like(h), torch.empty_like(h)
        lib.twinserve_add_rms_norm_f32(h.data_ptr(), delta.data_ptr(), h_out.data_ptr(), weight.data_ptr(),
                                       normed.data_ptr(), h.shape[0], h.shape[1], eps)
        return h_out, normed
    h = h + delta
    return h, rms_norm_reference(h, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up = gate_up.chunk(2, -1) (the SwiGLU MLP's activation)."""
    lib = _usable(gate_up)
    if lib is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0:
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty((rows, width))
        lib.twinserve_silu_and_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)     # in place: one temporary fewer


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by position; "rotate half" layout (HF Llama), not interleaved pairs.
    With partial rotary (cos/sin narrower than D/2) only the first 2 * cos.shape[-1] dims
    turn; the rest pass through (HF Phi-3)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    # Written into one output through out= / in-place ops: no cat and no temporaries
    # (on the CPU half the time of the cat form for a 2048-token prefill).
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:2 * half]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    if 2 * half != x.shape[-1]:
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


def _heads_ok(x: torch.Tensor, t: int, d: int) -> bool:
    return x.dim() == 3 and x.shape[0] == t and x.shape[2] == d and x.stride(2) == 1 and x.stride(1) == d


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary to q [T, Hq, D] and k [T, Hkv, D] (contiguous heads, any token stride: views
    of the qkv projection) with RotaryEmbedding.forward's cos/sin [T, 1, D/2], in one call."""
    lib = _usable(q, k, cos, sin)
    if lib is not None:
        t, d = q.shape[0], q.shape[-1]
        half = cos.shape[-1]
        if (2 * half == d and _heads_ok(q, t, d) and _heads_ok(k, t, d) and cos.dim() == 3 and sin.dim() == 3
                and cos.shape[0] == t and sin.shape[0] == t and cos.shape[1] == 1 and sin.shape[1] == 1
                and cos.stride(2) == 1 and sin.stride(2) == 1 and cos.stride(0) == sin.stride(0)):
            hq, hk = q.shape[1], k.shape[1]
            q_out, k_out = q.new_empty((t, hq, d)), k.new_empty((t, hk, d))   # contiguous, as apply_rotary's
            lib.twinserve_rotary_qk_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(),
                                        sin.data_ptr(), cos.stride(0), q_out.data_ptr(), k_out.data_ptr(), t, hq,
                                        hk, d)
            return q_out, k_out
    return apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> int64 [N]: each row's argmax, as torch.argmax(dim=-1) gives it (the
    first of equal maxima; a row with NaN: its first NaN)."""
    lib = _usable(logits)
    if lib is None or logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        return logits.argmax(dim=-1)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        lib.twinserve_argmax_rows_f32(logits.data_ptr(), logits.stride(0), out.data_ptr(), rows, cols)
    return out
