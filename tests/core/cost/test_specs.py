"""The simulator's specs against the HF configs they cite.

Each new family's published config.json values are written below (no hub access);
transformers' own config class turns them into a config, and the model it builds on the
meta device (no memory) gives the reference parameter count. KV bytes come from the same
config: per layer 2 * kv_heads * head_dim * 2 bytes per token, capped at sliding_window
for the layers config.layer_types marks "sliding_attention".
"""

import pytest

from core.cost.specs import MODELS, ModelSpec, get_model

# The reference counts come from transformers itself (installed by `make setup`): a missing
# install fails here instead of skipping the comparison.
import torch  # noqa: E402
import transformers  # noqa: E402

_QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False, head_dim=128)
_GEMMA2 = dict(vocab_size=256000, max_position_embeddings=8192, sliding_window=4096, tie_word_embeddings=True)
_MISTRAL = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=32768, tie_word_embeddings=False)

# spec name -> (transformers config class, the repo's config.json fields)
HF_CONFIGS = {
    "Qwen3-8B": ("Qwen3Config", dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8)),
    "Qwen3-32B": ("Qwen3Config", dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                      num_attention_heads=64, num_key_value_heads=8)),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", dict(_QWEN3, hidden_size=2048, intermediate_size=6144,
                                             moe_intermediate_size=768, num_hidden_layers=48,
                                             num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                                             num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[])),
    "Gemma-2-9B": ("Gemma2Config", dict(_GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=256)),
    "Gemma-2-27B": ("Gemma2Config", dict(_GEMMA2, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                                         num_attention_heads=32, num_key_value_heads=16, head_dim=128)),
    "Phi-3-mini-4k": ("Phi3Config", dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                         max_position_embeddings=4096, sliding_window=2047,
                                         tie_word_embeddings=False)),
    "Mistral-7B-v0.1": ("MistralConfig", dict(_MISTRAL, vocab_size=32000, sliding_window=4096)),
    "Mistral-7B-v0.3": ("MistralConfig", dict(_MISTRAL, vocab_size=32768, sliding_window=None)),
    "Mixtral-8x7B": ("MixtralConfig", dict(_MISTRAL, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                                           sliding_window=None)),
}


def hf_config(name: str):
    cls, fields = HF_CONFIGS[name]
    return getattr(transformers, cls)(**fields)


def hf_num_params(cfg) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    # parameters() lists a tied weight once: the published count
    return sum(p.numel() for p in model.parameters())


def hf_kv_bytes(cfg, num_tokens: int, dtype_bytes: int = 2) -> int:
    """KV of one sequence, from the config alone."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_layer_token = 2 * cfg.num_key_value_heads * head_dim * dtype_bytes
    window = getattr(cfg, "sliding_window", None)
    # Gemma 2, Qwen3 carry layer_types; Mistral and Phi-3 window every layer when one is set
    types = getattr(cfg, "layer_types", None) or (
        ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers)
    assert len(types) == cfg.num_hidden_layers
    return sum(per_layer_token * (min(num_tokens, window) if t == "sliding_attention" else num_tokens)
               for t in types)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_param_count_equals_the_hf_model(name):
    spec, cfg = get_model(name), hf_config(name)
    assert spec.num_params() == hf_num_params(cfg)
    assert spec.hf_id and get_model(spec.hf_id) is spec
    assert spec.max_model_len == cfg.max_position_embeddings
    assert spec.vocab_size == cfg.vocab_size


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_kv_bytes_equal_the_hf_config(name):
    spec, cfg = get_model(name), hf_config(name)
    assert spec.kv_bytes_per_token() == hf_kv_bytes(cfg, 1)
    # below, at and past the window (where the config has one), and a full context
    for n in (0, 1, 17, 2047, 2048, 4096, 4097, 10_000, spec.max_model_len):
        assert spec.kv_bytes(n) == hf_kv_bytes(cfg, n), (name, n)


def test_gemma2_local_layers_stop_growing_at_the_window():
    g = get_model("Gemma-2-9B")
    per_layer_token = 2 * 8 * 256 * 2
    assert g.kv_bytes(8192) - g.kv_bytes(4096) == 21 * 4096 * per_layer_token  # only the 21 global layers
    assert g.kv_bytes(4096) == 4096 * g.kv_bytes_per_token()


def test_moe_active_params_count_top_k_experts():
    """Qwen3-30B-A3B: 30.5B in memory, 3.3B per token (the model card's figures);
    Mixtral-8x7B: 46.7B and 12.9B."""
    for name, total, active in [("Qwen3-30B-A3B", 30.5, 3.3), ("Mixtral-8x7B", 46.7, 12.9)]:
        spec = get_model(name)
        assert spec.num_params() / 1e9 == pytest.approx(total, abs=0.05)
        assert spec.num_active_params() / 1e9 == pytest.approx(active, abs=0.06)
    dense = get_model("Qwen3-8B")
    assert dense.num_active_params() == dense.num_params()


def test_expected_experts_touched():
    q = get_model("Qwen3-30B-A3B")  # E=128, k=8
    assert q.expected_experts_touched(0) == 0.0
    assert q.expected_experts_touched(1) == pytest.approx(8)           # one token: its k experts
    assert q.expected_experts_touched(2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert q.expected_experts_touched(4096) == pytest.approx(128)      # a big batch touches them all
    touched = [q.expected_experts_touched(b) for b in (1, 2, 8, 32, 128)]
    assert touched == sorted(touched) and touched[-1] < 128
    assert get_model("Llama-2-7B").expected_experts_touched(64) == 0.0


def test_existing_specs_do_not_move():
    """The dense specs from before the families were added: their counts are pinned."""
    expected = {"OPT-13B": 12_853_473_280, "Llama-2-7B": 6_738_415_616, "Llama-2-70B": 68_976_648_192,
                "Llama-3-8B": 8_030_261_248, "SmolLM2-135M": 134_515_008}
    assert {n: MODELS[n].num_params() for n in expected} == expected


@pytest.mark.parametrize("bad, match", [
    (dict(sliding_window=4096), "needs num_sliding_layers"),
    (dict(sliding_window=4096, num_sliding_layers=3), "at most num_layers"),
    (dict(num_experts=8), r"num_experts_per_tok=0 must be in \[1, num_experts=8\]"),
    (dict(num_experts=8, num_experts_per_tok=9), "must be in"),
    (dict(num_experts=8, num_experts_per_tok=2, gated_mlp=False), "gated MLPs"),
])
def test_inconsistent_specs_are_refused(bad, match):
    base = dict(name="toy", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4,
                intermediate_size=16, vocab_size=10, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        ModelSpec(**base, **bad)


def test_kv_bytes_rejects_negative_lengths():
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        get_model("Gemma-2-9B").kv_bytes(-1)
