"""The projections' CPU weight layouts (realexec.models.linear): packed weights give F.linear's
results at every row count, each format keeps or frees what it says, the small-row rule
picks the dense weight below the packed twin's min_rows (by CPU vendor, or as given), and a
sleeping engine's packed weights come back on wake-up."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core import SamplingParams
from realexec.config import EngineArgs
from realexec.models.linear import (SMALL_ROWS, Linear, cpu_vendor, default_packed_min_rows, pack_weights,
                                   packed_parameter, project, set_parameter)
from realexec.models.loader import load_model
from tests.realexec.models.test_model import PagedKV, run_step
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_gives_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    want = F.linear(x, w, b)
    packed = packed_parameter(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    for got in (project(x, packed, b), project(x, w, b, packed)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_leading_dims_and_strided_input():
    w = torch.randn(48, 32)
    packed = packed_parameter(w)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(project(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)
    xt = torch.randn(32, 7).t()                       # not contiguous
    torch.testing.assert_close(project(xt, w, None, packed), F.linear(xt, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("min_rows", [1, 2, SMALL_ROWS])
def test_small_row_steps_use_the_dense_weight_and_larger_ones_the_packed(min_rows):
    """With both weights, fewer than the twin's min_rows rows read the dense one (MKL, faster
    there on Intel) and the rest the packed one: a packed twin of another matrix tells which."""
    dense, other = torch.randn(16, 8), torch.randn(16, 8)
    twin = packed_parameter(other, min_rows)
    assert twin.min_rows == min_rows
    few, many = torch.randn(min_rows - 1, 8), torch.randn(min_rows, 8)
    torch.testing.assert_close(project(few, dense, None, twin), F.linear(few, dense))
    torch.testing.assert_close(project(many, dense, None, twin), F.linear(many, other), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="min_rows must be >= 1, got 0"):
        packed_parameter(other, 0)


def test_packed_min_rows_by_cpu_vendor():
    """MKL's small-row kernels are Intel's: dense below 4 rows there (and where unmeasured),
    packed at every row count on AMD."""
    assert default_packed_min_rows("AuthenticAMD") == 1
    assert default_packed_min_rows("GenuineIntel") == SMALL_ROWS == 4
    assert default_packed_min_rows("") == SMALL_ROWS
    assert default_packed_min_rows() == default_packed_min_rows(cpu_vendor())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-linear")
    save_tiny_llama(path, vocab_size=256, initializer_range=0.15, tie_word_embeddings=True)
    return path


def _projection_weights(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("proj.weight")}


@pytest.mark.parametrize("fmt, min_rows, expect", [
    ("packed", 4, "packed"), ("both", 4, "both"), ("both", 1, "both"), ("dense", 4, "dense"),
    ("auto", 4, "both"),        # a tiny model is under auto's 2 GiB
    ("auto", 1, "packed"),      # no step would read the dense weights
])
def test_formats_keep_the_logits_and_what_they_say(tiny, fmt, min_rows, expect):
    dense, cfg, _ = load_model(tiny, dtype=torch.float32)
    model, _, _ = load_model(tiny, dtype=torch.float32)
    proj = _projection_weights(model)
    proj_bytes = sum(p.numel() * p.element_size() for p in proj.values())
    head_bytes = model.head_weight().numel() * 4
    info = pack_weights(model, fmt, min_rows)
    assert info["format"] == expect
    layers = cfg.num_hidden_layers
    if expect == "dense":
        assert info == {"format": "dense", "packed": 0, "extra_bytes": 0, "min_rows": None}
        assert model.head_packed is None and not any(p.is_mkldnn for p in model.parameters())
    else:
        assert info["packed"] == 4 * layers + 1             # qkv, o, gate_up, down per layer + the head
        assert model.head_packed is not None and model.head_packed.is_mkldnn
        assert not model.embed_tokens.weight.is_mkldnn     # the lookup keeps its rows (tied head)
        packed_now = _projection_weights(model)
        if expect == "packed":                              # replaced: no second copy
            assert all(p.is_mkldnn for p in packed_now.values()) and info["extra_bytes"] == head_bytes
            assert not any(n.endswith("weight_packed") for n, _ in model.named_parameters())
        else:
            assert not any(p.is_mkldnn for p in packed_now.values())
            twins = [p for n, p in model.named_parameters() if n.endswith("weight_packed") and p.is_mkldnn]
            assert len(twins) == 4 * layers and info["extra_bytes"] == proj_bytes + head_bytes
            assert {p.min_rows for p in twins} == {model.head_packed.min_rows} == {min_rows} == {info["min_rows"]}
    # a 9-token prefill, then 1-row decodes (under "both" the dense twin at min_rows 4, the
    # packed one at 1; packed under "packed")
    prompt = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    kv_dense, kv_ours = PagedKV(cfg, num_blocks=8, block_size=4), PagedKV(cfg, num_blocks=8, block_size=4)
    with torch.inference_mode():
        batch = [("a", prompt, 0)]
        for step in range(4):
            (want,) = run_step(dense, kv_dense, batch)
            (got,) = run_step(model, kv_ours, batch)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            batch = [("a", [int(want[-1].argmax())], len(prompt) + step)]


def test_bad_format_is_refused_up_front():
    with pytest.raises(ValueError, match="cpu-weight-format must be auto, dense, packed or both, got 'fast'"):
        EngineArgs(cpu_weight_format="fast").validate()
    with pytest.raises(ValueError, match="cpu_weight_format must be one of"):
        pack_weights(torch.nn.Linear(2, 2), "fast")
    with pytest.raises(ValueError, match="cpu-packed-min-rows must be >= 1, got 0"):
        EngineArgs(cpu_packed_min_rows=0).validate()
    with pytest.raises(ValueError, match="cpu_packed_min_rows must be >= 1, got -1"):
        pack_weights(torch.nn.Linear(2, 2), "both", -1)


def test_set_parameter_swaps_layouts_both_ways():
    lin = Linear(8, 4, bias=False)
    packed = packed_parameter(lin.weight).data
    set_parameter(lin, "weight", packed)
    assert lin.weight.is_mkldnn
    set_parameter(lin, "weight", torch.empty(0))
    assert not lin.weight.is_mkldnn and lin.weight.numel() == 0


@pytest.mark.parametrize("fmt", ["packed", "both"])
def test_sleep_level_2_then_wake_restores_packed_weights(tiny, fmt):
    """Level 2 drops every weight, packed twins and head included (all counted as released);
    wake-up reloads and packs again: the same greedy tokens as before sleeping."""
    from realexec import LLM

    llm = LLM(model=str(tiny), cpu_weight_format=fmt, cpu_packed_min_rows=2, enable_sleep_mode=True,
              num_gpu_blocks=64, block_size=4)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7]]
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        worker = llm.engine.executor.driver
        weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
        released = llm.sleep(level=2)
        assert released >= weight_bytes
        assert all(p.numel() == 0 for p in worker.model.parameters())
        llm.wake_up()
        assert worker.weight_format["format"] == fmt and worker.weight_format["min_rows"] == 2
        assert any(p.is_mkldnn for p in worker.model.parameters())
        assert worker.model.head_packed.min_rows == 2      # the engine's --cpu-packed-min-rows, packed again
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert after == before
    finally:
        llm.shutdown()
