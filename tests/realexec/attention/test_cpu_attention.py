"""The batched C++ CPU attention backend against the torch reference (its oracle).

Each case is one step's batch over a paged cache with shuffled block tables: decodes,
whole prefills, prefill chunks after a cached context (chunked prefill, prefix-cache
hits), GQA groups, sequences sharing prefix blocks (n > 1 / forks), padding rows. The
kernel must (1) write the new K/V at exactly the reference's slots, (2) give the
reference's output within fp32 tolerance, and (3) never read what it must not: with every
cache row outside the sequences' contexts set to NaN, its output stays finite and equal
to a dense attention over the known K/V.
"""
import math
import random

import pytest
import torch

from realexec.attention import get_attention_backend
from realexec.attention.cpu_backend import CpuAttentionBackend
from realexec.attention.metadata import AttentionMetadata
from realexec.attention.torch_backend import TorchAttentionBackend

from .reference import dense, paged_metadata

TOL = dict(atol=2e-5, rtol=1e-5)


class Step:
    """One step: `specs` = [(context_len, query_len, shares_blocks_of or None)]; a spec
    (0, 0, None) or (0, 1, "pad") is a padding row. Cache rows of the contexts hold
    random K/V; everything else holds `poison`."""

    def __init__(self, specs, *, block_size, kv_heads, group, head_dim, seed, poison=float("nan"),
                 extra_width=1):
        g = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.specs, self.bs = specs, block_size
        hq = kv_heads * group
        need = [math.ceil((c + n) / block_size) for c, n, _ in specs]
        num_blocks = 1 + sum(need) + 4
        free = list(range(1, num_blocks))
        rnd.shuffle(free)
        self.k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), poison)
        self.v_cache = torch.full_like(self.k_cache, poison)
        tables, self.ctx_k, self.ctx_v = [], [], []
        slots, starts, lens = [], [0], []
        for i, (ctx, n, share) in enumerate(specs):
            shared = 0
            if isinstance(share, int):     # a fork: the full blocks of the parent's cached context
                shared = min(ctx, specs[share][0]) // block_size
                table = tables[share][:shared] + [free.pop() for _ in range(need[i] - shared)]
            else:
                table = [free.pop() for _ in range(need[i])]
            tables.append(table)
            flat = [table[p // block_size] * block_size + p % block_size for p in range(ctx + n)]
            view_k, view_v = self.k_cache.view(-1, kv_heads, head_dim), self.v_cache.view(-1, kv_heads, head_dim)
            for p in range(ctx):
                if p < shared * block_size:
                    continue                    # already written by the parent
                view_k[flat[p]] = torch.randn(kv_heads, head_dim, generator=g)
                view_v[flat[p]] = torch.randn(kv_heads, head_dim, generator=g)
            self.ctx_k.append(view_k[flat[:ctx]].clone())
            self.ctx_v.append(view_v[flat[:ctx]].clone())
            if share == "pad":
                slots.append(-1)
                lens.append(0)
            else:
                slots.extend(flat[ctx:])
                lens.append(ctx + n)
            starts.append(starts[-1] + n)
        width = max([len(t) for t in tables] + [1]) + extra_width
        self.md = paged_metadata(tables, slots, starts, lens, [n for _, n, _ in specs], block_size, width)
        T = starts[-1]
        self.q = torch.randn(T, hq, head_dim, generator=g)
        # k, v as the model makes them: views into one fused projection output (strided rows).
        kv = torch.randn(T, 2 * kv_heads * head_dim + 7, generator=g)
        self.k = kv[:, :kv_heads * head_dim].view(T, kv_heads, head_dim)
        self.v = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(T, kv_heads, head_dim)
        self.scale = head_dim ** -0.5

    def run(self, backend, fill=None, **options):
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        if fill is not None:     # replace the poison by finite junk (for the reference's padded reads)
            kc = torch.nan_to_num(kc, nan=fill)
            vc = torch.nan_to_num(vc, nan=fill)
        out = backend.forward(self.q, self.k, self.v, kc, vc, self.md, self.scale, **options)
        return out, kc, vc

    def check_dense(self, out):
        start = 0
        for i, (ctx, n, share) in enumerate(self.specs):
            rows = slice(start, start + n)
            start += n
            if share == "pad" or n == 0:
                continue
            ref = dense(self.q[rows], torch.cat([self.ctx_k[i], self.k[rows]]),
                        torch.cat([self.ctx_v[i], self.v[rows]]), ctx, self.scale)
            torch.testing.assert_close(out[rows], ref, **TOL)


B = 16
MIXED = [(0, 1, None), (0, 37, None), (B, 1, None), (2 * B + 3, 1, None), (5, B + 2, None),
         (3 * B, B, None), (0, B, None), (B - 1, 1, None), (4 * B + 7, 23, None), (0, 1, "pad")]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("tile_rows", [1, 48])
def test_mixed_step_matches_reference_and_dense(block_size, group, tile_rows):
    step = Step(MIXED, block_size=block_size, kv_heads=2, group=group, head_dim=32,
                seed=block_size * 100 + group * 10 + tile_rows)
    backend = CpuAttentionBackend(tile_rows=tile_rows)
    out, kc, vc = step.run(backend)                                  # NaN outside the contexts
    assert torch.isfinite(out[:-1]).all(), "read a cache row it must not read"
    step.check_dense(out)
    ref, rkc, rvc = step.run(TorchAttentionBackend(), fill=0.5)
    out2, kc2, vc2 = step.run(backend, fill=0.5)
    torch.testing.assert_close(out2[:-1], ref[:-1], **TOL)           # last row: padding (garbage)
    assert torch.equal(kc2, rkc) and torch.equal(vc2, rvc), "K/V written elsewhere than the reference"


def test_writes_exactly_the_slots():
    step = Step(MIXED, block_size=B, kv_heads=2, group=3, head_dim=16, seed=7)
    _, kc, vc = step.run(CpuAttentionBackend())
    md = step.md
    written = md.slot_mapping >= 0
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    assert torch.equal(flat_k[md.slot_mapping[written]], step.k[written])
    assert torch.equal(flat_v[md.slot_mapping[written]], step.v[written])
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[md.slot_mapping[written]] = False
    before = step.k_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[others].isnan(), before[others].isnan())
    assert torch.equal(torch.nan_to_num(flat_k[others]), torch.nan_to_num(before[others]))


@pytest.mark.parametrize("group", [1, 3])
def test_decode_only_long_and_short_contexts(group):
    rnd = random.Random(group)
    specs = [(rnd.choice([0, 1, 15, 16, 17, 100, 333, 700]), 1, None) for _ in range(24)]
    step = Step(specs, block_size=16, kv_heads=3, group=group, head_dim=64, seed=group)
    out, _, _ = step.run(CpuAttentionBackend())
    step.check_dense(out)
    ref, _, _ = step.run(TorchAttentionBackend(), fill=0.0)
    torch.testing.assert_close(out, ref, **TOL)


def test_forks_share_prefix_blocks():
    # n > 1: three sequences read the same prefix blocks; each decodes or prefills its own tail.
    specs = [(40, 9, None), (48, 1, 0), (33, 1, 0), (44, 4, 0)]
    step = Step(specs, block_size=8, kv_heads=2, group=3, head_dim=32, seed=3)
    assert step.md.block_tables[1, 0] == step.md.block_tables[0, 0]
    out, _, _ = step.run(CpuAttentionBackend())
    step.check_dense(out)
    ref, _, _ = step.run(TorchAttentionBackend(), fill=0.0)
    torch.testing.assert_close(out, ref, **TOL)


def test_chunked_prefill_equals_whole_prompt():
    """A prompt prefilled in three chunks (each a separate step reading the earlier chunks
    back from the cache) gives the rows a whole-prompt prefill gives."""
    g = torch.Generator().manual_seed(11)
    L, kvh, grp, d, bs = 70, 2, 3, 32, 16
    q, k, v = torch.randn(L, kvh * grp, d, generator=g), torch.randn(L, kvh, d, generator=g), torch.randn(
        L, kvh, d, generator=g)
    table = torch.tensor([[5, 2, 7, 1, 3]], dtype=torch.int32)
    backend = CpuAttentionBackend()

    def step(kc, vc, a, b):
        slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(a, b)])
        md = AttentionMetadata(slots, torch.tensor([0, b - a], dtype=torch.int32),
                               torch.tensor([b], dtype=torch.int32), table, bs, b - a, b, [b - a], [b])
        return backend.forward(q[a:b], k[a:b], v[a:b], kc, vc, md, d ** -0.5)

    caches = [torch.zeros(8, bs, kvh, d) for _ in range(4)]
    whole = step(caches[0], caches[1], 0, L)
    parts = torch.cat([step(caches[2], caches[3], a, b) for a, b in [(0, 20), (20, 53), (53, 70)]])
    torch.testing.assert_close(parts, whole, **TOL)
    torch.testing.assert_close(whole, dense(q, k, v, 0, d ** -0.5), **TOL)


def test_bad_metadata_is_refused_not_read():
    step = Step([(20, 1, None), (0, 5, None)], block_size=8, kv_heads=1, group=2, head_dim=8, seed=1)
    step.md.block_tables[0, 1] = 10_000           # a block id past the cache
    with pytest.raises(ValueError, match="block table entry"):
        step.run(CpuAttentionBackend())
    step = Step([(20, 1, None)], block_size=8, kv_heads=1, group=2, head_dim=8, seed=1)
    step.md.slot_mapping[0] = 10_000
    with pytest.raises(ValueError, match="slot_mapping"):
        step.run(CpuAttentionBackend())


def test_non_fp32_and_cacheless_runs_use_the_reference():
    step = Step([(0, 6, None), (9, 1, None)], block_size=8, kv_heads=1, group=2, head_dim=8, seed=2)
    backend = get_attention_backend("cpu")
    assert isinstance(backend, CpuAttentionBackend)
    md = AttentionMetadata(torch.tensor([-1] * 6), torch.tensor([0, 6], dtype=torch.int32),
                           torch.tensor([6], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 8, 6, 6,
                           [6], [6])
    q, k, v = step.q[:6], step.k[:6], step.v[:6]
    torch.testing.assert_close(backend.forward(q, k, v, None, None, md, 0.3),
                               dense(q, k, v, 0, 0.3), **TOL)
    out = backend.forward(step.q.double(), step.k.double(), step.v.double(), step.k_cache.double().nan_to_num(),
                          step.v_cache.double().nan_to_num(), step.md, step.scale)
    assert out.dtype == torch.float64


def test_without_a_compiler_the_default_falls_back_with_a_warning(monkeypatch):
    from realexec import cpu_build
    from realexec.attention import cpu_backend

    monkeypatch.setattr(cpu_backend, "_lib", None)
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    with pytest.raises(cpu_backend.KernelBuildError, match="no C.. compiler"):
        CpuAttentionBackend()
    with pytest.warns(RuntimeWarning, match="falling back to the slower torch attention backend"):
        backend = cpu_backend.default_cpu_backend()
    assert isinstance(backend, TorchAttentionBackend)


def test_a_failed_build_reports_the_compiler_error(monkeypatch, tmp_path):
    from realexec.attention import cpu_backend

    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_backend, "_lib", None)
    monkeypatch.setattr(cpu_backend, "SOURCE", broken)
    monkeypatch.setenv("TWINSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cpu_backend.KernelBuildError, match="building the CPU attention kernel failed"):
        cpu_backend.load_library()
    assert not list((tmp_path / "cache" / "kernels").glob("*.so")), "a failed build left a library behind"


# ----------------------------------------------------------------------------- the decode path
# Decodes (one query token) of the common shapes run a vectorized kernel (block size and
# head size multiples of the vector width) and, with fewer work items than about twice the
# threads, are split over the threads by runs of key blocks and combined (flash-decoding).

DECODE_LENS = [1, 2, 15, 16, 17, 31, 33, 100, 257, 700, 1029]   # keys incl. the new token


def decode_step(lens, *, block_size, group, head_dim, seed, kv_heads=2):
    return Step([(n - 1, 1, None) for n in lens], block_size=block_size, kv_heads=kv_heads, group=group,
                head_dim=head_dim, seed=seed)


def check_against_reference(step, backend, tol=TOL, **options):
    """NaN outside the contexts stays out of the output; the output equals the torch reference."""
    out, _, _ = step.run(backend, **options)
    assert torch.isfinite(out).all(), "read a cache row it must not read"
    ref, _, _ = step.run(TorchAttentionBackend(), fill=0.0, **options)
    torch.testing.assert_close(out, ref, **tol)
    return out


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 32), (128, 32), (32, 16), (64, 8)])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_many_decodes_of_mixed_lengths(head_dim, block_size, group):
    """40 decodes, lengths on both sides of block boundaries, GQA 1/3/4 (the last shape,
    block 8, takes the generic path)."""
    rnd = random.Random(head_dim + block_size + group)
    step = decode_step(rnd.choices(DECODE_LENS, k=40), block_size=block_size, group=group, head_dim=head_dim,
                       seed=group)
    out = check_against_reference(step, CpuAttentionBackend())
    step.check_dense(out)


WINDOW_CAP = dict(atol=2e-5, rtol=1e-4)   # test_window_softcap's tolerance (tanh by exp)


@pytest.mark.parametrize("window,cap", [(5, None), (16, None), (17, None), (None, 2.0), (100, 30.0), (1, None)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_decode_windows_and_soft_caps(window, cap, head_dim, block_size):
    lens = [1, 4, 5, 6, 16, 17, 18, 33, 99, 100, 101, 130, 700]
    step = decode_step(lens, block_size=block_size, group=3, head_dim=head_dim, seed=5)
    got = check_against_reference(step, CpuAttentionBackend(), tol=WINDOW_CAP, sliding_window=window,
                                  logits_soft_cap=cap)
    plain, _, _ = step.run(TorchAttentionBackend(), fill=0.0)
    assert (got[-1] - plain[-1]).abs().max() > 1e-3, "the options must change the long sequence"


@pytest.fixture
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("window,cap", [(None, None), (300, None), (None, 5.0)])
@pytest.mark.parametrize("lens", [[1500], [1029, 700, 65], [2, 900]], ids=["one", "three", "two"])
def test_few_long_decodes_split_over_threads(threads, window, cap, lens):
    """With 2 threads and fewer decodes than 4, long ones are split into runs of key blocks
    and combined; 1 thread computes them whole. Both equal the reference."""
    step = decode_step(lens, block_size=16, group=3, head_dim=64, seed=len(lens), kv_heads=3)
    check_against_reference(step, CpuAttentionBackend(), tol=WINDOW_CAP, sliding_window=window,
                            logits_soft_cap=cap)


def test_split_decodes_next_to_a_prefill():
    """A step with one long decode and one short prefill (2 work items < 2 x 2 threads)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        step = Step([(900, 1, None), (0, 5, None)], block_size=16, kv_heads=3, group=3, head_dim=64, seed=9)
        out = check_against_reference(step, CpuAttentionBackend())
        step.check_dense(out)
    finally:
        torch.set_num_threads(saved)
