"""The piecewise (mixed prefill+decode) graph runner's padded, segmented path, run eagerly on
CPU: equal to the model's forward over random mixed batches at and around every bucket edge,
padding rows never touch the KV cache and compute the same values every step, steps above
the largest bucket and models that are not split around attention are left to the plain
forward, and greedy generation through the engine is unchanged."""
from __future__ import annotations

import random

import pytest
import torch

from realexec.models.loader import load_model
from realexec.worker.piecewise_graph import (
    PiecewiseGraphRunner, build_mixed_step_runner, piecewise_unsupported, token_buckets)
from tests.realexec.models.test_model import make_metadata
from tests.tiny_models import save_tiny_gemma2, save_tiny_llama, save_tiny_moe, save_tiny_phi3, save_tiny_qwen3

BS, NUM_BLOCKS, VOCAB = 4, 512, 128
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-piecewise")
    save_tiny_llama(path, vocab_size=VOCAB, initializer_range=0.15)
    model, config, _ = load_model(str(path), dtype=torch.float32, device="cpu")
    return model, config


def _caches(config, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BS, config.num_key_value_heads, config.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(config.num_hidden_layers)]


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def mixed_batch(n: int, seed: int):
    """(input_ids, positions, metadata) of n tokens: a prefill chunk after a cached prefix
    first (n >= 2), then a random mix of decodes, chunks after cached prefixes and whole
    prompts, over disjoint shuffled block tables (the cache's contents are the prefixes)."""
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    seqs, left = [], n
    while left:
        kind = "chunk" if not seqs and n >= 2 else rng.choice(["decode", "decode", "chunk", "prompt"])
        q = 1 if kind == "decode" or left == 1 else rng.randint(2, min(left, 20))
        ctx = 0 if kind == "prompt" else rng.randint(1, 20)
        seqs.append(([free.pop() for _ in range(-(-(ctx + q) // BS))], ctx, q))
        left -= q
    ids = torch.tensor([rng.randrange(VOCAB) for _ in range(n)])
    pos = torch.tensor([p for _, ctx, q in seqs for p in range(ctx, ctx + q)])
    return ids, pos, make_metadata(seqs, BS)


def test_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256] + list(range(512, 2049, 256))
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(64) == [16, 32, 64] and token_buckets(16) == [16] and token_buckets(5) == [5]
    assert token_buckets(1000)[-3:] == [512, 768, 1000]
    assert token_buckets(1024)[-3:] == [512, 768, 1024]
    assert token_buckets(8192)[-1] == 2048 and token_buckets(8192, cap=4096)[-1] == 4096


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 63, 64])
def test_segmented_padded_path_equals_forward(tiny, n):
    model, config = tiny
    ids, pos, md = mixed_batch(n, seed=n)
    snapshot = _caches(config)
    want_caches, got_caches = _clone(snapshot), _clone(snapshot)
    with torch.inference_mode():
        want = model(ids, pos, want_caches, md).clone()
    runner = PiecewiseGraphRunner(model, max_tokens=64, device=CPU, capture=True)
    assert runner.buckets == [16, 32, 64] and not runner.graphs       # no capture off CUDA
    assert runner.bucket_for(n) == min(b for b in runner.buckets if b >= n)
    got = runner.run(ids, pos, got_caches, md)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The cache: slots of the real rows hold the forward's K/V; every other slot is untouched.
    real = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool)
    real[md.slot_mapping] = True
    for before, after, ref in zip(snapshot, got_caches, want_caches):
        for b, a, r in zip(before, after, ref):
            b, a, r = b.flatten(0, 1), a.flatten(0, 1), r.flatten(0, 1)
            assert torch.equal(a[~real], b[~real])
            torch.testing.assert_close(a[real], r[real], rtol=0, atol=1e-5)


def test_bucket_edges(tiny):
    runner = PiecewiseGraphRunner(tiny[0], max_tokens=64, device=CPU, capture=False)
    assert [runner.bucket_for(n) for n in (1, 15, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_other_llama_families(tmp_path, family):
    """Qwen3's q/k norm and Phi-3's partial rotary (a narrower cos/sin buffer) go through the
    same split."""
    {"qwen3": save_tiny_qwen3, "phi3": save_tiny_phi3}[family](tmp_path)
    model, config, _ = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    ids, pos, md = mixed_batch(23, seed=5)
    ids = ids % config.vocab_size
    caches = _caches(config)
    with torch.inference_mode():
        want = model(ids, pos, _clone(caches), md).clone()
    got = PiecewiseGraphRunner(model, max_tokens=32, device=CPU, capture=False).run(ids, pos, caches, md)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_padding_rows_see_zero_attention_whatever_ran_before(tiny):
    """Rows n:b of the attention buffer are zero at every layer, so padding rows compute the
    same values after a larger step as in a fresh runner (no stale rows from that step)."""
    model, config = tiny
    small = mixed_batch(20, seed=7)
    used = PiecewiseGraphRunner(model, max_tokens=32, device=CPU, capture=False)
    used.run(*mixed_batch(32, seed=8)[:2], _caches(config), mixed_batch(32, seed=8)[2])
    used.run(small[0], small[1], _caches(config), small[2])
    fresh = PiecewiseGraphRunner(model, max_tokens=32, device=CPU, capture=False)
    fresh.run(small[0], small[1], _caches(config), small[2])
    assert not used.attn[20:32].any()
    assert torch.equal(used.out[20:32], fresh.out[20:32])
    assert torch.equal(used.out[:20], fresh.out[:20])


def test_step_above_largest_bucket_is_refused(tiny):
    model, config = tiny
    runner = PiecewiseGraphRunner(model, max_tokens=16, device=CPU, capture=False)
    ids, pos, md = mixed_batch(17, seed=3)
    with pytest.raises(ValueError, match="exceeds the largest piecewise bucket 16"):
        runner.run(ids, pos, _caches(config), md)
    with pytest.raises(ValueError, match="metadata covers 17 tokens, the step has 16"):
        runner.run(ids[:16], pos[:16], _caches(config), md)


def test_models_without_the_split_get_no_runner(tmp_path, tiny, monkeypatch):
    from realexec.distributed import PPGroup
    from realexec.models.llama import LlamaForCausalLM

    assert piecewise_unsupported(tiny[0]) is None
    save_tiny_gemma2(tmp_path / "gemma2")
    save_tiny_moe(tmp_path / "moe")
    gemma, _, _ = load_model(str(tmp_path / "gemma2"), dtype=torch.float32, device="cpu")
    moe, _, _ = load_model(str(tmp_path / "moe"), dtype=torch.float32, device="cpu")
    assert "forward is not LlamaForCausalLM's" in piecewise_unsupported(gemma)
    assert "SparseMoeBlock is not a dense MLP" in piecewise_unsupported(moe)
    for model in (gemma, moe):
        assert build_mixed_step_runner(model, max_tokens=64, device=CPU, capture=True) is None
        with pytest.raises(ValueError, match="no piecewise graphs"):
            PiecewiseGraphRunner(model, max_tokens=64, device=CPU, capture=False)
    # A Gemma 2 whose forward were Llama's would still be refused: its layers are not split.
    monkeypatch.setattr(type(gemma), "forward", LlamaForCausalLM.forward)
    assert "Gemma2DecoderLayer is not split around attention" in piecewise_unsupported(gemma)
    stage = load_model(str(tmp_path / "moe"), dtype=torch.float32, device="cpu",
                       pp=PPGroup(rank=0, size=2, layers=range(0, 1)))[0]
    assert "pipeline parallelism" in piecewise_unsupported(stage)


def test_greedy_through_the_engine(tmp_path):
    """The engine on CPU with a runner forced on (buckets 16 and 32 under a 40-token budget:
    steps of 33-40 tokens take the plain forward): the same greedy tokens as without it,
    with mixed prefill+decode steps through the runner."""
    from core import SamplingParams
    from realexec import LLM

    save_tiny_llama(tmp_path, vocab_size=256, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 11, 17, 30, 45)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine_args = dict(block_size=4, num_gpu_blocks=256, swap_space=0.01, max_num_batched_tokens=40, max_num_seqs=4)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    plain = LLM(model=str(tmp_path), **engine_args)
    want = tokens(plain)
    plain.shutdown()

    def force_runner(worker):       # the test hook: what the worker builds on CUDA, uncaptured
        worker.runner.mixed_graph_runner = build_mixed_step_runner(
            worker.model, max_tokens=32, device=worker.device, capture=False, buckets=[16, 32])
        return worker.runner.mixed_graph_runner

    llm = LLM(model=str(tmp_path), **engine_args)
    [runner] = llm.engine.executor.collective_rpc(force_runner)
    steps, run = [], runner.run
    runner.run = lambda ids, pos, caches, md: steps.append(list(md.query_lens_cpu)) or run(ids, pos, caches, md)
    assert tokens(llm) == want
    [num_steps] = llm.engine.executor.collective_rpc(lambda worker: worker.runner.num_steps)
    llm.shutdown()
    assert any(max(q) > 1 and min(q) == 1 for q in steps)        # mixed prefill + decode steps went through it
    assert all(sum(q) <= 32 for q in steps) and num_steps > len(steps)     # larger steps ran the plain forward


def test_bench_mixed_table_smoke(tiny, monkeypatch, capsys):
    """`bench graphs`' mixed-step table on CPU (a fake timer): its batches are valid and the
    runner agrees with the forward on them."""
    from realexec.bench import graphs, kernels

    model, config = tiny
    monkeypatch.setattr(kernels, "cuda_time_us", lambda fn, **kw: (fn(), 1000.0)[1])
    graphs.mixed_steps(model, config, torch.float32, 24, [(8, 3), (20, 12)], reps=1, device="cpu")
    rows = capsys.readouterr().out.splitlines()[-2:]
    assert [r.split()[:3] for r in rows] == [["8x3", "11", "16"], ["20x12", "32", "32"]]
    assert all(float(r.split()[-1]) < 1e-5 for r in rows)
