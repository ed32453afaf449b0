"""The C++ kernel's prefill path (`attend`: whole prompts and prefill chunks) against a dense
fp64 reference and the torch backend.

The kernel takes keys a chunk of whole cache blocks (64 keys at block sizes 16/32) at a
time, with one online-softmax update per chunk and query rows in groups of 4 (vector
kernels for head sizes 64/128 and block sizes 16/32; runtime loops otherwise). The cases
aim at its edges: prompts longer than a chunk whose lengths are multiples of neither the
block nor the chunk (a partial last chunk), chunks after a cached context that is or is
not block-aligned (prefix hit / chunked prefill), GQA groups 1/3/4 (row groups straddling
tokens), tiles of 1..n tokens, sliding windows and soft caps, and scores large enough that
a later chunk raises a row's running max (the rescale). Every cache row outside the
sequences' contexts holds NaN, so a read past a context shows up as a non-finite output.
"""
import math

import pytest
import torch

from realexec.attention.cpu_backend import CpuAttentionBackend
from realexec.attention.torch_backend import TorchAttentionBackend

from .reference import dense, paged_metadata

TOL = dict(atol=2e-5, rtol=1e-5)


class Prefill:
    """One step of prefills/chunks `cases` = [(context_len, new_tokens)] over a shuffled
    paged cache: contexts hold random K/V, every other cache row NaN; q scaled by
    `q_scale` (large: peaked softmax, running maxima that change from chunk to chunk)."""

    def __init__(self, cases, *, block_size, kv_heads, group, head_dim, seed, q_scale=1.0):
        g = torch.Generator().manual_seed(seed)
        self.cases, self.bs = cases, block_size
        need = [math.ceil((c + n) / block_size) for c, n in cases]
        num_blocks = sum(need) + 3
        free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        flat_k = self.k_cache.view(-1, kv_heads, head_dim)
        flat_v = self.v_cache.view(-1, kv_heads, head_dim)
        self.tables, self.ctx_k, self.ctx_v, slots, starts, lens = [], [], [], [], [0], []
        for (ctx, n), nb in zip(cases, need):
            table = [free.pop() for _ in range(nb)]
            flat = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx + n)],
                                dtype=torch.long)
            flat_k[flat[:ctx]] = torch.randn(ctx, kv_heads, head_dim, generator=g)
            flat_v[flat[:ctx]] = torch.randn(ctx, kv_heads, head_dim, generator=g)
            self.ctx_k.append(flat_k[flat[:ctx]].clone())
            self.ctx_v.append(flat_v[flat[:ctx]].clone())
            self.tables.append(table)
            slots += flat[ctx:].tolist()
            starts.append(starts[-1] + n)
            lens.append(ctx + n)
        self.md = paged_metadata(self.tables, slots, starts, lens, [n for _, n in cases], block_size,
                                 max(need) + 1)
        T = starts[-1]
        self.q = torch.randn(T, kv_heads * group, head_dim, generator=g) * q_scale
        kv = torch.randn(T, 2 * kv_heads * head_dim + 5, generator=g)   # strided views, as the model's
        self.k = kv[:, :kv_heads * head_dim].view(T, kv_heads, head_dim)
        self.v = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(T, kv_heads, head_dim)
        self.scale = head_dim ** -0.5

    def run(self, backend, window=None, cap=None, nan_fill=None):
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        if nan_fill is not None:   # the torch reference reads whole blocks: finite junk instead of NaN
            kc, vc = kc.nan_to_num(nan_fill), vc.nan_to_num(nan_fill)
        return backend.forward(self.q, self.k, self.v, kc, vc, self.md, self.scale, sliding_window=window,
                               logits_soft_cap=cap)

    def check(self, out, window=None, cap=None):
        assert torch.isfinite(out).all(), "read a cache row outside the contexts (NaN)"
        start = 0
        for i, (ctx, n) in enumerate(self.cases):
            rows = slice(start, start + n)
            start += n
            ref = dense(self.q[rows], torch.cat([self.ctx_k[i], self.k[rows]]),
                        torch.cat([self.ctx_v[i], self.v[rows]]), ctx, self.scale, window, cap)
            torch.testing.assert_close(out[rows], ref, **TOL,
                                       msg=lambda m, c=ctx, n=n: f"sequence (context {c}, {n} new): {m}")


# Whole prompts longer than a 64-key chunk, lengths multiples of neither the block nor the
# chunk (and one exactly 2 chunks), short ones; chunks after block-aligned contexts (prefix
# hits: 64, 96) and unaligned ones (chunked prefill: 77, 300).
CASES = [(0, 200), (0, 67), (0, 5), (0, 128), (0, 1), (64, 64), (96, 33), (77, 50), (300, 70), (13, 2)]
SHAPES = [(16, 64), (16, 128), (32, 64), (8, 32), (16, 48)]   # (block, head_dim): vector and generic paths


@pytest.mark.parametrize("block_size,head_dim", SHAPES)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_prefills_and_chunks_match_dense(block_size, head_dim, group):
    step = Prefill(CASES, block_size=block_size, kv_heads=2, group=group, head_dim=head_dim,
                   seed=block_size + head_dim + group)
    out = step.run(CpuAttentionBackend())
    step.check(out)
    ref = step.run(TorchAttentionBackend(), nan_fill=0.25)
    torch.testing.assert_close(step.run(CpuAttentionBackend(), nan_fill=0.25), ref, **TOL)


@pytest.mark.parametrize("tile_rows", [1, 4, 10, 48, 400])
@pytest.mark.parametrize("group", [3, 4])
def test_any_tile_size(tile_rows, group):
    # tiles of 1 token up to whole prompts: row groups of 4 straddle tokens and tiles
    step = Prefill([(0, 150), (45, 40), (0, 9)], block_size=16, kv_heads=1, group=group, head_dim=64,
                   seed=tile_rows)
    step.check(step.run(CpuAttentionBackend(tile_rows=tile_rows)))


@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (8, 32)])
def test_peaked_scores_rescale_across_chunks(block_size, head_dim):
    """Large scores: a row's running max changes between chunks by many units, so an
    accumulator that is not rescaled (or rescaled by the wrong row's factor) is far off."""
    step = Prefill([(0, 190), (130, 60)], block_size=block_size, kv_heads=2, group=3, head_dim=head_dim,
                   seed=5, q_scale=6.0)
    step.check(step.run(CpuAttentionBackend()))


@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 64), (8, 32)])
@pytest.mark.parametrize("window,cap", [(37, None), (None, 1.5), (100, 2.0), (1, None), (64, None)])
def test_windows_and_soft_caps(block_size, head_dim, window, cap):
    step = Prefill([(0, 180), (150, 45), (20, 30), (0, 7)], block_size=block_size, kv_heads=2, group=3,
                   head_dim=head_dim, seed=window or 3, q_scale=2.0)
    out = step.run(CpuAttentionBackend(), window=window, cap=cap)
    step.check(out, window, cap)
    plain = step.run(CpuAttentionBackend())
    assert not torch.allclose(out[:180], plain[:180], atol=1e-3), "the options must change the long prompt"


@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 32)])
@pytest.mark.parametrize("window", [None, 20])
def test_huge_scores_a_row_must_not_see_do_not_matter(block_size, head_dim, window):
    """One key with scores of +-hundreds: rows after it (in its window) see a one-hot
    softmax; rows before it (or past its window) must be unaffected, so a running max taken
    over masked keys (exp underflowing to 0 for every visible key) shows up as inf/NaN."""
    step = Prefill([(0, 100), (40, 60)], block_size=block_size, kv_heads=2, group=3, head_dim=head_dim, seed=9)
    step.k[70] *= 1000.0                   # key 70 of the prompt, key 40 + 30 of the chunk
    step.check(step.run(CpuAttentionBackend(), window=window), window)
