"""The fused CPU elementwise ops (realexec.models.cpu_ops) against their torch code, and the
Llama model with them against the forced torch path."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from realexec.models import cpu_ops
from realexec.models.llama import RotaryEmbedding
from tests.realexec.models.test_model import PagedKV, greedy_generate, random_prompts, run_step

TOL = dict(rtol=2e-6, atol=1e-6)
ROWS = [1, 3, 64, 300]
DIMS = [64, 576, 72, 100]

# The C++ ops against their torch code need the library, which needs a C++ compiler (the
# tests of the torch path below do not). CI has one: there a missing library fails instead.
needs_lib = pytest.mark.skipif(cpu_ops.library() is None and not os.environ.get("CI"),
                               reason="no C++ compiler to build the fused ops")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=[False, True], ids=["serial", "parallel"])
def parallel(request):
    """Parallel: every call with more than one row goes through the OpenMP loop."""
    lib = cpu_ops.library()
    lib.twinserve_cpu_ops_set_parallel_min(0 if request.param else 1 << 62)
    yield request.param
    lib.twinserve_cpu_ops_set_parallel_min(32768)


def torch_path(fn, *args):
    with cpu_ops.enabled(False):
        return fn(*args)


def fused(fn, *args):
    """fn on the C++ path (checked: the torch fallback would make these tests vacuous)."""
    calls = []
    lib = cpu_ops.library()
    original = {name: getattr(lib, name) for name in ("twinserve_rms_norm_f32", "twinserve_add_rms_norm_f32",
                                                      "twinserve_silu_and_mul_f32", "twinserve_rotary_qk_f32",
                                                      "twinserve_argmax_rows_f32")}
    for name, f in original.items():
        setattr(lib, name, lambda *a, f=f: calls.append(1) or f(*a))
    try:
        out = fn(*args)
    finally:
        for name, f in original.items():
            setattr(lib, name, f)
    assert calls, "the fused op did not run"
    return out


@needs_lib
@torch.no_grad()
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", DIMS)
def test_rms_norm(rows, dim, threads, parallel):
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    x, w = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    for eps in (1e-5, 1e-6, 0.5):
        torch.testing.assert_close(fused(cpu_ops.rms_norm, x, w, eps), torch_path(cpu_ops.rms_norm, x, w, eps), **TOL)
    # strided rows (a column slice) and 3-D inputs (heads of a qkv output, one token)
    wide = torch.randn(rows, dim + 40, generator=gen)
    torch.testing.assert_close(fused(cpu_ops.rms_norm, wide[:, 8:8 + dim], w, 1e-5),
                               torch_path(cpu_ops.rms_norm, wide[:, 8:8 + dim], w, 1e-5), **TOL)
    x3 = torch.randn(1, rows, dim, generator=gen)
    torch.testing.assert_close(fused(cpu_ops.rms_norm, x3, w, 1e-5), torch_path(cpu_ops.rms_norm, x3, w, 1e-5),
                               **TOL)


@needs_lib
@torch.no_grad()
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", DIMS)
def test_add_rms_norm(rows, dim, threads, parallel):
    gen = torch.Generator().manual_seed(rows * 1000 + dim + 1)
    h, d, w = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen), torch.randn(dim, generator=gen)
    for eps in (1e-5, 0.5):
        h1, n1 = fused(cpu_ops.add_rms_norm, h, d, w, eps)
        h2, n2 = torch_path(cpu_ops.add_rms_norm, h, d, w, eps)
        torch.testing.assert_close(h1, h2, rtol=0, atol=0)
        torch.testing.assert_close(n1, n2, **TOL)


@needs_lib
@torch.no_grad()
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", DIMS)
def test_silu_and_mul(rows, width, threads, parallel):
    gen = torch.Generator().manual_seed(rows * 1000 + width + 2)
    gu = torch.randn(rows, 2 * width, generator=gen) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])       # exp's clamps and zero
    torch.testing.assert_close(fused(cpu_ops.silu_and_mul, gu), torch_path(cpu_ops.silu_and_mul, gu), **TOL)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused(cpu_ops.silu_and_mul, gu), F.silu(gate) * up, **TOL)
    # rows of a wider output (strided gate/up halves)
    wide = torch.randn(rows, 2 * width + 24, generator=gen)
    torch.testing.assert_close(fused(cpu_ops.silu_and_mul, wide[:, 24:]), torch_path(cpu_ops.silu_and_mul, wide[:, 24:]),
                               **TOL)


@needs_lib
@pytest.mark.parametrize("rows", [0, 1, 3, 64])
@pytest.mark.parametrize("cols", [1, 15, 16, 49152, 49157])
def test_argmax_rows_is_torch_argmax(rows, cols, threads, parallel):
    """The greedy sampler's argmax: torch.argmax's index on random rows, on ties (the first of
    equal maxima, in the vector body and in the tail), on -inf/+inf and NaN rows (the first
    NaN), and on strided rows (a slice of wider logits)."""
    gen = torch.Generator().manual_seed(rows * 7 + cols)
    x = torch.randn(rows, cols + 8, generator=gen)[:, 3:3 + cols]
    if rows >= 3 and cols >= 15:
        x[0, :] = -float("inf")
        x[0, cols - 1] = 5.0                         # the maximum in the tail
        x[1, :] = 2.0
        x[1, cols // 2] = x[1, cols - 1] = 7.0       # ties: the first one wins
        x[2, 5] = float("nan")
        x[2, cols - 2] = float("nan")
        x[2, 0] = float("inf")
    want = torch.argmax(x, dim=-1)
    got = fused(cpu_ops.argmax_rows, x) if rows else cpu_ops.argmax_rows(x)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    with cpu_ops.enabled(False):
        assert cpu_ops.argmax_rows(x).tolist() == want.tolist()


@needs_lib
@torch.no_grad()
@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 2), 128), ((3, 3), 32), ((2, 1), 72)])
def test_rotary_qk(tokens, heads, head_dim, threads, parallel):
    hq, hk = heads
    gen = torch.Generator().manual_seed(tokens * 100 + head_dim)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(tokens, hq, head_dim), k.view(tokens, hk, head_dim)
    rot = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    cos, sin = rot(torch.randint(0, 4096, (tokens,), generator=gen), torch.float32)
    q1, k1 = fused(cpu_ops.apply_rotary_qk, q, k, cos, sin)
    q2, k2 = torch_path(cpu_ops.apply_rotary_qk, q, k, cos, sin)
    torch.testing.assert_close(q1, q2, **TOL)
    torch.testing.assert_close(k1, k2, **TOL)
    assert q1.is_contiguous() and k1.is_contiguous()


@torch.no_grad()
def test_partial_rotary_and_unsupported_inputs_take_the_torch_path():
    """Partial rotary (Phi-3), bf16, autograd: the torch code runs (same results)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    cos, sin = RotaryEmbedding(32, 64, 10000.0, None)(torch.arange(5), torch.float32)   # half 16 < 32
    got = cpu_ops.apply_rotary_qk(q, k, cos, sin)
    want = torch_path(cpu_ops.apply_rotary_qk, q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][..., 32:], q[..., 32:])

    x, w = torch.randn(4, 64, generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_reference(x, w, 1e-5))
    gu = torch.randn(4, 128, generator=gen).bfloat16()
    assert cpu_ops.silu_and_mul(gu).dtype == torch.bfloat16
    assert torch.equal(cpu_ops.silu_and_mul(gu), torch_path(cpu_ops.silu_and_mul, gu))


def test_autograd_takes_the_torch_path():
    x = torch.randn(3, 64, requires_grad=True)
    w = torch.randn(64)
    cpu_ops.rms_norm(x, w, 1e-5).sum().backward()
    assert x.grad is not None


@torch.no_grad()
def test_tensors_off_the_cpu_take_the_torch_path(monkeypatch):
    """Tensors on another device (meta here, as a GPU's would) never reach the C++ ops: every
    op answers through its torch code, on that device."""
    lib = cpu_ops.library()
    for name in ("twinserve_rms_norm_f32", "twinserve_add_rms_norm_f32", "twinserve_silu_and_mul_f32",
                 "twinserve_rotary_qk_f32"):
        monkeypatch.setattr(lib, name, lambda *a, name=name: pytest.fail(f"{name} ran on a non-CPU tensor"))
    meta = dict(device="meta")
    x, w = torch.empty(4, 64, **meta), torch.empty(64, **meta)
    assert cpu_ops.rms_norm(x, w, 1e-5).device.type == "meta"
    h, normed = cpu_ops.add_rms_norm(x, x, w, 1e-5)
    assert h.device.type == normed.device.type == "meta"
    assert cpu_ops.silu_and_mul(torch.empty(4, 128, **meta)).shape == (4, 64)
    cos = sin = torch.empty(4, 1, 32, **meta)
    q, k = cpu_ops.apply_rotary_qk(torch.empty(4, 3, 64, **meta), torch.empty(4, 1, 64, **meta), cos, sin)
    assert q.device.type == k.device.type == "meta" and q.shape == (4, 3, 64) and k.shape == (4, 1, 64)


@torch.no_grad()
def test_without_a_compiler_the_ops_fall_back_silently(monkeypatch, tmp_path, recwarn):
    import shutil

    monkeypatch.setattr(cpu_ops, "_lib", None)
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setenv("TWINSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    x, w = torch.randn(3, 64), torch.randn(64)
    assert cpu_ops.library() is None
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_reference(x, w, 1e-5), rtol=0, atol=0)
    gu = torch.randn(3, 128)
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gu), F.silu(gate) * up, rtol=0, atol=0)
    assert not [w for w in recwarn.list if "fused" in str(w.message)]


def test_the_env_var_turns_the_ops_off():
    import subprocess
    import sys

    code = ("import realexec.models.cpu_ops as c, sys; "
            "sys.exit(0 if not c._enabled and c._usable(__import__('torch').ones(1)) is None else 1)")
    env = dict(__import__("os").environ, TWINSERVE_CPU_FUSED_OPS="0")
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


# ----------------------------------------------------------------------------- the model

@pytest.fixture(scope="module", params=["torch", "cpu"])
def tiny_llama(request, tmp_path_factory):
    from realexec.models.loader import load_model
    from tests.tiny_models import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-fused")
    save_tiny_llama(path, vocab_size=256, initializer_range=0.15)
    return load_model(path, attn_backend=request.param, with_tokenizer=False)[0]


@needs_lib
@torch.no_grad()
def test_the_model_with_fused_ops_matches_the_torch_path(tiny_llama):
    lib = cpu_ops.library()
    calls = []
    rms = lib.twinserve_add_rms_norm_f32
    lib.twinserve_add_rms_norm_f32 = lambda *a: calls.append(1) or rms(*a)
    try:
        prompts = random_prompts(3, [5, 8, 13])
        batch = [(f"p{i}", p, 0) for i, p in enumerate(prompts)]
        got = run_step(tiny_llama, PagedKV(tiny_llama.config, num_blocks=32, block_size=4), batch)
    finally:
        lib.twinserve_add_rms_norm_f32 = rms
    assert calls, "the model did not run the fused ops"
    with cpu_ops.enabled(False):
        want = run_step(tiny_llama, PagedKV(tiny_llama.config, num_blocks=32, block_size=4), batch)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)

    prompts = random_prompts(2, [6, 11], seed=4)
    fused_tokens = greedy_generate(tiny_llama, PagedKV(tiny_llama.config, num_blocks=64, block_size=4, seed=7),
                                   prompts, 24)
    with cpu_ops.enabled(False):
        torch_tokens = greedy_generate(tiny_llama, PagedKV(tiny_llama.config, num_blocks=64, block_size=4, seed=7),
                                       prompts, 24)
    assert fused_tokens == torch_tokens
