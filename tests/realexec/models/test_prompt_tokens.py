"""prompt_token_ids: the server's prompt tokenization equals the tokenizer's own call.

The fast path encodes with the Rust tokenizer directly; these tests hold it to
`tokenizer(text).input_ids` on SmolLM2's tokenizer for any text (special-token strings,
unicode, whitespace), with a BOS-adding post-processor, and check that it steps aside
when the wrapper would do something else (truncation set on the backend, special tokens
split).
"""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realexec.models.loader import _plain_backend, prompt_token_ids

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"]


@pytest.fixture(scope="module")
def tokenizer():
    from realexec.bench.throughput import model_dir
    from realexec.models.loader import load_tokenizer

    return load_tokenizer(model_dir(None))


@pytest.fixture(scope="module")
def bos_tokenizer():
    """SmolLM2's tokenizer with a post-processor that prepends <|endoftext|> (a BOS), as
    Llama-style tokenizers do."""
    from tokenizers.processors import TemplateProcessing

    from realexec.bench.throughput import model_dir
    from realexec.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir(None))
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    return tok


texts = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(SPECIALS + [" ", "\n\n", "  x", "é", "🙂"])),
                 max_size=8).map("".join)          # all under DIRECT_ENCODE_MAX_CHARS: the fast path


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_the_fast_path_equals_the_tokenizers_call(tokenizer, bos_tokenizer, text):
    assert _plain_backend(tokenizer) is not None and _plain_backend(bos_tokenizer) is not None
    assert prompt_token_ids(tokenizer, text) == list(tokenizer(text).input_ids)
    assert prompt_token_ids(bos_tokenizer, text) == list(bos_tokenizer(text).input_ids)


def test_a_bos_is_kept_and_special_token_strings_are_one_token(bos_tokenizer):
    ids = prompt_token_ids(bos_tokenizer, "<|im_start|>user\nhi<|im_end|>")
    tok = bos_tokenizer
    assert ids[0] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert ids[1] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_a_long_text_is_encoded_without_holding_the_gil(tokenizer):
    """Over DIRECT_ENCODE_MAX_CHARS the wrapper's batch call encodes (it lets other
    threads run, the server's event loop among them): a thread ticking every ms keeps
    ticking while a long prompt is tokenized, and the ids are the wrapper's."""
    from realexec.models.loader import DIRECT_ENCODE_MAX_CHARS

    text = "lorem ipsum dolor sit amet " * 20_000
    assert len(text) > DIRECT_ENCODE_MAX_CHARS
    ticks, stop = [0], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)
    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        t0 = time.monotonic()
        ids = prompt_token_ids(tokenizer, text)
        took = time.monotonic() - t0
    finally:
        stop.set()
        thread.join()
    assert ids == list(tokenizer(text).input_ids) and len(ids) > 100_000
    assert ticks[0] >= 0.3 * took / 0.001, (ticks[0], took)


def test_the_wrappers_call_is_used_when_the_backend_differs(tokenizer):
    """Truncation left on the Rust tokenizer, or special tokens split: the direct call
    would differ from the wrapper's, so the wrapper is called."""
    from realexec.bench.throughput import model_dir
    from realexec.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir(None))
    long = "word " * 50
    tok._tokenizer.enable_truncation(8)
    assert _plain_backend(tok) is None
    assert prompt_token_ids(tok, long) == list(tokenizer(long).input_ids) and len(tokenizer(long).input_ids) > 8
    split = load_tokenizer(model_dir(None))
    split.split_special_tokens = True
    assert _plain_backend(split) is None
    assert prompt_token_ids(split, "<|im_end|>") == list(split("<|im_end|>").input_ids)
    assert len(prompt_token_ids(split, "<|im_end|>")) > 1
