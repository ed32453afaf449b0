"""Sliding-window attention and logit soft-capping in every attention backend.

A naive dense reference (HF semantics: query at position p sees keys p - W < j <= p;
scaled scores s -> c * tanh(s / c) before the mask) checks the torch backend, and each
other backend (the C++ CPU kernel, the Triton kernels under TRITON_INTERPRET=1) is
checked against both. One mixed step covers decodes shorter and longer than the window,
a whole prompt longer than the window, a chunk after a cached context (a chunked prefill
or a prefix hit: same metadata), and a padding row. The window and cap are chosen so
that they change every long sequence's output (asserted), so a backend that ignores
either fails.
"""
import os

ON_GPU = os.environ.get("TWINSERVE_TRITON_GPU_TESTS") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede any triton import

import pytest  # noqa: E402
import torch  # noqa: E402

from realexec.attention import get_attention_backend  # noqa: E402
from realexec.attention.metadata import AttentionMetadata, check_layer_options  # noqa: E402

from .reference import dense, paged_metadata  # noqa: E402
from realexec.attention.torch_backend import TorchAttentionBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (context_len, query_len) per sequence: decodes inside and past the window, a whole
# prompt longer than the window, chunks after a context longer than the window.
MIXED = [(0, 1), (3, 1), (9, 1), (30, 1), (0, 21), (17, 6), (12, 12)]
DECODES = [(0, 1), (4, 1), (6, 1), (13, 1), (40, 1), (25, 1)]


class Step:
    """One step's metadata over a shuffled paged cache whose contexts are random, plus
    the new tokens' q/k/v; `reference(window, cap)` is the dense result per sequence."""

    def __init__(self, cases, *, block_size=4, kv_heads=2, group=2, head_dim=16, seed=0, padding=True,
                 device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.cases, self.block_size, self.head_dim = cases, block_size, head_dim
        need = [-(-(c + n) // block_size) for c, n in cases]
        num_blocks = sum(need) + 3
        free = torch.randperm(num_blocks, generator=g).tolist()
        tables = [[free.pop() for _ in range(n)] for n in need]
        width = max(need)
        slots, qlens, lens = [], [], []
        for (ctx, n), table in zip(cases, tables):
            slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
            qlens.append(n)
            lens.append(ctx + n)
        if padding:
            decode_only = all(n == 1 for _, n in cases)
            qlens.append(1 if decode_only else 0)   # decode padding: one row, slot -1
            lens.append(0)
            slots += [-1] * qlens[-1]
        T = len(slots)
        # scores of a few units: softmax far from uniform, and a cap of 2 bites hard
        self.q = torch.randn(T, kv_heads * group, head_dim, generator=g) * 0.8
        self.k = torch.randn(T, kv_heads, head_dim, generator=g)
        self.v = torch.randn(T, kv_heads, head_dim, generator=g)
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        self.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        self.tables = tables
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        self.md = paged_metadata(tables + [[]] * padding, slots, qsl, lens, qlens, block_size, width)
        self.device = torch.device(device)
        self.scale = head_dim ** -0.5

    def run(self, backend, window, cap):
        """The backend's output on fresh copies of the caches (on self.device)."""
        dev = self.device
        md = self.md
        if dev.type != "cpu":
            md = AttentionMetadata(**{f: (getattr(md, f).to(dev) if isinstance(getattr(md, f), torch.Tensor)
                                          else getattr(md, f)) for f in md.__dataclass_fields__})
        out = backend.forward(self.q.to(dev), self.k.to(dev), self.v.to(dev), self.k_cache.clone().to(dev),
                              self.v_cache.clone().to(dev), md, self.scale, sliding_window=window,
                              logits_soft_cap=cap)
        return out.cpu()

    def rows(self):
        start = 0
        for _, n in self.cases:
            yield slice(start, start + n)
            start += n

    def reference(self, window, cap):
        out = []
        flat_k = self.k_cache.view(-1, *self.k_cache.shape[2:])
        flat_v = self.v_cache.view(-1, *self.v_cache.shape[2:])
        for (ctx, _), table, rows in zip(self.cases, self.tables, self.rows()):
            slots = torch.tensor([table[p // self.block_size] * self.block_size + p % self.block_size
                                  for p in range(ctx)], dtype=torch.long)
            keys = torch.cat([flat_k[slots], self.k[rows]])
            values = torch.cat([flat_v[slots], self.v[rows]])
            out.append(dense(self.q[rows], keys, values, ctx, self.scale, window, cap))
        return out


def check(step, got, window, cap, atol=2e-5):
    for (ctx, n), rows, ref in zip(step.cases, step.rows(), step.reference(window, cap)):
        where = f"sequence (context {ctx}, {n} new), window {window}, cap {cap}"
        torch.testing.assert_close(got[rows], ref, atol=atol, rtol=1e-4, msg=lambda m, w=where: f"{w}: {m}")
    assert torch.isfinite(got).all()


OPTIONS = [(5, None), (None, 2.0), (7, 2.0), (1, None)]


def test_reference_options_change_the_long_sequences():
    """The test data is sensitive to both options: a backend ignoring one cannot pass."""
    step = Step(MIXED)
    plain = step.reference(None, None)
    for window, cap in OPTIONS[:3]:
        for (ctx, n), a, b in zip(step.cases, plain, step.reference(window, cap)):
            if (cap is not None and ctx + n > 1) or (window is not None and ctx + n > window):
                assert (a - b).abs().max() > 1e-2, (ctx, n, window, cap)


@pytest.mark.parametrize("window,cap", OPTIONS + [(None, None), (64, None)])
@pytest.mark.parametrize("cases", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_torch_backend_matches_dense(cases, window, cap):
    step = Step(cases)
    check(step, step.run(TorchAttentionBackend(), window, cap), window, cap)
    # one padded decode call for all (no grouping by length) as well
    if cases is DECODES:
        check(step, step.run(TorchAttentionBackend(group_decodes=False), window, cap), window, cap)


def test_torch_backend_without_cache_windows_whole_prompts():
    """The cache-less profiling run (whole prompts) applies the options too."""
    step = Step([(0, 11), (0, 4)], padding=False)
    md = step.md
    for window, cap in OPTIONS:
        got = TorchAttentionBackend().forward(step.q, step.k, step.v, None, None, md, step.scale,
                                              sliding_window=window, logits_soft_cap=cap)
        check(step, got, window, cap)


@pytest.mark.parametrize("tile_rows", [1, 48])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,cap", OPTIONS)
def test_cpu_kernel_matches_dense_and_torch(window, cap, block_size, tile_rows):
    from realexec.attention.cpu_backend import CpuAttentionBackend

    for cases in (MIXED, DECODES):
        step = Step(cases, block_size=block_size, group=3)
        got = step.run(CpuAttentionBackend(tile_rows=tile_rows), window, cap)
        check(step, got, window, cap)
        real = sum(n for _, n in cases)     # the padding row's output is unspecified
        torch.testing.assert_close(got[:real], step.run(TorchAttentionBackend(), window, cap)[:real],
                                   atol=2e-5, rtol=1e-4)


def test_cpu_kernel_common_shapes_use_the_specialized_paths():
    """Block 16 x head 64 runs the compile-time-shaped code (4-row score tiles)."""
    from realexec.attention.cpu_backend import CpuAttentionBackend

    step = Step(MIXED + [(40, 9)], block_size=16, group=2, head_dim=64, seed=3)
    for window, cap in OPTIONS[:3]:
        got = step.run(CpuAttentionBackend(), window, cap)
        check(step, got, window, cap)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("window,cap", OPTIONS)
def test_triton_backend_matches_dense(window, cap, num_kv_splits):
    from realexec.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(num_kv_splits=num_kv_splits)
    device = "cuda" if ON_GPU else "cpu"
    for cases in (MIXED, DECODES):
        step = Step(cases, device=device)
        check(step, step.run(backend, window, cap), window, cap, atol=1e-4 if ON_GPU else 2e-5)


def test_triton_backend_without_cache_applies_the_options():
    from realexec.attention.triton_backend import TritonAttentionBackend

    step = Step([(0, 11), (0, 4)], padding=False)
    dev = torch.device("cuda" if ON_GPU else "cpu")
    md = step.md
    md = AttentionMetadata(**{f: (getattr(md, f).to(dev) if isinstance(getattr(md, f), torch.Tensor)
                                  else getattr(md, f)) for f in md.__dataclass_fields__})
    for window, cap in OPTIONS[2:3]:
        got = TritonAttentionBackend().forward(step.q.to(dev), step.k.to(dev), step.v.to(dev), None, None, md,
                                               step.scale, sliding_window=window, logits_soft_cap=cap)
        check(step, got.cpu(), window, cap, atol=1e-4 if ON_GPU else 2e-5)


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("window,cap", [(0, None), (-3, None), (2.5, None), (True, None), (None, 0.0),
                                        (None, -1.0), (None, float("inf"))])
def test_bad_options_are_refused(name, window, cap):
    step = Step([(0, 3)], padding=False)
    with pytest.raises(ValueError, match="sliding_window|logits_soft_cap"):
        step.run(get_attention_backend(name), window, cap)


def test_check_layer_options_accepts_the_off_and_on_values():
    check_layer_options(None, None)
    check_layer_options(4096, 50.0)
