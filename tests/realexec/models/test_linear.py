"""The projections' CPU weight layouts (realexec.models.linear): packed weights (oneDNN's and
MKL's) give F.linear's results at every row count, each format keeps or frees what it says,
the small-row rule picks the dense weight below the packed twin's min_rows (by CPU vendor and
library, or as given), and a sleeping engine's packed weights come back on wake-up."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from core import SamplingParams
from realexec.config import EngineArgs
from realexec.models.linear import (SMALL_ROWS, Linear, compute_dtype, cpu_vendor, default_cpu_gemm, mkl_available,
                                   default_packed_min_rows, is_packed, pack_weights, packed_parameter, project,
                                   resolve_cpu_gemm, set_parameter, weight_shape)
from realexec.models.loader import load_model
from tests.realexec.models.test_model import PagedKV, run_step
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# MKL's packed GEMM needs a torch build that exports it; CI's (the pinned CPU wheel) does, so
# there a missing export fails these tests instead of skipping them.
needs_mkl = pytest.mark.skipif(not mkl_available() and not os.environ.get("CI"),
                               reason="this torch build does not export MKL's packed GEMM")
GEMMS = ["onednn", pytest.param("mkl", marks=needs_mkl)]


def _assert_packed_by(packed, gemm, w):
    if gemm == "mkl":
        assert packed.dtype == torch.uint8 and not packed.is_mkldnn and packed.mkl_shape == tuple(w.shape)
    else:
        assert packed.is_mkldnn and packed.shape == w.shape
    assert is_packed(packed) and not is_packed(w) and weight_shape(packed) == tuple(w.shape)


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_gives_f_linear(gemm, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    want = F.linear(x, w, b)
    packed = packed_parameter(w, gemm=gemm)
    _assert_packed_by(packed, gemm, w)
    for got in (project(x, packed, b), project(x, w, b, packed)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("gemm", GEMMS)
def test_leading_dims_and_strided_input(gemm):
    w = torch.randn(48, 32)
    packed = packed_parameter(w, gemm=gemm)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(project(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)
    xt = torch.randn(32, 7).t()                       # not contiguous
    torch.testing.assert_close(project(xt, w, None, packed), F.linear(xt, w), atol=1e-4, rtol=1e-5)


@needs_mkl
def test_mkl_packed_weight_refuses_a_wrong_width_and_outlives_its_source():
    """MKL's buffer is a copy (the dense weight may go: the "packed" format frees it) and says
    which input width it takes instead of reading past a row."""
    w = torch.randn(24, 16)
    want_x = torch.randn(5, 16)
    want = F.linear(want_x, w)
    packed = packed_parameter(w, gemm="mkl")
    w.zero_()
    del w
    torch.testing.assert_close(project(want_x, packed), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="projection input has 15 features, the packed weight takes 16"):
        project(torch.randn(5, 15), packed)


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


def test_packed_min_rows_by_cpu_vendor_and_library():
    """MKL's small-row kernels are Intel's: with oneDNN, dense below 4 rows there (and where
    unmeasured), packed at every row count on AMD; MKL's packed GEMM from one row."""
    assert default_packed_min_rows("AuthenticAMD") == 1
    assert default_packed_min_rows("GenuineIntel") == SMALL_ROWS == 4
    assert default_packed_min_rows("") == SMALL_ROWS
    assert default_packed_min_rows() == default_packed_min_rows(cpu_vendor())
    assert default_packed_min_rows("GenuineIntel", gemm="mkl") == default_packed_min_rows("", gemm="mkl") == 1


def test_packing_library_by_cpu_vendor():
    """MKL packs on Intel (where torch exports it), oneDNN elsewhere; "auto" is this CPU's."""
    assert default_cpu_gemm("GenuineIntel") == ("mkl" if mkl_available() else "onednn")
    assert default_cpu_gemm("AuthenticAMD") == default_cpu_gemm("") == "onednn"
    assert resolve_cpu_gemm("auto") == resolve_cpu_gemm(None) == default_cpu_gemm(cpu_vendor())
    assert resolve_cpu_gemm("onednn") == "onednn"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-linear")
    save_tiny_llama(path, vocab_size=256, initializer_range=0.15, tie_word_embeddings=True)
    return path


def _projection_weights(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("proj.weight")}


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("fmt, min_rows, expect", [
    ("packed", 4, "packed"), ("both", 4, "both"), ("both", 1, "both"), ("dense", 4, "dense"),
    ("auto", 4, "both"),        # a tiny model is under auto's 2 GiB
    ("auto", 1, "packed"),      # no step would read the dense weights
])
def test_formats_keep_the_logits_and_what_they_say(tiny, gemm, fmt, min_rows, expect):
    dense, cfg, _ = load_model(tiny, dtype=torch.float32)
    model, _, _ = load_model(tiny, dtype=torch.float32)
    proj_bytes = _bytes(_projection_weights(model).values())
    info = pack_weights(model, fmt, min_rows, gemm)
    assert info["format"] == expect
    layers = cfg.num_hidden_layers
    if expect == "dense":
        assert info == {"format": "dense", "gemm": None, "packed": 0, "extra_bytes": 0, "min_rows": None}
        assert model.head_packed is None and not any(is_packed(p) for p in model.parameters())
    else:
        assert info["packed"] == 4 * layers + 1             # qkv, o, gate_up, down per layer + the head
        assert info["gemm"] == gemm
        _assert_packed_by(model.head_packed, gemm, model.head_weight())
        assert not is_packed(model.embed_tokens.weight)     # the lookup keeps its rows (tied head)
        head_bytes = _bytes([model.head_packed])
        packed_now = _projection_weights(model)
        if expect == "packed":                              # replaced: no second copy
            assert all(is_packed(p) for p in packed_now.values())
            assert info["extra_bytes"] == _bytes(packed_now.values()) - proj_bytes + head_bytes
            assert not any(n.endswith("weight_packed") for n, _ in model.named_parameters())
        else:
            assert not any(is_packed(p) for p in packed_now.values())
            twins = [p for n, p in model.named_parameters() if n.endswith("weight_packed") and is_packed(p)]
            assert len(twins) == 4 * layers and info["extra_bytes"] == _bytes(twins) + head_bytes
            assert {p.min_rows for p in twins} == {model.head_packed.min_rows} == {min_rows} == {info["min_rows"]}
        assert compute_dtype(model) == torch.float32        # whatever parameter comes first
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


@needs_mkl
def test_auto_packs_with_mkl_only_while_its_buffers_stay_small(tiny, monkeypatch):
    """MKL's buffers carry ~8 MB each on top of the weights: "auto" takes MKL on Intel while
    the model's extra stays under the limits (a tiny model: ~7.9 MB per matrix, under 2 GiB),
    oneDNN past them (a model of many small experts), and an explicit "mkl" is obeyed."""
    import realexec.models.linear as linear

    monkeypatch.setattr(linear, "default_cpu_gemm", lambda vendor=None: "mkl")
    model, _, _ = load_model(tiny, dtype=torch.float32)
    info = pack_weights(model, "auto")
    assert info["gemm"] == "mkl" and info["min_rows"] == 1 and info["format"] == "packed"
    assert info["extra_bytes"] > 7e6 * info["packed"]
    monkeypatch.setattr(linear, "MKL_AUTO_MAX_EXTRA_BYTES", info["extra_bytes"] // 2)
    monkeypatch.setattr(linear, "MKL_AUTO_MAX_EXTRA_FRACTION", 0.5)
    model, _, _ = load_model(tiny, dtype=torch.float32)
    info = pack_weights(model, "auto")
    assert info["gemm"] == "onednn" and info["min_rows"] == default_packed_min_rows(gemm="onednn")
    assert model.head_packed.is_mkldnn
    model, _, _ = load_model(tiny, dtype=torch.float32)
    assert pack_weights(model, "auto", None, "mkl")["gemm"] == "mkl"


def test_bad_format_is_refused_up_front():
    with pytest.raises(ValueError, match="cpu-weight-format must be auto, dense, packed or both, got 'fast'"):
        EngineArgs(cpu_weight_format="fast").validate()
    with pytest.raises(ValueError, match="cpu-gemm must be auto, onednn or mkl, got 'blis'"):
        EngineArgs(cpu_gemm="blis").validate()
    with pytest.raises(ValueError, match="cpu_gemm must be one of auto, onednn, mkl, got 'blis'"):
        pack_weights(torch.nn.Linear(2, 2), "both", 1, "blis")
    with pytest.raises(ValueError, match="cpu_weight_format must be one of"):
        pack_weights(torch.nn.Linear(2, 2), "fast")
    with pytest.raises(ValueError, match="cpu-packed-min-rows must be >= 1, got 0"):
        EngineArgs(cpu_packed_min_rows=0).validate()
    with pytest.raises(ValueError, match="cpu_packed_min_rows must be >= 1, got -1"):
        pack_weights(torch.nn.Linear(2, 2), "both", -1)


@pytest.mark.parametrize("gemm", GEMMS)
def test_set_parameter_swaps_layouts_both_ways(gemm):
    lin = Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    want = lin(x)
    packed = packed_parameter(lin.weight, 2, gemm)
    set_parameter(lin, "weight", packed)
    assert is_packed(lin.weight) and lin.weight.min_rows == 2
    torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)
    set_parameter(lin, "weight", torch.empty(0))
    assert not is_packed(lin.weight) and lin.weight.numel() == 0 and lin.weight.dtype == torch.float32


@pytest.mark.parametrize("fmt, gemm", [("packed", "onednn"), ("both", "onednn"),
                                       pytest.param("packed", "mkl", marks=needs_mkl)])
def test_sleep_level_2_then_wake_restores_packed_weights(tiny, fmt, gemm):
    """Level 2 drops every weight, packed twins and head included (all counted as released);
    wake-up reloads and packs again: the same greedy tokens as before sleeping."""
    from realexec import LLM

    llm = LLM(model=str(tiny), cpu_weight_format=fmt, cpu_gemm=gemm, cpu_packed_min_rows=2, enable_sleep_mode=True,
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
        assert worker.weight_format["gemm"] == gemm
        assert any(is_packed(p) for p in worker.model.parameters())
        assert worker.model.head_packed.min_rows == 2      # the engine's --cpu-packed-min-rows, packed again
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert after == before
    finally:
        llm.shutdown()
