"""Checks every model family's tests run against transformers (imported by test_families,
test_mistral_window, test_gemma2 and test_moe): our paged model's logits equal HF's full
forward in one batch, under chunked prefill mixed with decodes and on a prefix-cache hit;
greedy tokens equal HF `generate`, in the model and through the engine (chunked prefill and
prefix caching on)."""
from __future__ import annotations

import torch

from core import SamplingParams
from tests.realexec.models.test_model import ATOL, PagedKV, greedy_generate, hf_logits, random_prompts, run_step


def check_prefill_batch(ours, hf):
    prompts = random_prompts(3, [5, 8, 13])
    got = run_step(ours, PagedKV(ours.config, num_blocks=32, block_size=4),
                   [(f"p{i}", p, 0) for i, p in enumerate(prompts)])
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)


def check_chunks_decodes_prefix_hit(ours, hf):
    """Chunks mixed with decodes, decode-only steps (past a small sliding window, where the
    model has one), then a sequence that reuses another's first two blocks (a prefix-cache
    hit) and computes only its suffix: HF's full-prefill logits throughout."""
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


def engine_run(llm) -> tuple[list[list[int]], int]:
    """(greedy tokens of PROMPTS, prefix-hit tokens): the shared prompts run after the
    first finishes, so they hit its cached blocks."""
    hits0 = llm.engine.scheduler.kv.stats().prefix_cache_hits
    first = llm.generate(PROMPTS[:1], GREEDY)
    rest = llm.generate(PROMPTS[1:], GREEDY)
    out = [o.outputs[0].token_ids for o in first + rest]
    return out, llm.engine.scheduler.kv.stats().prefix_cache_hits - hits0


def check_engine(path, hf, **engine_args):
    """LLM (CPU default backend) with chunked prefill and prefix caching gives HF's greedy
    tokens, and the shared prompts hit the first one's blocks."""
    from realexec import LLM

    llm = LLM(model=str(path), **ENGINE, **engine_args)
    try:
        out, hits = engine_run(llm)
        assert hits > 0
        assert out == [hf_greedy(hf, p, 20) for p in PROMPTS]
    finally:
        llm.shutdown()
