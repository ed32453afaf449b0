"""Mistral's sliding window against transformers.

A tiny random MistralConfig checkpoint with sliding_window 5, shorter than every test
prompt: our paged model's logits agree with HF's (eager attention, which applies the
window) within fp32 tolerance in one batch, in chunked prefills mixed with decodes and
after a prefix-cache hit, and greedy tokens equal HF `generate`, with each attention
backend (Triton under TRITON_INTERPRET=1) and through the engine. The helpers here serve
test_gemma2.py too.
"""
import os

INTERPRET = os.environ.get("TWINSERVE_TRITON_GPU_TESTS") != "1"   # these models run on the CPU
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see tests/realexec/kernels)

import pytest  # noqa: E402
import torch  # noqa: E402

from realexec.models.loader import load_model, read_model_config  # noqa: E402
from tests.realexec.models.hf_parity import (  # noqa: E402
    check_chunks_decodes_prefix_hit, check_engine, check_greedy, check_prefill_batch)
from tests.realexec.models.test_model import ATOL, hf_logits, random_prompts  # noqa: E402
from tests.tiny_models import save_tiny_mistral_window  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = ("torch", "cpu") + (("triton",) if INTERPRET else ())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral-window")
    return path, save_tiny_mistral_window(path)


@pytest.fixture(scope="module", params=BACKENDS)
def tiny(request, checkpoint):
    path, hf = checkpoint
    ours, cfg, _ = load_model(path, dtype=torch.float32, attn_backend=request.param)
    assert ours.layers[0].self_attn.backend.name == request.param
    return ours, hf


def test_config_windows_every_layer(checkpoint):
    cfg = read_model_config(checkpoint[0])
    assert (cfg.architecture, cfg.sliding_window, cfg.layer_types) == ("MistralForCausalLM", 5, ())
    assert [cfg.sliding_window_for(i) for i in range(cfg.num_hidden_layers)] == [5, 5]


def test_the_window_changes_hf_logits(checkpoint):
    """The test data is sensitive to the window: HF without it gives other logits."""
    _, hf = checkpoint
    prompt = random_prompts(1, [13])[0]
    windowed = hf_logits(hf, prompt)
    hf.config.sliding_window = None
    try:
        full = hf_logits(hf, prompt)
    finally:
        hf.config.sliding_window = 5
    assert (windowed[5:] - full[5:]).abs().max() > 1e-2
    torch.testing.assert_close(windowed[:5], full[:5], atol=ATOL, rtol=0)   # inside the window: equal


def test_prefill_batch_matches_hf(tiny):
    check_prefill_batch(*tiny)


def test_chunked_prefill_decodes_and_prefix_hit_match_hf(tiny):
    check_chunks_decodes_prefix_hit(*tiny)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_hf_generate(backend, checkpoint):
    path, hf = checkpoint
    ours, _, _ = load_model(path, dtype=torch.float32, attn_backend=backend)
    check_greedy(ours, hf)


def test_engine_greedy_matches_hf_generate(checkpoint):
    check_engine(*checkpoint)
