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

from core import SamplingParams  # noqa: E402
from realexec.models.loader import load_model, read_model_config  # noqa: E402
from tests.realexec.models.test_model import (  # noqa: E402
    ATOL, PagedKV, greedy_generate, hf_logits, random_prompts, run_step)
from tests.tiny_models import save_tiny_mistral_window  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = ("torch", "cpu") + (("triton",) if INTERPRET else ())


def check_prefill_batch(ours, hf):
    prompts = random_prompts(3, [5, 8, 13])
    got = run_step(ours, PagedKV(ours.config, num_blocks=32, block_size=4),
                   [(f"p{i}", p, 0) for i, p in enumerate(prompts)])
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)


def check_chunks_decodes_prefix_hit(ours, hf):
    """Chunks mixed with decodes, decode-only steps past the window, then a sequence that
    reuses another's first two blocks (a prefix-cache hit) and computes only its suffix:
    HF's full-prefill logits throughout."""
    B = 4
    a, b = random_prompts(2, [14, 15], seed=2)
    c = a[:2 * B] + random_prompts(1, [6], seed=3)[0]
    ref_a, ref_b, ref_c = (hf_logits(hf, s) for s in (a, b, c))
    kv = PagedKV(ours.config, num_blocks=48, block_size=B, seed=5)
    la, lb = run_step(ours, kv, [("a", a[:9], 0), ("b", b[:5], 0)])
    torch.testing.assert_close(la, ref_a[:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[:5], atol=ATOL, rtol=0)
    la, lb = run_step(ours, kv, [("a", a[9:10], 9), ("b", b[5:], 5)])
    torch.testing.assert_close(la, ref_a[9:10], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[5:], atol=ATOL, rtol=0)
    for pos in range(10, 14):
        (la,) = run_step(ours, kv, [("a", a[pos:pos + 1], pos)])
        torch.testing.assert_close(la, ref_a[pos:pos + 1], atol=ATOL, rtol=0)
    kv.share_prefix("c", "a", 2)
    (lc,) = run_step(ours, kv, [("c", c[2 * B:], 2 * B)])
    torch.testing.assert_close(lc, ref_c[2 * B:], atol=ATOL, rtol=0)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy tokens, never stopping at EOS (as our runs with ignore_eos)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=-1)          # a token that never comes
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      generation_config=config)
    return out[0, len(prompt):].tolist()


def check_greedy(ours, hf, max_new_tokens=24):
    prompts = random_prompts(2, [6, 11], seed=4)
    got = greedy_generate(ours, PagedKV(ours.config, num_blocks=64, block_size=4, seed=7), prompts, max_new_tokens)
    assert got == [hf_greedy(hf, p, max_new_tokens) for p in prompts]


SHARED = list(range(40, 56))                        # 4 full blocks of 4: prefix-cache hits
PROMPTS = [SHARED + [3, 4, 5], SHARED + [6, 7, 8, 9, 10], list(range(100, 131)), [9, 8, 7, 6, 5]]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
# Chunks of 16 tokens (the 31-token prompt prefills in two), prefix caching on.
ENGINE = dict(block_size=4, num_gpu_blocks=128, swap_space=0.002, max_num_batched_tokens=16,
              enable_prefix_caching=True)


def check_engine(path, hf, **engine_args):
    """LLM (CPU default backend) with chunked prefill and prefix caching: HF's greedy
    tokens; the shared prompts run after the first finishes, so they hit its blocks."""
    from realexec import LLM

    llm = LLM(model=str(path), **ENGINE, **engine_args)
    try:
        hits0 = llm.engine.scheduler.kv.stats().prefix_cache_hits
        outs = llm.generate(PROMPTS[:1], GREEDY) + llm.generate(PROMPTS[1:], GREEDY)
        assert llm.engine.scheduler.kv.stats().prefix_cache_hits > hits0
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 20) for p in PROMPTS]
    finally:
        llm.shutdown()


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
