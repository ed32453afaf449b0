"""Triton paged-attention kernels vs. a dense torch reference.

Runs the kernels under the Triton CPU interpreter (TRITON_INTERPRET=1, set below before
anything imports triton) on tiny shapes, fp32 and fp16 (bf16 is broken in the interpreter).
On a GPU box, `TWINSERVE_TRITON_GPU_TESTS=1 pytest tests/realexec/kernels/test_kernels.py` runs the same
cases compiled on CUDA, bf16 included.

Every case poisons what must not be read or written: caches start as NaN everywhere
(unused blocks, the tail of a sequence's last block, block 0 which padding entries of the
block tables point to), and outputs start as NaN so unwritten rows are caught.
"""
import os

ON_GPU = os.environ.get("TWINSERVE_TRITON_GPU_TESTS") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede any triton import

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from realexec.attention.metadata import AttentionMetadata  # noqa: E402
from realexec.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from realexec.kernels import (  # noqa: E402
    copy_blocks,
    decode_attention,
    default_num_kv_splits,
    prefill_attention,
    store_kvcache,
    swap_blocks,
)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Small tiles so the tiny test shapes still span several tiles and several splits.
BLOCK = dict(decode_n=16, prefill_m=16, prefill_n=16)

DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason="bf16 is broken in the Triton interpreter")),
]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


# ----------------------------------------------------------------------------- helpers
def cdiv(a, b):
    return -(-a // b)


class Case:
    """A batch of sequences with a paged cache holding each sequence's prefix (and, when
    `store_new`, its new tokens too), shuffled block tables and NaN poison elsewhere."""

    def __init__(self, seq_lens, query_lens, *, block_size, num_kv_heads, group, head_dim, dtype,
                 seed, store_new, pad_slots=(), poison=float("nan")):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens_list = list(seq_lens)
        self.query_lens = list(query_lens)
        self.block_size = block_size
        self.group = group
        hq, hkv, d = num_kv_heads * group, num_kv_heads, head_dim
        B = len(seq_lens)
        T = sum(query_lens)

        # Physical blocks: block 0 is never allocated (padding entries point at it), a few
        # spares stay unused; all of them NaN-poisoned.
        need = [cdiv(L, block_size) for L in seq_lens]
        num_blocks = 1 + sum(need) + 3
        ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        width = max(need + [1]) + 1
        self.block_tables = torch.zeros(B, width, dtype=torch.int32)
        for b, n in enumerate(need):
            self.block_tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]

        shape = (num_blocks, block_size, hkv, d)
        self.k_cache = torch.full(shape, poison, dtype=dtype)
        self.v_cache = torch.full(shape, poison, dtype=dtype)
        # Dense per-sequence K/V (the reference) and the flat new-token tensors, taken as
        # non-contiguous views of one fused qkv tensor like a real model produces.
        qkv = torch.randn(T, hq + 2 * hkv, d, generator=g).to(dtype)
        self.q, self.k_new, self.v_new = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        self.k_full, self.v_full = [], []
        slots = []
        row = 0
        for b, (L, ql) in enumerate(zip(seq_lens, query_lens)):
            ctx = L - ql if L > 0 else 0
            kp = torch.randn(ctx, hkv, d, generator=g).to(dtype)
            vp = torch.randn(ctx, hkv, d, generator=g).to(dtype)
            kn, vn = self.k_new[row:row + ql], self.v_new[row:row + ql]
            if L > 0:
                self.k_full.append(torch.cat([kp, kn]))
                self.v_full.append(torch.cat([vp, vn]))
            else:
                self.k_full.append(kp[:0])
                self.v_full.append(vp[:0])
            pos = torch.arange(L)
            blk = self.block_tables[b].long()[pos // block_size]
            slot = blk * block_size + pos % block_size
            upto = L if store_new else ctx
            self.k_cache.view(-1, hkv, d)[slot[:upto]] = self.k_full[b][:upto]
            self.v_cache.view(-1, hkv, d)[slot[:upto]] = self.v_full[b][:upto]
            slots += slot[ctx:].tolist() if L > 0 else [-1] * ql
            row += ql
        for i in pad_slots:
            slots[i] = -1
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(),
                                            dtype=torch.int32)
        self.to(DEVICE)

    def to(self, device):
        for name, val in list(vars(self).items()):
            if isinstance(val, torch.Tensor):
                setattr(self, name, val.to(device))
        self.k_full = [t.to(device) for t in self.k_full]
        self.v_full = [t.to(device) for t in self.v_full]

    def metadata(self):
        return AttentionMetadata(
            slot_mapping=self.slot_mapping, query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables, block_size=self.block_size,
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens_list),
            query_lens_cpu=list(self.query_lens), seq_lens_cpu=list(self.seq_lens_list))

    def reference(self, scale):
        """Dense causal attention in float64: query i of sequence b (context c) sees keys <= c + i.
        Rows of sequences with seq_len 0 are zeros."""
        out = torch.zeros(self.q.shape, dtype=torch.float64, device=self.q.device)
        row = 0
        for b, ql in enumerate(self.query_lens):
            L = self.seq_lens_list[b]
            if L > 0 and ql > 0:
                q = self.q[row:row + ql].double()
                k = self.k_full[b].double().repeat_interleave(self.group, dim=1)
                v = self.v_full[b].double().repeat_interleave(self.group, dim=1)
                s = torch.einsum("qhd,khd->hqk", q, k) * scale
                visible = torch.arange(L, device=q.device)[None, :] <= (L - ql + torch.arange(ql, device=q.device))[:, None]
                s = s.masked_fill(~visible, float("-inf"))
                out[row:row + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
            row += ql
        return out


def assert_close(actual, expected, dtype, rows=None):
    actual = actual.double() if rows is None else actual[rows].double()
    expected = expected if rows is None else expected[rows]
    assert not torch.isnan(actual).any(), "NaN in output (unwritten or poisoned rows read)"
    torch.testing.assert_close(actual, expected.double(), **TOL[dtype])


def poisoned_out(q):
    return torch.full_like(q, float("nan"))


# ----------------------------------------------------------------------------- store_kvcache
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_store_kvcache_writes_slots_and_skips_minus_one(dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    T, H, D, num_blocks = 7, 3, 24, 5           # head_dim 24: not a power of two (masked tail)
    kv = torch.randn(T, 2 * H + 1, D, generator=g).to(dtype)
    k, v = kv[:, :H], kv[:, H:2 * H]             # non-contiguous views
    k_cache = torch.randn(num_blocks, block_size, H, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, H, D, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T].clone()
    slots[[1, 4]] = -1
    k, v, k_cache, v_cache, slots = (t.to(DEVICE) for t in (k, v, k_cache, v_cache, slots))
    k0, v0 = k_cache.clone(), v_cache.clone()

    store_kvcache(k, v, k_cache, v_cache, slots)

    exp_k, exp_v = k0.view(-1, H, D).clone(), v0.view(-1, H, D).clone()
    keep = slots >= 0
    exp_k[slots[keep]] = k[keep]
    exp_v[slots[keep]] = v[keep]
    assert torch.equal(k_cache.view(-1, H, D), exp_k)   # written rows exact, all others untouched
    assert torch.equal(v_cache.view(-1, H, D), exp_v)


# ----------------------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_attention_matches_dense(dtype, block_size, group, num_kv_splits):
    bs = block_size
    # lengths: 1, exactly one block, block + 1, a padded row (seq_len 0, query row present,
    # slot -1), and a longer one spanning several tiles and splits.
    seq_lens = [1, bs, bs + 1, 0, 3 * bs + 5]
    case = Case(seq_lens, [1] * len(seq_lens), block_size=bs, num_kv_heads=2, group=group,
                head_dim=16, dtype=dtype, seed=bs * 10 + group + num_kv_splits, store_new=True)
    scale = 16 ** -0.5
    out = decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                           case.query_start_loc, scale, num_kv_splits=num_kv_splits,
                           out=poisoned_out(case.q), block_n=BLOCK["decode_n"])
    assert_close(out, case.reference(scale), dtype)
    assert torch.count_nonzero(out[3]) == 0  # padded row: zeros


@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
def test_decode_split_kv_merge_long_context(num_kv_splits):
    # 150 tokens over 16-token tiles: splits of uneven occupancy, and with 8 splits some are
    # empty; 3 splits exercises the non-power-of-two padding of the merge kernel.
    case = Case([150, 7], [1, 1], block_size=16, num_kv_heads=1, group=3, head_dim=32,
                dtype=torch.float32, seed=num_kv_splits, store_new=True)
    scale = 0.2
    ref = case.reference(scale)
    out = decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                           case.query_start_loc, scale, num_kv_splits=num_kv_splits,
                           out=poisoned_out(case.q), block_n=16)
    assert_close(out, ref, torch.float32)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU (run with TWINSERVE_TRITON_GPU_TESTS=1)")
def test_decode_cuda_graph_replay_follows_new_lengths():
    # Capture once, then change seq_lens in place: the replay must follow the new data
    # (the grid depends on shapes only; capture would also fail on any host sync).
    case = Case([5, 40, 17, 0], [1, 1, 1, 1], block_size=16, num_kv_heads=3, group=3, head_dim=64,
                dtype=torch.float16, seed=1, store_new=True)
    scale = 0.125
    out = poisoned_out(case.q)

    def step():
        decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                         case.query_start_loc, scale, num_kv_splits=4, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, case.reference(scale), torch.float16)

    new_lens = [3, 40, 1, 0]
    case.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    case.k_full = [k[:n] for k, n in zip(case.k_full, new_lens)]
    case.v_full = [v[:n] for v, n in zip(case.v_full, new_lens)]
    case.seq_lens_list = new_lens
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, case.reference(scale), torch.float16)


def test_default_num_kv_splits_depends_only_on_shapes():
    assert default_num_kv_splits(1, 3, 132) == 16
    assert default_num_kv_splits(64, 3, 132) == 2
    assert default_num_kv_splits(512, 8, 132) == 1
    for b in (1, 2, 3, 8, 64, 256):
        s = default_num_kv_splits(b, 3, 132)
        assert s & (s - 1) == 0 and 1 <= s <= 16


# ----------------------------------------------------------------------------- prefill / extend
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_attention_with_cached_prefix(dtype, block_size, group):
    bs = block_size
    # (seq_len, query_len): fresh prompt of block+1 tokens; prefix-cache hit (2 cached blocks
    # + 5 new); a decode token after one block; a 1-token prompt; exactly one block fresh;
    # a padded row with no query rows.
    pairs = [(bs + 1, bs + 1), (2 * bs + 5, 5), (bs + 1, 1), (1, 1), (bs, bs), (0, 0)]
    case = Case([p[0] for p in pairs], [p[1] for p in pairs], block_size=bs, num_kv_heads=2,
                group=group, head_dim=16, dtype=dtype, seed=7 * bs + group, store_new=False)
    store_kvcache(case.k_new, case.v_new, case.k_cache, case.v_cache, case.slot_mapping)
    scale = 0.25
    out = prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                            case.query_start_loc, max(case.query_lens), scale,
                            out=poisoned_out(case.q), block_m=BLOCK["prefill_m"],
                            block_n=BLOCK["prefill_n"])
    assert_close(out, case.reference(scale), dtype)


def _chunk_metadata(block_table_row, block_size, done, n_new, device):
    pos = torch.arange(done, done + n_new)
    slots = block_table_row.cpu().long()[pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(
        slot_mapping=slots.to(device), query_start_loc=torch.tensor([0, n_new], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([done + n_new], dtype=torch.int32, device=device),
        block_tables=block_table_row[None], block_size=block_size, max_query_len=n_new,
        max_seq_len=done + n_new, query_lens_cpu=[n_new], seq_lens_cpu=[done + n_new])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_through_backend_equals_full_causal(dtype):
    # A 37-token prompt computed in chunks of 16, 13 and 8 tokens (chunks start mid-block),
    # all through TritonAttentionBackend.forward with per-chunk metadata.
    bs, L = 8, 37
    case = Case([L], [L], block_size=bs, num_kv_heads=1, group=3, head_dim=16, dtype=dtype,
                seed=3, store_new=False)
    backend = TritonAttentionBackend(num_kv_splits=2)
    scale = 0.25
    pieces, done = [], 0
    for n in (16, 13, 8):
        md = _chunk_metadata(case.block_tables[0], bs, done, n, DEVICE)
        rows = slice(done, done + n)
        pieces.append(backend.forward(case.q[rows], case.k_new[rows], case.v_new[rows],
                                      case.k_cache, case.v_cache, md, scale))
        done += n
    assert_close(torch.cat(pieces), case.reference(scale), dtype)


# ----------------------------------------------------------------------------- backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_decode_with_graph_style_padding(dtype):
    # Decode batch padded CUDA-graph style: a row with seq_len 0 and query length 1 whose
    # slot is -1 (its K/V must not be written) and a trailing row with query length 0.
    case = Case([9, 17, 0, 0], [1, 1, 1, 0], block_size=8, num_kv_heads=2, group=3, head_dim=16,
                dtype=dtype, seed=11, store_new=False)
    md = case.metadata()
    assert md.is_decode_only
    k0 = case.k_cache.clone()
    out = TritonAttentionBackend(num_kv_splits=2).forward(
        case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, md, 0.25)
    assert_close(out, case.reference(0.25), dtype)
    assert torch.count_nonzero(out[2]) == 0
    changed = ~(torch.eq(case.k_cache, k0) | (torch.isnan(case.k_cache) & torch.isnan(k0)))
    assert changed.any(dim=(2, 3)).sum() == 2  # exactly the two real tokens' slots written


def test_backend_without_cache_profile_run():
    # Profiling run before the cache exists: whole prompts, k_cache None.
    case = Case([5, 17, 1, 0], [5, 17, 1, 0], block_size=8, num_kv_heads=2, group=3, head_dim=16,
                dtype=torch.float32, seed=2, store_new=False)
    out = TritonAttentionBackend().forward(case.q, case.k_new, case.v_new, None, None,
                                           case.metadata(), 0.3)
    assert_close(out, case.reference(0.3), torch.float32)


@pytest.mark.parametrize("decode_only", [True, False])
def test_triton_backend_matches_torch_backend(decode_only):
    from realexec.attention.torch_backend import TorchAttentionBackend

    ref_backend = TorchAttentionBackend()         # a changed constructor is a failure, not a skip
    if decode_only:
        seq_lens, qlens = [1, 8, 9, 30], [1, 1, 1, 1]
    else:
        seq_lens, qlens = [9, 21, 9, 1], [9, 5, 1, 1]
    # Finite poison here: the torch backend multiplies masked-out cache rows by zero weights,
    # so NaN in a sequence's last-block tail would leak into its output there.
    args = dict(block_size=8, num_kv_heads=2, group=3, head_dim=16, dtype=torch.float32, seed=5,
                store_new=False, poison=7.0)
    a, b = Case(seq_lens, qlens, **args), Case(seq_lens, qlens, **args)
    out_t = TritonAttentionBackend(num_kv_splits=2).forward(a.q, a.k_new, a.v_new, a.k_cache, a.v_cache,
                                                            a.metadata(), 0.25)
    out_r = ref_backend.forward(b.q, b.k_new, b.v_new, b.k_cache, b.v_cache, b.metadata(), 0.25)
    assert_close(out_t, out_r.double(), torch.float32)
    torch.testing.assert_close(a.k_cache, b.k_cache, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(a.v_cache, b.v_cache, equal_nan=True, atol=0, rtol=0)


# ----------------------------------------------------------------------------- block ops
@pytest.mark.parametrize("layout", ["pairs", "flat", "stacked"])
def test_copy_blocks_all_layers(layout):
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 2, 6, 4, 2, 8, generator=g).to(DEVICE)   # [L, 2, blocks, bs, H, D]
    before = stacked.clone()
    # block 1 is both a destination and (for the pair after it) a source: reads happen first.
    pairs = torch.tensor([[0, 1], [1, 4], [2, 5]])
    if layout == "pairs":
        caches = [(stacked[l, 0], stacked[l, 1]) for l in range(3)]
    elif layout == "flat":
        caches = [stacked[l, i] for l in range(3) for i in range(2)]
    else:
        caches = stacked
    copy_blocks(caches, pairs)
    expected = before.clone()
    expected[:, :, [1, 4, 5]] = before[:, :, [0, 1, 2]]
    assert torch.equal(stacked, expected)


def test_swap_blocks_roundtrip():
    g = torch.Generator().manual_seed(1)
    gpu = torch.randn(6, 4, 2, 8, generator=g).to(DEVICE)
    pin = DEVICE.type == "cuda"
    cpu = torch.zeros(5, 4, 2, 8, pin_memory=pin)
    swap_blocks(gpu, cpu, torch.tensor([[3, 0], [5, 4]]))            # swap out
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(cpu[0], gpu[3].cpu()) and torch.equal(cpu[4], gpu[5].cpu())
    assert torch.count_nonzero(cpu[1:4]) == 0
    gpu2 = torch.zeros_like(gpu)
    swap_blocks(cpu, gpu2, [[0, 2], [4, 1]])                          # swap in
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(gpu2[2], gpu[3]) and torch.equal(gpu2[1], gpu[5])


# ----------------------------------------------------------------------------- bench + packaging
@pytest.mark.skipif(ON_GPU, reason="CPU-only smoke test of the benchmark script")
def test_bench_script_runs_on_cpu(capsys):
    from realexec.bench import kernels as bench

    if not torch.cuda.is_available():
        assert bench.main([]) == 0
        assert "CUDA is not available" in capsys.readouterr().out
    rows = bench.run(torch.device("cpu"), torch.float32, [2], [17], bench.wall_time_us, reps=1)
    assert len(rows) == 1 and rows[0]["us"] > 0 and rows[0]["gbs"] > 0

def test_importing_kernels_package_does_not_import_triton():
    code = ("import sys, realexec.kernels, realexec.attention.metadata; "
            "assert 'triton' not in sys.modules, 'triton imported eagerly'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([repo_root] + sys.path)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
