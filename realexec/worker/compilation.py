"""torch.compile for the decode path, attention left eager: `--compile-decode`.

A CUDA graph removes the host's launch cost but not the kernels' own: a SmolLM2 decode
step replayed from a graph still runs ~37 small kernels per layer (RMSNorm alone is
six elementwise kernels, rotary embedding a dozen), ~2.4 ms at batch 1 on an H200 where
the weights take 0.1 ms to read. Inductor fuses those elementwise chains into a few
kernels around the matmuls. The attention backend is a graph break: its Triton kernels
and its metadata handling run as they are (eagerly, then captured into the decode graphs
with everything else), so the compiled pieces are the same for every attention backend
and the decode graphs capture one pass over compiled pieces and eager attention.

Only the decode graph runner uses the compiled forward (its shapes are one padded batch
bucket each, compiled once during the capture's warm-up); prefill and mixed steps run the
eager model, so a first request never waits on a compile.
"""
from __future__ import annotations

import functools

import torch


# decode_buckets(256) has 23 sizes; leave room for a larger --max-num-seqs.
MAX_COMPILED_BUCKETS = 64


def _eager_attention(forward):
    """The backend's forward, never traced: dynamo breaks the graph around it."""

    @torch.compiler.disable
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return forward(*args, **kwargs)

    run._twinserve_eager = True
    return run


def leave_attention_eager(model: torch.nn.Module) -> int:
    """Mark every attention backend of `model` as a graph break (idempotent). Returns how
    many backends were marked (one per distinct backend object)."""
    marked = 0
    seen: set[int] = set()
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if backend is None or id(backend) in seen or not hasattr(backend, "forward"):
            continue
        seen.add(id(backend))
        if not getattr(backend.forward, "_twinserve_eager", False):
            backend.forward = _eager_attention(backend.forward)
            marked += 1
    return marked


def compile_decode_forward(model: torch.nn.Module, backend: str = "inductor", mode: str | None = None):
    """A compiled callable with the model's forward signature (the module itself is left as
    it is: prefill keeps running it eagerly). `backend`/`mode` are torch.compile's; tests use
    backend="aot_eager" to check the graph breaks and outputs without code generation."""
    if not leave_attention_eager(model) and not any(hasattr(m, "backend") for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no attention backend to leave eager: "
                         "compiling it whole would trace the paged-attention kernels")
    # dynamic=False: each decode bucket is its own static shape, compiled once during the
    # capture's warm-up; static shapes fuse best. Every bucket is a recompile of the same
    # code objects (the layers share theirs), so dynamo's limit of 8 per code object must
    # cover the bucket count, or the larger buckets would silently fall back to eager.
    import torch._dynamo.config as dynamo_config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, MAX_COMPILED_BUCKETS)
    return torch.compile(model, backend=backend, mode=mode, dynamic=False, fullgraph=False)


def capture_with_fallback(capture, model: torch.nn.Module, compile_decode: bool, where: str = "worker"):
    """`capture(forward)` builds and captures the decode graphs of `forward`. With
    compile_decode, the compiled forward first; if compiling or capturing it fails (a
    torch/Triton build inductor cannot handle), a warning says why and the uncompiled model
    is captured instead: a server still starts, as fast as it was before compiling existed."""
    if compile_decode:
        try:
            return capture(compile_decode_forward(model))
        except Exception as e:
            import warnings
            warnings.warn(f"{where}: compiling the decode forward failed ({type(e).__name__}: {e}); capturing "
                          "uncompiled decode graphs instead (--no-compile-decode skips the attempt)",
                          RuntimeWarning, stacklevel=2)
    return capture(model)
