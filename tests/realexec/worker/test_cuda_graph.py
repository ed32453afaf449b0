"""The decode graph runner's static-buffer/padding path (runs eagerly on CPU): real rows'
outputs are identical with and without padding, at every bucket boundary."""
from __future__ import annotations

import random

import pytest
import torch

from realexec.attention import AttentionMetadata
from realexec.worker.cuda_graph import DecodeGraphRunner, decode_buckets
from realexec.models.loader import load_model
from tests.tiny_models import save_tiny_llama

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path, vocab_size=128)
    model, config, _ = load_model(str(path), dtype=torch.float32, device="cpu")
    yield model, config
    torch.set_num_threads(before)


def test_buckets():
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(100)[:8] == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(100)[-1] == 100 and decode_buckets(5) == [1, 2, 4, 5]


def _caches(config, num_blocks):
    g = torch.Generator().manual_seed(1)
    shape = (num_blocks, BS, config.num_key_value_heads, config.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(config.num_hidden_layers)]


def _batch(n, num_blocks, rng):
    """n decode rows with random contexts and disjoint random block tables."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    ids, pos, slots, lens, tables = [], [], [], [], []
    for _ in range(n):
        ctx = rng.randint(0, 20)
        nblk = ctx // BS + 1
        table = [free.pop() for _ in range(nblk)]
        ids.append(rng.randrange(128))
        pos.append(ctx)
        slots.append(table[ctx // BS] * BS + ctx % BS)
        lens.append(ctx + 1)
        tables.append(table)
    w = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (w - len(t)) for t in tables], dtype=torch.int32)
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), torch.tensor(lens, dtype=torch.int32), bt, lens)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 17, 23, 24])
def test_padded_rows_do_not_change_real_rows(tiny, n):
    model, config = tiny
    rng = random.Random(n)
    num_blocks = 24 * 6 + 1
    caches = _caches(config, num_blocks)
    ids, pos, slots, lens_t, bt, lens = _batch(n, num_blocks, rng)
    md = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                           seq_lens=lens_t, block_tables=bt, block_size=BS, max_query_len=1, max_seq_len=max(lens),
                           query_lens_cpu=[1] * n, seq_lens_cpu=lens)
    with torch.inference_mode():
        want = model(ids, pos, caches, md).clone()
    snapshot = [(k.clone(), v.clone()) for k, v in caches]
    runner = DecodeGraphRunner(model, caches, block_size=BS, max_batch=24, max_blocks_per_seq=8, max_seq_len=64,
                               device=torch.device("cpu"), capture=True)
    assert runner.bucket_for(n) >= n and not runner.graphs      # no capture off CUDA
    got = runner.run(ids, pos, slots, lens_t, bt, lens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Padding rows wrote nothing: every slot but the real rows' own is bit-identical, and the
    # real rows' K/V match (recomputed in a bigger batch: same values up to rounding).
    real = torch.zeros(num_blocks * BS, dtype=torch.bool)
    real[slots] = True
    for (k0, v0), (k1, v1) in zip(snapshot, caches):
        for before, after in ((k0, k1), (v0, v1)):
            b, a = before.flatten(0, 1), after.flatten(0, 1)
            assert torch.equal(b[~real], a[~real])
            torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-5)


def test_batch_above_largest_bucket_is_refused(tiny):
    model, config = tiny
    runner = DecodeGraphRunner(model, _caches(config, 8), block_size=BS, max_batch=4, max_blocks_per_seq=2,
                               max_seq_len=8, device=torch.device("cpu"), capture=False)
    with pytest.raises(ValueError, match="exceeds the largest graph bucket 4"):
        runner.bucket_for(5)
