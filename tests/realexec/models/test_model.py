"""The model layer of the real executor: torch paged attention, Llama-family model, loader.

Everything is checked against transformers (the reference implementation) on CPU fp32:
tiny random Llama / Qwen2 / Mistral checkpoints, a tiny GGUF, and the real SmolLM2-135M.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from realexec.attention import AttentionMetadata, get_attention_backend
from realexec.attention.torch_backend import TorchAttentionBackend
from realexec.models.loader import embedded_model_path, load_model
from realexec.models import ModelConfig

ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- helpers

def make_metadata(seqs, block_size: int) -> AttentionMetadata:
    """seqs: list of (block_table, context_len, query_len); a table of None is a padding
    row (seq_len 0, slots -1)."""
    slots, qlens, slens = [], [], []
    width = max(len(t) for t, _, _ in seqs if t is not None)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (table, ctx, qlen) in enumerate(seqs):
        qlens.append(qlen)
        if table is None:
            slots += [-1] * qlen
            slens.append(0)
            continue
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + qlen)]
        slens.append(ctx + qlen)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + list(np.cumsum(qlens)), dtype=torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=tables, block_size=block_size,
        max_query_len=max(qlens), max_seq_len=max(slens),
        query_lens_cpu=qlens, seq_lens_cpu=slens)


class PagedKV:
    """Test-side stand-in for the block manager: per-layer caches plus per-sequence block
    tables drawn from a shuffled free list, so tables are non-contiguous."""

    def __init__(self, cfg, num_blocks: int, block_size: int, seed: int = 0, dtype=torch.float32):
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in range(cfg.num_hidden_layers)]
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}

    def table(self, seq: str, num_tokens: int) -> list[int]:
        t = self.tables.setdefault(seq, [])
        while len(t) * self.block_size < num_tokens:
            t.append(self.free.pop())
        return t

    def share_prefix(self, seq: str, source: str, num_blocks: int) -> None:
        """A prefix-cache hit: `seq` starts with `source`'s first full blocks."""
        self.tables[seq] = list(self.tables[source][:num_blocks])


@torch.no_grad()
def run_step(model, kv: PagedKV, batch) -> list[torch.Tensor]:
    """One forward over a flat batch; batch: list of (seq, new token ids, cached tokens).
    Returns each sequence's logits for its new tokens."""
    seqs, ids, pos = [], [], []
    for seq, toks, ctx in batch:
        seqs.append((kv.table(seq, ctx + len(toks)), ctx, len(toks)))
        ids += toks
        pos += range(ctx, ctx + len(toks))
    md = make_metadata(seqs, kv.block_size)
    hidden = model(torch.tensor(ids), torch.tensor(pos), kv.caches, md)
    return list(model.compute_logits(hidden).split([len(t) for _, t, _ in batch]))


@torch.no_grad()
def hf_logits(hf_model, tokens) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def greedy_generate(model, kv: PagedKV, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Batched greedy decoding over the paged cache (no EOS stop): prefill all prompts in
    one step, then one decode step per token for the whole batch."""
    names = [f"g{i}" for i in range(len(prompts))]
    last = run_step(model, kv, [(n, p, 0) for n, p in zip(names, prompts)])
    out = [[int(l[-1].argmax())] for l in last]
    for step in range(1, max_new_tokens):
        batch = [(n, [o[-1]], len(p) + step - 1) for n, p, o in zip(names, prompts, out)]
        for o, l in zip(out, run_step(model, kv, batch)):
            o.append(int(l[-1].argmax()))
    return out


# ----------------------------------------------------------------------------- (d) backend

def dense_reference(q, k_all, v_all, context_len, scale):
    """Naive attention for one sequence: q [Lq, Hq, D] at positions context_len.., keys
    k_all/v_all [Lk, Hkv, D] at positions 0..Lk-1."""
    group = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1)
    v = v_all.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("decode_only", [False, True])
def test_torch_backend_matches_dense(block_size, group, decode_only):
    gen = torch.Generator().manual_seed(block_size * 10 + group)
    kv_heads, head_dim, num_blocks = 2, 16, 64
    heads = kv_heads * group
    B = block_size
    # (context_len, query_len): lengths 1, a block, a block+1, decodes, a chunk after a prefix.
    cases = ([(0, 1), (B - 1, 1), (B, 1), (2 * B + 3, 1)] if decode_only else
             [(0, 1), (0, B), (0, B + 1), (B - 1, 1), (2 * B, 1), (5, B + 2), (B, B)])
    free = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, B, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, B, kv_heads, head_dim, generator=gen)
    seqs, full_k, full_v = [], [], []
    for ctx, qlen in cases:
        table = [free.pop() for _ in range(math.ceil((ctx + qlen) / B))]
        seqs.append((table, ctx, qlen))
        # The cached context is whatever already sits in the cache at the table's slots.
        flat = torch.tensor([table[p // B] * B + p % B for p in range(ctx)], dtype=torch.long)
        full_k.append(k_cache.view(-1, kv_heads, head_dim)[flat])
        full_v.append(v_cache.view(-1, kv_heads, head_dim)[flat])
    seqs.append((None, 0, 1 if decode_only else 0))          # a padding row
    md = make_metadata(seqs, B)
    T = md.slot_mapping.shape[0]
    q = torch.randn(T, heads, head_dim, generator=gen)
    k = torch.randn(T, kv_heads, head_dim, generator=gen)
    v = torch.randn(T, kv_heads, head_dim, generator=gen)
    untouched = k_cache.clone()

    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, md, scale=head_dim ** -0.5)

    start = 0
    for i, (ctx, qlen) in enumerate(cases):
        rows = slice(start, start + qlen)
        ref = dense_reference(q[rows], torch.cat([full_k[i], k[rows]]), torch.cat([full_v[i], v[rows]]),
                              ctx, head_dim ** -0.5)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)
        start += qlen
    # New K rows landed at their slots; nothing else in the cache changed (slot -1 skipped).
    written = md.slot_mapping >= 0
    flat = k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[md.slot_mapping[written]], k[written])
    mask = torch.ones(flat.shape[0], dtype=torch.bool)
    mask[md.slot_mapping[written]] = False
    assert torch.equal(flat[mask], untouched.view(-1, kv_heads, head_dim)[mask])
    assert torch.isfinite(out).all()


def test_backend_factory():
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)
    with pytest.raises(ValueError):
        get_attention_backend("nope")


# ----------------------------------------------------------------------------- tiny HF models

def tiny_hf_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  # larger than the default 0.02 so attention is far from uniform and a
                  # position/rotary mistake shows in the logits
                  initializer_range=0.15)
    if kind == "llama":        # untied head, Llama 3.1 rope scaling
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if kind == "qwen2":        # q/k/v biases, tied embeddings
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(kind)


@pytest.fixture(scope="module", params=[(kind, backend) for backend in ("torch", "cpu")
                                        for kind in ("llama", "qwen2", "mistral")],
                ids=lambda p: "-".join(p))
def tiny(request, tmp_path_factory):
    """(our model, HF model) from the same random checkpoint saved as safetensors; ours
    runs attention with the torch reference or the batched CPU kernel."""
    from transformers import AutoModelForCausalLM

    kind, backend = request.param
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_hf_config(kind), dtype=torch.float32).eval()
    if kind == "qwen2":   # HF initializes biases to zero; make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(f"tiny-{kind}")
    hf.save_pretrained(path, safe_serialization=True)
    ours, cfg, tok = load_model(path, dtype=torch.float32, attn_backend=backend)
    assert ours.layers[0].self_attn.backend.name == backend
    assert tok is None and cfg.architecture == type(hf).__name__
    return ours, hf


def random_prompts(n, lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for length in lengths[:n]]


def test_tiny_prefill_batch_matches_hf(tiny):
    ours, hf = tiny
    prompts = random_prompts(3, [5, 8, 13])
    kv = PagedKV(ours.config, num_blocks=32, block_size=4)
    got = run_step(ours, kv, [(f"p{i}", p, 0) for i, p in enumerate(prompts)])
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)


def test_tiny_incremental_matches_full_prefill(tiny):
    """Decode steps, chunked prefill (mixed with decodes) and a prefix-cache hit all give
    the logits of one full prefill at the same positions."""
    ours, hf = tiny
    B = 4
    a, b = random_prompts(2, [14, 15], seed=2)
    c = a[:2 * B] + random_prompts(1, [6], seed=3)[0]          # shares a's first two blocks
    ref_a, ref_b, ref_c = (hf_logits(hf, s) for s in (a, b, c))
    kv = PagedKV(ours.config, num_blocks=48, block_size=B, seed=5)

    # step 1: a's first 9 tokens + b's first chunk; step 2: a decodes while b's 2nd chunk runs
    la, lb = run_step(ours, kv, [("a", a[:9], 0), ("b", b[:5], 0)])
    torch.testing.assert_close(la, ref_a[:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[:5], atol=ATOL, rtol=0)
    la, lb = run_step(ours, kv, [("a", a[9:10], 9), ("b", b[5:11], 5)])
    torch.testing.assert_close(la, ref_a[9:10], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[5:11], atol=ATOL, rtol=0)
    # step 3: b's last chunk + a decode; then decode-only steps for both
    lb, la = run_step(ours, kv, [("b", b[11:], 11), ("a", a[10:11], 10)])
    torch.testing.assert_close(lb, ref_b[11:], atol=ATOL, rtol=0)
    torch.testing.assert_close(la, ref_a[10:11], atol=ATOL, rtol=0)
    for pos in range(11, 14):
        (la,) = run_step(ours, kv, [("a", a[pos:pos + 1], pos)])
        torch.testing.assert_close(la, ref_a[pos:pos + 1], atol=ATOL, rtol=0)

    # prefix hit: c reuses a's first two (full) blocks and computes only its suffix
    kv.share_prefix("c", "a", 2)
    (lc,) = run_step(ours, kv, [("c", c[2 * B:], 2 * B)])
    torch.testing.assert_close(lc, ref_c[2 * B:], atol=ATOL, rtol=0)


def test_tiny_no_cache_prefill(tiny):
    """kv_caches=None (a profiling run before the cache exists) still computes prompts."""
    ours, hf = tiny
    prompts = random_prompts(2, [3, 7])
    md = make_metadata([([0, 1], 0, len(p)) for p in prompts], 4)
    md.slot_mapping.fill_(-1)
    with torch.no_grad():
        h = ours(torch.tensor(sum(prompts, [])), torch.tensor([i for p in prompts for i in range(len(p))]), None, md)
        got = ours.compute_logits(h).split([3, 7])
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)


def test_tiny_bf16_close_to_fp32(tiny, tmp_path):
    """Half precision end to end (weights, activations, KV cache) stays near fp32."""
    ours, hf = tiny
    hf.save_pretrained(tmp_path, safe_serialization=True)
    half, _, _ = load_model(tmp_path, dtype=torch.bfloat16)
    prompt = random_prompts(1, [9])[0]
    (ref,) = run_step(ours, PagedKV(ours.config, 8, 4), [("x", prompt, 0)])
    (got,) = run_step(half, PagedKV(ours.config, 8, 4, dtype=torch.bfloat16), [("x", prompt, 0)])
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_model_config_reads_both_hf_layouts():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    old = ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                               "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "bfloat16",
                               "eos_token_id": [7, 9]})
    new = ModelConfig.from_hf({**base, "model_type": "qwen2", "dtype": "float16",
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (old.rope_theta, old.rope_scaling, old.torch_dtype, old.eos_token_ids, old.num_key_value_heads,
            old.head_dim) == (5e5, {"rope_type": "linear", "factor": 2.0}, torch.bfloat16, (7, 9), 2, 4)
    assert (new.architecture, new.rope_theta, new.rope_scaling, new.torch_dtype, new.attention_bias,
            new.o_proj_bias) == ("Qwen2ForCausalLM", 1e6, None, torch.float16, True, False)


# ----------------------------------------------------------------------------- tiny GGUF

def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, written out here as the forward transform
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_tiny_gguf_roundtrip_and_cache(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    import realexec.models.loader as loader

    torch.manual_seed(0)
    cfg = tiny_hf_config("mistral")
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        a = t.numpy().copy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.q_proj":
                a = _permute_like_llama_cpp(a, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = _permute_like_llama_cpp(a, cfg.num_key_value_heads)
            gname = f"blk.{layer}.{names[module]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cache = tmp_path / "cache"
    ours, _, tok = load_model(path, cache_dir=cache)
    assert tok is None
    prompt = random_prompts(1, [11])[0]
    kv = PagedKV(ours.config, 8, 4)
    (got,) = run_step(ours, kv, [("x", prompt, 0)])
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)

    # Second load: straight from the conversion cache, no GGUF conversion.
    def no_conversion(*args):
        raise AssertionError("GGUF converted twice")
    monkeypatch.setattr(loader, "_write_hf_dir_from_gguf", no_conversion)
    again, _, _ = load_model(path, cache_dir=cache)
    assert len(list(cache.iterdir())) == 1
    assert torch.equal(again.layers[0].self_attn.qkv_proj.weight, ours.layers[0].self_attn.qkv_proj.weight)


# ----------------------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smollm2():
    """Our SmolLM2 (via the conversion cache) and transformers' own load of the same GGUF."""
    from transformers import AutoModelForCausalLM

    gguf_path = embedded_model_path()
    ours, cfg, tok = load_model(None, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval()
    return ours, cfg, tok, hf


def chat_ids(tok, text: str) -> list[int]:
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(prompt, add_special_tokens=False).input_ids


def test_smollm2_config_and_tokenizer(smollm2):
    _, cfg, tok, _ = smollm2
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(cfg.eos_token_id) == "<|im_end|>"


@pytest.fixture(params=["torch", "cpu"])
def attention(request, smollm2):
    """Run the SmolLM2 model's attention with the torch reference or the CPU kernel."""
    ours = smollm2[0]
    saved = ours.layers[0].self_attn.backend
    backend = get_attention_backend(request.param)
    for layer in ours.layers:
        layer.self_attn.backend = backend
    yield request.param
    for layer in ours.layers:
        layer.self_attn.backend = saved


def test_smollm2_logits_match_hf(smollm2, attention):
    ours, _, tok, hf = smollm2
    ids = chat_ids(tok, "What is the capital of France?")
    kv = PagedKV(ours.config, num_blocks=16, block_size=16)
    (got,) = run_step(ours, kv, [("x", ids, 0)])
    # fp32 through 30 layers: ~6e-5 worst abs error on logits of magnitude ~40.
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=1e-5)


def test_smollm2_greedy_matches_hf_generate(smollm2, attention):
    ours, cfg, tok, hf = smollm2
    prompts = [chat_ids(tok, q) for q in ("Write a short poem about the sea.",
                                          "Explain what a hash table is.")]
    kv = PagedKV(ours.config, num_blocks=64, block_size=16, seed=7)
    got = greedy_generate(ours, kv, prompts, max_new_tokens=32)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        # HF stops after EOS; our loop does not.
        assert g[:len(ref)] == ref, (tok.decode(g), tok.decode(ref))
