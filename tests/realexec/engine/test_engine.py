"""The real engine end to end on CPU: LLM / LLMEngine over the core, checked against HF.

Most tests use a tiny random Llama (saved with save_pretrained); SmolLM2-135M-Instruct is
used where a real tokenizer and real text matter (stop strings, chat, the CLI).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"    # the triton backend test runs the kernels interpreted

from core import InvalidRequestError, SamplingParams
from realexec import LLM
from realexec.bench.throughput import model_dir
from tests.tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
GREEDY = dict(temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, HF model) of a tiny random Llama."""
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny_llama(path, vocab_size=256, initializer_range=0.15, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    return str(path), hf


def tiny_llm(tiny, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_gpu_blocks", 512)
    kwargs.setdefault("swap_space", 0.01)
    return LLM(model=tiny[0], **kwargs)


@pytest.fixture(scope="module")
def plain(tiny) -> LLM:
    return tiny_llm(tiny)


def prompts_of(lengths, seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = prompts_of([5, 11, 17, 30])


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    """Greedy tokens of a plain run (all prompts in one batch)."""
    outs = plain.generate(PROMPTS, SamplingParams(max_tokens=32, **GREEDY))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(block_size=16, kv_cache_memory=0.25, swap_space=0.01)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos: bool = False) -> list[int]:
    from transformers import GenerationConfig

    eos_id = hf.config.eos_token_id
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos_id,
                              eos_token_id=eos_id if eos else -1)     # -1: a token that never comes
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      generation_config=config)
    return out[0, len(prompt):].tolist()


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("with_prefill", [False, True])
def test_decodes_grouped_by_length_match_one_padded_batch(with_prefill):
    """The torch backend batches decode rows per group of similar lengths (padding to each
    group's longest, not the batch's): the same output as one padded call for all."""
    from realexec.attention.torch_backend import TorchAttentionBackend
    from tests.realexec.models.test_model import make_metadata

    gen = torch.Generator().manual_seed(3)
    bs, kv_heads, heads, dim, num_blocks = 4, 2, 6, 8, 128
    free = torch.randperm(num_blocks, generator=gen).tolist()
    cases = [(70, 1), (3, 1), (9, 1), (40, 1), (0, 1), (150, 1), (20, 1)]    # (context, query) decodes
    if with_prefill:
        cases += [(0, 7), (12, 5)]
    seqs = [([free.pop() for _ in range(-(-(c + n) // bs))], c, n) for c, n in cases]
    md = make_metadata(seqs, bs)
    t = md.slot_mapping.shape[0]
    q, k, v = (torch.randn(t, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    plain = TorchAttentionBackend(group_decodes=False)
    ref = plain.forward(q, k, v, k_cache.clone(), v_cache.clone(), md, 0.3)
    assert len(plain._step_plan(md)[0]) == 1
    backend = TorchAttentionBackend()
    got = backend.forward(q, k, v, k_cache, v_cache, md, 0.3)
    groups = backend._step_plan(md)[0]
    assert len(groups) > 1                                    # several length groups
    for _, _, longest in groups[:-1]:                         # each padded to its own longest, not the batch's
        assert longest < max(c + n for c, n in cases)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- greedy vs HF

def test_tiny_greedy_matches_hf_generate(tiny, reference):
    _, hf = tiny
    for prompt, got in zip(PROMPTS, reference):
        assert len(got) == 32
        assert got == hf_greedy(hf, prompt, 32)


def test_smollm2_greedy_matches_hf_generate(smol):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir(None), dtype=torch.float32).eval()
    tok = smol.tokenizer
    convs = [[{"role": "user", "content": q}] for q in ("Write a short poem about the sea.",
                                                          "Explain what a hash table is.")]
    outs = smol.chat(convs, SamplingParams(temperature=0.0, max_tokens=32))
    for conv, out in zip(convs, outs):
        prompt = smol.engine.encode_chat(conv)
        assert out.prompt_token_ids == prompt
        ref = hf_greedy(hf, prompt, 32, eos=True)
        c = out.outputs[0]
        assert c.token_ids == ref, (c.text, tok.decode(ref))
        assert c.text == tok.decode(ref, skip_special_tokens=True)
        assert c.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")


# ----------------------------------------------------------------------------- schedules

def test_triton_backend_same_tokens(tiny, reference):
    pytest.importorskip("triton")
    llm = tiny_llm(tiny, attention_backend="triton", max_num_batched_tokens=16)   # chunks + decodes
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [r[:12] for r in reference[:2]]


def test_chunked_prefill_same_tokens(tiny, reference):
    llm = tiny_llm(tiny, max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.scheduler.config.max_num_batched_tokens == 8


def test_prefix_cache_hits_same_tokens(tiny, reference):
    llm = tiny_llm(tiny, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=32, **GREEDY)
    first = llm.generate(PROMPTS[3], params)[0]
    kv = llm.engine.scheduler.kv
    assert kv.stats().prefix_cache_hits == 0
    second = llm.generate(PROMPTS[3], params)[0]
    stats = kv.stats()
    assert stats.prefix_cache_hits >= (len(PROMPTS[3]) - 1) // 4 * 4 > 0
    assert second.metrics.num_cached_prompt_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference[3]


@pytest.mark.parametrize("algo", ["sha256", "xxhash", "builtin"])
def test_cache_salt_isolates_prefix_cache(tiny, reference, algo):
    llm = tiny_llm(tiny, enable_prefix_caching=True, prefix_caching_hash_algo=algo)
    salted = lambda salt: SamplingParams(max_tokens=32, cache_salt=salt, **GREEDY)  # noqa: E731
    hits = lambda: llm.engine.scheduler.kv.stats().prefix_cache_hits              # noqa: E731
    first = llm.generate(PROMPTS[3], salted("tenant-a"))[0]
    other = llm.generate(PROMPTS[3], salted("tenant-b"))[0]
    unsalted = llm.generate(PROMPTS[3], salted(None))[0]
    assert hits() == 0 and other.metrics.num_cached_prompt_tokens == unsalted.metrics.num_cached_prompt_tokens == 0
    again = llm.generate(PROMPTS[3], salted("tenant-a"))[0]
    assert again.metrics.num_cached_prompt_tokens == (len(PROMPTS[3]) - 1) // 4 * 4 == hits()
    assert all(o.outputs[0].token_ids == reference[3] for o in (first, other, unsalted, again))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_same_tokens(tiny, reference, mode):
    llm = tiny_llm(tiny, num_gpu_blocks=24, preemption_mode=mode)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, **GREEDY))
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swaps > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


# ----------------------------------------------------------------------------- async scheduling

@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=8), dict(num_gpu_blocks=24),
                                dict(num_gpu_blocks=24, preemption_mode="swap"), dict(enable_prefix_caching=True)],
                         ids=["chunked", "recompute", "swap-policy", "prefix-cache"])
def test_async_scheduling_same_tokens(tiny, reference, kw):
    import threading
    llm = tiny_llm(tiny, async_scheduling=True, **kw)
    try:
        params = SamplingParams(max_tokens=32, **GREEDY)
        outs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == reference
        if kw.get("enable_prefix_caching"):
            again = llm.generate(PROMPTS[3], params)[0]
            assert again.metrics.num_cached_prompt_tokens > 0 and again.outputs[0].token_ids == reference[3]
        if "num_gpu_blocks" in kw:
            assert llm.engine.scheduler.num_preemptions > 0
        stats = llm.engine.timing_stats()          # an RPC after the steps, on the model thread
        assert stats["steps"] > 0
        assert llm.engine.scheduler.kv.stats().num_used_gpu_blocks == 0
    finally:
        llm.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("twinserve-model")]


def test_async_scheduling_overlaps_steps(tiny):
    llm = tiny_llm(tiny, async_scheduling=True)
    try:
        engine = llm.engine
        seen = []
        schedule = engine.scheduler.schedule

        def watched(now=0.0):
            seen.append(engine.scheduler.num_in_flight)
            return schedule(now)

        engine.scheduler.schedule = watched
        import threading
        driver, threads = engine.executor.driver, set()
        execute = driver.execute_model

        def on_thread(msg):
            threads.add(threading.current_thread().name)
            return execute(msg)

        driver.execute_model = on_thread
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, **GREEDY))
        assert seen.count(1) >= 6          # most steps were scheduled while the one before computed
        assert len(threads) == 1 and threads.pop().startswith("twinserve-model")   # not the caller's thread
        assert engine.executor.num_steps == engine.scheduler.num_steps
    finally:
        llm.shutdown()


def test_async_scheduling_needs_one_pipeline_stage():
    with pytest.raises(ValueError, match="async-scheduling overlaps the steps of one pipeline stage"):
        LLM(model="unused", async_scheduling=True, pipeline_parallel_size=2)


def test_async_scheduling_stop_strings_and_streaming(smol):
    llm = LLM(block_size=16, kv_cache_memory=0.25, swap_space=0.01, async_scheduling=True)
    try:
        conv = [{"role": "user", "content": "Write a short poem about the sea."}]
        base = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
        words = base.text.split()
        stop = " " + words[5]
        idx = base.text.find(stop)
        out = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))[0].outputs[0]
        assert out.text == base.text[:idx] and (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert base.token_ids[:len(out.token_ids)] == out.token_ids
        engine = llm.engine
        text, tokens = stream_deltas(engine, engine.encode_chat(conv), SamplingParams(temperature=0.0, max_tokens=24))
        assert tokens == base.token_ids[:24]
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- n > 1, seeds

@torch.no_grad()
def teacher_forced_logprob(hf, prompt: list[int], output: list[int]) -> float:
    """Sum of the output tokens' logprobs under one full forward of prompt + output."""
    lp = hf(torch.tensor([prompt + output])).logits[0].float().log_softmax(-1)
    return sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(output))


def test_parallel_samples_share_prompt_blocks_and_reproduce(tiny):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = tiny_llm(tiny)
    engine = llm.engine
    prompt = prompts_of([10], seed=5)[0]                  # 3 blocks of 4, the last one partial
    rid = engine.add_request(prompt, params)
    request = engine.scheduler.requests[rid]
    engine.step()                                         # prefill, sample 2, fork
    seqs = request.seqs
    assert len(seqs) == 2
    kv = engine.scheduler.kv
    t0, t1 = kv.tables[seqs[0].seq_id], kv.tables[seqs[1].seq_id]
    assert t0 == t1 and len(t0) == 3
    assert all(kv.gpu.ref_cnt[b] == 2 for b in t0)
    assert kv.stats().num_used_gpu_blocks == 3
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    (out,) = finals
    assert [c.index for c in out.outputs] == [0, 1]
    samples = [c.token_ids for c in out.outputs]
    assert all(len(s) == 12 for s in samples) and samples[0] != samples[1]
    assert kv.stats().num_used_gpu_blocks == 0
    # Each sample's logprobs match a teacher-forced forward: the copy-on-write of the shared
    # partial block gave each sample the right KV.
    for c in out.outputs:
        assert abs(c.cumulative_logprob - teacher_forced_logprob(tiny[1], prompt, c.token_ids)) < 1e-4
    # Same seed, fresh engine, other requests in the batch: same samples.
    again = tiny_llm(tiny).generate([prompt] + PROMPTS, [params] + [SamplingParams(max_tokens=5, **GREEDY)] * 4)
    assert [c.token_ids for c in again[0].outputs] == samples


def test_seeds(plain):
    prompt = PROMPTS[1]
    def sample(seed, others=()):
        params = [SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=16, ignore_eos=True)]
        outs = plain.generate([prompt, *others], params + [SamplingParams(temperature=1.0, max_tokens=8)] * len(others))
        return outs[0].outputs[0].token_ids

    a = sample(7)
    assert sample(7) == a
    assert sample(7, others=PROMPTS[2:]) == a            # independent of the batch around it
    assert sample(8) != a


def test_top_k_top_p_masks():
    from realexec.worker.sampler import apply_top_k_top_p

    logits = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3).log()[:, [3, 0, 4, 2, 1]]   # shuffled
    out = apply_top_k_top_p(logits, torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.8, 0.45]))
    kept = [sorted(torch.isfinite(row).nonzero().flatten().tolist()) for row in out]
    # columns: 0 -> p 0.1, 1 -> 0.5, 2 -> 0.05, 3 -> 0.15, 4 -> 0.2
    assert kept == [[1, 4], [1, 3, 4], [1]]
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_top_k_one_is_greedy(plain, reference):
    out = plain.generate(PROMPTS[0], SamplingParams(temperature=0.8, top_k=1, max_tokens=32, ignore_eos=True))
    assert out[0].outputs[0].token_ids == reference[0]


# ----------------------------------------------------------------------------- beam search

def test_beam_search_ranked_and_logprobs_teacher_forced(tiny, plain):
    _, hf = tiny
    prompt = PROMPTS[0]
    (out,) = plain.generate(prompt, SamplingParams(beam_width=3, max_tokens=8))
    beams = out.outputs
    assert len(beams) == 3 and out.finished
    assert [c.index for c in beams] == [0, 1, 2]
    scores = [c.cumulative_logprob / len(c.token_ids) for c in beams]     # length_penalty 1
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(c.token_ids) for c in beams}) == 3
    for c in beams:
        assert abs(c.cumulative_logprob - teacher_forced_logprob(hf, prompt, c.token_ids)) < 1e-4
    # The best beam scores at least as well as greedy.
    greedy = plain.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0))[0].outputs[0]
    if greedy.finish_reason == "length" and beams[0].finish_reason == "length":
        assert beams[0].cumulative_logprob >= greedy.cumulative_logprob - 1e-5


# ----------------------------------------------------------------------------- logprobs

def test_logprobs(plain, reference):
    (out,) = plain.generate(PROMPTS[1], SamplingParams(max_tokens=32, logprobs=3, **GREEDY))
    c = out.outputs[0]
    assert c.token_ids == reference[1]
    assert len(c.logprobs) == 32
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and len(lp) == 3               # greedy: the chosen token is in the top 3
        assert lp[tok] == pytest.approx(max(lp.values()))
        assert all(v <= 0 for v in lp.values())
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))


# ----------------------------------------------------------------------------- text: stop strings, streaming

def test_stop_strings_truncate(smol):
    conv = [{"role": "user", "content": "Write a short poem about the sea."}]
    base = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    words = base.text.split()
    assert len(words) > 6
    stop = " " + words[5]
    idx = base.text.find(stop)
    assert idx > 0
    out = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop, "@@never@@"]))[0].outputs[0]
    assert out.text == base.text[:idx]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(base.token_ids)
    incl = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                          include_stop_str_in_output=True))[0].outputs[0]
    assert incl.text == base.text[:idx + len(stop)]


def stream_deltas(engine, prompt_ids, params) -> tuple[str, list[int]]:
    """Step one request to its end; its text and token deltas must add up to its final output."""
    rid = engine.add_request(prompt_ids, params)
    text, tokens, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            text += out.outputs[0].text_delta
            tokens += out.outputs[0].token_ids_delta
            final = out
    assert final.finished and text == final.outputs[0].text and tokens == final.outputs[0].token_ids
    return text, tokens


def test_streaming_deltas_add_up(smol):
    engine = smol.engine
    ids = engine.encode_chat([{"role": "user", "content": "Name three colors."}])
    text, _ = stream_deltas(engine, ids, SamplingParams(temperature=0.0, max_tokens=24, stop=["@@"]))
    assert text.strip()


def test_abort(plain):
    engine = plain.engine
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    engine.step()                                          # drains the abort in the core
    assert engine.scheduler.kv.stats().num_used_gpu_blocks == 0


# ----------------------------------------------------------------------------- bad input

def test_bad_input_then_engine_still_serves(plain, reference):
    engine = plain.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        plain.generate([[]])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        plain.generate("text needs a tokenizer")
    long = [5] * 300
    with pytest.raises(InvalidRequestError, match=f"300 tokens.*max_model_len is {engine.max_model_len}"):
        plain.generate([long])
    with pytest.raises(InvalidRequestError, match="temperature"):
        plain.generate(PROMPTS[0], SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidRequestError, match=r"\[0, 256\)"):
        plain.generate([[1, 2, 999]])
    with pytest.raises(InvalidRequestError, match="rejected"):   # more sequences than max_num_seqs
        plain.generate(PROMPTS[0], SamplingParams(n=300, temperature=1.0))
    # A failing batch adds nothing; the engine still serves.
    with pytest.raises(InvalidRequestError):
        plain.generate([PROMPTS[0], []])
    assert not engine.has_unfinished_requests()
    out = plain.generate(PROMPTS[0], SamplingParams(max_tokens=32, **GREEDY))
    assert out[0].outputs[0].token_ids == reference[0]


def test_smollm2_empty_text_prompt(smol):
    with pytest.raises(InvalidRequestError, match="empty"):
        smol.generate("")


# ----------------------------------------------------------------------------- CLI

def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "realexec", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("max_tokens, finish", [(16, "[finish_reason: stop, 8 tokens]"),
                                                 (4, "[finish_reason: length, 4 tokens (cut off")])
def test_cli_generate_chat_france(max_tokens, finish):
    """The answer, then its finish reason: a cut-off answer says so."""
    r = run_cli("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", str(max_tokens),
                "--temperature", "0", "--kv-cache-memory", "0.1", "--swap-space", "0")
    assert r.returncode == 0, r.stderr
    text, last = r.stdout.rstrip("\n").rsplit("\n", 1)
    assert last.startswith(finish), r.stdout
    assert ("Paris" in text) == (finish.startswith("[finish_reason: stop"))
    assert "generating" not in r.stderr          # no progress bars when stderr is not a terminal


# ----------------------------------------------------------------------------- progress bars

def bar_counts(err: str, desc: str) -> list[tuple[int, int]]:
    """(done, total) of every redraw of the tqdm bar `desc` in captured stderr."""
    return [(int(a), int(b)) for a, b in re.findall(rf"{re.escape(desc)}:[^\r\n]*?(\d+)/(\d+) \[", err)]


def test_generate_progress_counts_output_tokens(plain, capsys):
    caps = (7, 12, 20, 3)
    outs = plain.generate(PROMPTS, [SamplingParams(max_tokens=m, **GREEDY) for m in caps], use_tqdm=True)
    counts = bar_counts(capsys.readouterr().err, "generating")
    assert counts[-1] == (42, 42) and {total for _, total in counts} == {42}
    assert [done for done, _ in counts] == sorted(done for done, _ in counts)      # never goes back
    assert [len(o.outputs[0].token_ids) for o in outs] == list(caps)
    # n = 2: a request advances by its longest sample, not by the sum of its samples
    plain.generate(PROMPTS[0], SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True),
                   use_tqdm=True)
    assert bar_counts(capsys.readouterr().err, "generating")[-1] == (5, 5)
    plain.generate(PROMPTS[0], SamplingParams(max_tokens=5, **GREEDY))              # default: no bar
    assert "generating" not in capsys.readouterr().err


def test_bench_throughput_progress_counts_tokens(tiny, capsys):
    from realexec.bench.throughput import run_ours

    requests = list(zip(PROMPTS, (4, 9, 6, 1)))
    stats = run_ours(tiny_llm(tiny).engine, requests, progress=True)
    err = capsys.readouterr().err
    assert stats["output_tokens"] == 20 and bar_counts(err, "twinserve")[-1] == (20, 20)
    assert re.search(r"20/20 \[[^\]]*tok/s\]", err)                                 # the running rate


def test_busy_ticker_leaves_done_or_clears_on_error(capsys):
    from realexec.progress import busy

    with busy("loading thing", enabled=True):
        pass
    assert re.search(r"loading thing: \d\d:\d\d, done\n", capsys.readouterr().err)
    with pytest.raises(RuntimeError), busy("loading other", enabled=True):
        raise RuntimeError("bad model")
    err = capsys.readouterr().err
    assert "loading other" in err and not re.search(r"loading other: [^\r]*\n", err)    # the line is wiped


@pytest.mark.parametrize("args, message", [
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "   "], "empty"),
    (["generate", "--prompt", "hi", "--model", "/nonexistent/model"], "nonexistent"),
    (["bench", "throughput", "--trace", "/nonexistent.json", "--skip-hf", "--num-gpu-blocks", "4"], "nonexistent"),
])
def test_cli_bad_input(args, message):
    r = run_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and message in r.stderr and "Traceback" not in r.stderr


def test_decode_through_graph_runner_padding_path_matches_plain(tiny):
    """The CUDA-graph decode path (static buffers, padded buckets) wired into the model
    runner, run eagerly on CPU: greedy tokens equal the plain eager path's."""
    from realexec.worker.cuda_graph import DecodeGraphRunner

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in tiny_llm(tiny).generate(prompts, params)]
    llm = tiny_llm(tiny)
    worker = llm.engine.executor.driver
    runner = worker.runner
    runner.graph_runner = DecodeGraphRunner(worker.model, runner.kv_caches, block_size=4, max_batch=8,
                                            max_blocks_per_seq=16, max_seq_len=64, device=torch.device("cpu"),
                                            capture=True)
    calls = []
    run = runner.graph_runner.run
    runner.graph_runner.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    padded = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert padded == plain
    assert calls and max(calls) == 4              # decode batches went through the padded path


def test_fast_decoder_is_the_tokenizers_decode():
    """Detokenization calls the Rust tokenizer directly (`decoder_of`) only where that is
    what transformers' decode returns: equal on random windows, special tokens included;
    a tokenizer that cleans up spaces keeps transformers' decode."""
    import random

    from realexec.engine.llm_engine import decoder_of
    from realexec.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir(None))
    decode = decoder_of(tok)
    assert decode == tok.backend_tokenizer.decode
    rng = random.Random(0)
    specials = tok.all_special_ids
    for _ in range(3000):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(8))]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True
    assert decoder_of(tok) == tok.decode
    assert decoder_of(None) is None


def test_prefill_kernel_warm_up_writes_nothing_and_changes_no_output(tiny):
    """The start-up warm-up (run on CUDA with the Triton backend so the first request does
    not wait for kernel compilation) is a forward over the real cache: run here under the
    Triton interpreter, it must leave every cache block as it was and later outputs alike."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = tiny_llm(tiny, attention_backend="triton")
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    worker = llm.engine.executor.driver
    for k, v in worker.gpu_cache:
        k.normal_()
        v.normal_()                             # blocks with content, block 0 included
    snapshot = [(k.clone(), v.clone()) for k, v in worker.gpu_cache]
    worker.warm_up_prefill_kernels()
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(worker.gpu_cache, snapshot))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before


# ----------------------------------------------------------------------------- min_tokens

def _rows(specs):
    """ScheduledSeq rows for the sampler: (prompt_len, num_outputs, SamplingParams, eos) each."""
    from core import Request, ScheduledSeq

    rows = []
    for i, (prompt_len, outputs, params, eos) in enumerate(specs):
        req = Request(f"m{i}", list(range(3, 3 + prompt_len)), params, eos_token_id=eos)
        seq = req.seqs[0]
        seq.token_ids.extend([5] * outputs)
        rows.append(ScheduledSeq(seq, seq.num_tokens - 1, 1, 1, []))
    return rows


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sampler_masks_eos_and_stop_ids_until_min_tokens(temperature):
    from realexec.worker.sampler import Sampler

    eos, stop_id, vocab = 2, 7, 16
    logits = torch.full((3, vocab), -5.0)
    logits[:, eos] = 10.0                       # EOS is by far the best token ...
    logits[:, stop_id] = 9.0                    # ... then the stop token ...
    logits[:, 4] = 8.0                          # ... then an ordinary one
    p = SamplingParams(temperature=temperature, max_tokens=30, min_tokens=3, stop_token_ids=[stop_id],
                       logprobs=2)
    rows = _rows([(4, 0, p, eos), (4, 2, p, eos), (4, 3, p, eos)])   # 0, 2, 3 outputs so far
    for _ in range(5):
        out = Sampler(seed=1)(logits.clone(), rows)
        got = [out.token_ids[r.seq_id][0] for r in rows]
        assert got[0] == got[1] == 4            # below min_tokens: EOS and stop ids are masked
        if temperature == 0.0:
            assert got[2] == eos                # min_tokens reached: EOS allowed again
    # with ignore_eos, EOS is no stop token, so min_tokens leaves it alone (only stop ids are masked)
    q = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True)
    out = Sampler()(logits.clone(), _rows([(4, 0, q, eos)]))
    assert list(out.token_ids.values()) == [[eos]]


def test_smollm2_min_tokens_never_emits_eos_early(smol):
    eos = smol.tokenizer.eos_token_id
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    base = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert base.finish_reason == "stop" and len(base.token_ids) < 28    # the model wants to stop early
    out = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=28))[0].outputs[0]
    assert eos not in out.token_ids[:28], out.token_ids
    assert out.token_ids[:len(base.token_ids) - 1] == base.token_ids[:-1]  # same text up to where EOS was
    assert len(out.token_ids) >= 28


def test_beam_search_refuses_stop_strings(plain):
    # Beams are detokenized only at the end, so stop strings would be silently ignored: refuse.
    with pytest.raises(InvalidRequestError, match="not supported with beam search") as err:
        plain.generate(PROMPTS[0], SamplingParams(beam_width=2, max_tokens=4, stop=["x"]))
    assert err.value.param == "stop"
    assert not plain.engine.has_unfinished_requests()
    (out,) = plain.generate(PROMPTS[0], SamplingParams(beam_width=2, max_tokens=4, stop_token_ids=[7]))
    assert len(out.outputs) == 2                 # stop token ids are fine: the core checks them per beam


def test_invalid_request_names_the_parameter(plain):
    for kwargs, param in [(dict(n=0), "n"), (dict(temperature=float("inf")), "temperature"),
                          (dict(seed=2**64), "seed"), (dict(cache_salt=""), "cache_salt")]:
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**kwargs)
        assert err.value.param == param
    with pytest.raises(InvalidRequestError) as err:
        plain.generate([10**6], SamplingParams())
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        plain.generate([5], SamplingParams(stop_token_ids=[256]))
    assert err.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError) as err:           # n=600 sequences > max_num_seqs 256
        plain.generate(PROMPTS[0], SamplingParams(n=600))
    assert err.value.param == "n" and "req-" not in str(err.value)


# ----------------------------------------------------------------------------- issue 26

def test_temperature_below_epsilon_is_greedy(plain, reference):
    """Defect: a temperature that underflows float32 (1e-40) gave inf logits, NaN
    probabilities and only token 0. Below SAMPLING_EPS the sampler takes the argmax, seeded
    or not, for every sample; at it, it samples."""
    def outputs(temperature, seed=None, n=1):
        params = SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=32, ignore_eos=True)
        return [c.token_ids for c in plain.generate(PROMPTS[0], params)[0].outputs]

    assert outputs(1e-40) == [reference[0]]
    assert outputs(1e-40, seed=3, n=2) == [reference[0]] * 2
    from core.sampling_params import SAMPLING_EPS
    assert outputs(SAMPLING_EPS / 2, seed=3) == [reference[0]]
    assert SamplingParams(temperature=SAMPLING_EPS / 2).is_greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).is_greedy


def test_reused_request_id_samples_with_its_own_params(plain):
    """Defect (every executor): a request reusing a finished request's id was sampled with
    the old request's params, because its arrival reached the workers before the old one's
    departure. Seeded sampling under a fresh id, greedy under "a", then the seeded request
    again under "a": the third output is the first, not the greedy one."""
    engine = plain.engine
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(max_tokens=16, **GREEDY)

    def run(params, request_id):
        engine.add_request(PROMPTS[1], params, request_id=request_id)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id and out.finished:
                    final = out.outputs[0].token_ids
        return final

    first = run(seeded, "fresh-seeded")
    greedy_out = run(greedy, "a")
    assert first != greedy_out                        # (else the test could not tell them apart)
    assert run(seeded, "a") == first
