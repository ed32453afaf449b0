"""`--compile-decode`: the compiled decode forward (attention left eager) equals the eager
model at every decode bucket, and no bucket silently falls back to eager.

Runs with torch.compile's `aot_eager` backend on CPU: dynamo's tracing, graph breaks and
recompiles are the same as with inductor, without code generation (inductor itself is
exercised on CUDA by `python -m realexec.bench.gpu`)."""
from __future__ import annotations

import pytest

import torch  # noqa: E402  (a realexec test: torch is installed by `make setup`)

from realexec.worker.compilation import capture_with_fallback, compile_decode_forward, leave_attention_eager  # noqa: E402
from realexec.worker.cuda_graph import DecodeGraphRunner, decode_buckets  # noqa: E402
from realexec.models.loader import load_model  # noqa: E402
from tests.tiny_models import save_tiny_llama  # noqa: E402

BLOCK, NUM_BLOCKS, WIDTH = 16, 64, 4
MAX_BATCH = 8           # buckets 1, 2, 4, 8 (dynamo's recompile limit is lowered below them)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-compile")
    save_tiny_llama(d, vocab_size=97)
    model, cfg, _ = load_model(str(d), dtype=torch.float32, device="cpu", attn_backend="torch")
    g = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.num_hidden_layers)]
    return model, cfg, caches


def _runner(forward, caches):
    return DecodeGraphRunner(forward, caches, block_size=BLOCK, max_batch=MAX_BATCH, max_blocks_per_seq=WIDTH,
                             max_seq_len=WIDTH * BLOCK, device=torch.device("cpu"), capture=False)


def _batch(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    pos = torch.randint(1, WIDTH * BLOCK - 1, (n,), generator=g)
    lens = (pos + 1).to(torch.int32)
    tables = torch.randint(0, NUM_BLOCKS, (n, WIDTH), dtype=torch.int32, generator=g)
    slots = torch.full((n,), -1, dtype=torch.int64)        # read the cache, write nothing
    return ids, pos, slots, lens, tables, lens.tolist()


def test_compiled_decode_equals_eager_at_every_bucket(tiny):
    import torch._dynamo.config as dynamo_config
    import torch._dynamo.utils as dynamo_utils

    model, cfg, caches = tiny
    torch._dynamo.reset()
    # A real server has up to 23 buckets against dynamo's default limit of 8 recompiles per
    # code object; here 4 buckets against a limit of 2 (cheaper to trace, the same failure).
    with dynamo_config.patch(recompile_limit=2):
        buckets = decode_buckets(MAX_BATCH)
        assert len(buckets) > dynamo_config.recompile_limit
        eager = _runner(model, caches)
        compiled = _runner(compile_decode_forward(model, backend="aot_eager"), caches)
        graphs = []
        with torch.inference_mode():
            for i, b in enumerate(buckets):
                # a padded batch where the bucket allows one: n rows in bucket b
                n = b - 1 if i > 0 and b - 1 > buckets[i - 1] else b
                batch = _batch(n, cfg.vocab_size, seed=i)
                want = eager.run(*batch)
                got = compiled.run(*batch)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    # Every bucket compiled its own graphs: none fell back to eager after the limit.
    assert all(later > earlier for earlier, later in zip(graphs, graphs[1:])), graphs


def test_attention_is_a_graph_break_marked_once(tiny):
    model, _, _ = tiny
    backend = model.layers[0].self_attn.backend
    leave_attention_eager(model)
    first = backend.forward
    assert getattr(first, "_twinserve_eager", False)
    assert leave_attention_eager(model) == 0           # idempotent: never wrapped twice
    assert backend.forward is first


def test_a_failed_compile_falls_back_to_uncompiled_graphs(tiny):
    model, _, _ = tiny
    captured = []

    def capture(forward):
        if forward is not model:            # the compiled forward: its capture fails
            raise RuntimeError("inductor cannot build this")
        captured.append(forward)
        return "uncompiled runner"

    with pytest.warns(RuntimeWarning, match="inductor cannot build this.*uncompiled decode graphs"):
        assert capture_with_fallback(capture, model, compile_decode=True, where="rank 0") == "uncompiled runner"
    assert captured == [model]


def test_compile_decode_off_captures_the_model_itself(tiny):
    model, _, _ = tiny
    assert capture_with_fallback(lambda forward: forward, model, compile_decode=False) is model
    compiled = capture_with_fallback(lambda forward: forward, model, compile_decode=True)
    assert compiled is not model and callable(compiled)
