"""Raw ShareGPT JSON (a list of ``{"id", "conversations": [{"from", "value"}, ...]}``).

The request of a conversation is its first exchange: the first human turn is the
prompt, the gpt turn right after it is the output (conversations without such a pair
are skipped). The file is read element by element, so a file cut mid-record (as the
packaged ShareGPT_V3 file is) yields its complete conversations and the broken tail
is ignored; a malformed record inside a complete file is an error.

Lengths come from a tokenizer when one is given (anything with ``encode(text)`` that
returns ids or an object with ``.ids``, optionally ``encode_batch(texts)``, or a
function text -> ids); otherwise from the approximation ``ceil(len(text) / 4)``
(4 characters per token; on ShareGPT it over-counts SmolLM2 prompt tokens by ~12% at
the median). The trace's ``source`` says which was used.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .model import GZIP_ERRORS, Trace, TraceError, TraceRequest, finalize, open_text, where

# vLLM's benchmark filter (benchmarks/datasets: sample_sharegpt_requests).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

_CHUNK = 1 << 20
_SPACE = re.compile(r"\s*")


class JsonArrayReader:
    """Iterate over ``(line, element)`` of a top-level JSON array, reading the file in
    chunks. If the file ends inside the array (no closing ``]``), iteration stops after
    the last complete element and ``broken_tail_line`` tells where the rest began."""

    def __init__(self, path: str | Path):
        self.path = path
        self.broken_tail_line: int | None = None

    def __iter__(self) -> Iterator[tuple[int, object]]:
        with open_text(self.path) as f:
            try:
                yield from self._elements(f)
            except UnicodeDecodeError:
                raise TraceError(f"{self.path}: not UTF-8 text") from None
            except GZIP_ERRORS as e:
                raise TraceError(f"{self.path}: damaged gzip data: {e}") from None

    def _elements(self, f) -> Iterator[tuple[int, object]]:
        decoder = json.JSONDecoder()
        buf, pos, line, eof = "", 0, 1, False  # line: line number at buf[pos]

        def advance(to: int) -> None:
            nonlocal pos, line
            line += buf.count("\n", pos, to)
            pos = to

        def read_more() -> bool:  # append a chunk at least as big as what is kept: linear time
            nonlocal buf, pos, eof
            chunk = "" if eof else f.read(max(_CHUNK, len(buf) - pos))
            if not chunk:
                eof = True
                return False
            buf, pos = buf[pos:] + chunk, 0
            return True

        def next_char() -> str:  # the next non-space character ('' at end of file), not consumed
            while True:
                advance(_SPACE.match(buf, pos).end())
                if pos < len(buf) or not read_more():
                    return buf[pos:pos + 1]

        first = next_char()
        if first == "":
            raise TraceError(f"{self.path}: empty file")
        if first != "[":
            raise TraceError(f"{where(self.path, line)}: expected a JSON array ('['), got {first!r}")
        advance(pos + 1)
        if next_char() == "]":
            return
        while True:
            start_line = line
            try:
                element, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if read_more():
                    continue
                if buf.rstrip().endswith("]"):  # the file is complete: a real syntax error
                    error_line = line + buf.count("\n", pos, e.pos)
                    raise TraceError(f"{where(self.path, error_line)}: not JSON ({e.msg})") from None
                self.broken_tail_line = start_line
                return
            if end == len(buf) and read_more():  # a number could go on in the next chunk
                continue
            advance(end)
            yield start_line, element
            c = next_char()
            if c == "]":
                return
            if c == "":
                self.broken_tail_line = line
                return
            if c != ",":
                raise TraceError(f"{where(self.path, line)}: expected ',' or ']' after an array element, got {c!r}")
            advance(pos + 1)
            next_char()


def first_exchange(conversation: object, at: str) -> tuple[str, str] | None:
    """(first human turn, the gpt turn right after it), or None if there is none."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
            for t in turns):
        raise TraceError(f"{at}: expected {{'conversations': [{{'from': str, 'value': str}}, ...]}}")
    for i, turn in enumerate(turns):
        if turn["from"] == "human":
            if i + 1 < len(turns) and turns[i + 1]["from"] == "gpt":
                return turn["value"], turns[i + 1]["value"]
            return None
    return None


def approx_token_count(text: str) -> int:
    """The documented fallback when no tokenizer is given: 4 characters per token."""
    return math.ceil(len(text) / 4)


def token_counter(tokenizer) -> tuple[Callable[[Sequence[str]], list[int]], str]:
    """(texts -> token counts, description for provenance) for a tokenizer or None."""
    if tokenizer is None:
        return (lambda texts: [approx_token_count(t) for t in texts]), "approximate lengths ceil(chars/4), no tokenizer"
    name = getattr(tokenizer, "name_or_path", None) or getattr(tokenizer, "__name__", None) or type(tokenizer).__name__

    def ids(result) -> Sequence[int]:
        return getattr(result, "ids", result)

    if hasattr(tokenizer, "encode_batch"):
        return (lambda texts: [len(ids(r)) for r in tokenizer.encode_batch(list(texts))]), f"tokenizer {name}"
    encode = tokenizer.encode if hasattr(tokenizer, "encode") else tokenizer
    return (lambda texts: [len(ids(encode(t))) for t in texts]), f"tokenizer {name}"


@dataclass
class ShareGPTScan:
    """Counts for provenance: what was read and what was kept."""
    conversations: int = 0  # complete conversations parsed
    with_exchange: int = 0  # ... that have a human -> gpt exchange
    kept: int = 0  # ... whose lengths pass the filter
    broken_tail_line: int | None = None
    lengths: str = ""  # how lengths were counted

    def describe(self, path: str | Path) -> str:
        tail = "" if self.broken_tail_line is None else \
            f"; the file is truncated: the broken record from line {self.broken_tail_line} on is ignored"
        return (f"read {self.conversations} complete conversations from {path}{tail}; {self.with_exchange} have a "
                f"human->gpt exchange; {self.kept} pass the length filter; {self.lengths}")


def sharegpt_requests(path: str | Path, tokenizer=None, *, limit: int | None = None, min_len: int = MIN_LEN,
                      max_prompt_len: int | None = MAX_PROMPT_LEN, max_total_len: int | None = MAX_TOTAL_LEN,
                      ) -> tuple[list[TraceRequest], ShareGPTScan]:
    """Requests (arrival 0, id ``sharegpt-<index of the conversation in the file>``) of
    the first ``limit`` conversations that pass the filter
    ``min_len <= prompt_len``, ``min_len <= output_len``, ``prompt_len <= max_prompt_len``,
    ``prompt_len + output_len <= max_total_len`` (None: no upper bound)."""
    count_tokens, lengths = token_counter(tokenizer)
    scan = ShareGPTScan(lengths=lengths)
    reader = JsonArrayReader(path)
    candidates: list[tuple[int, str, str]] = []
    requests: list[TraceRequest] = []

    def flush() -> None:  # tokenize the pending exchanges in one batch and filter them
        prompt_lens = count_tokens([p for _, p, _ in candidates])
        output_lens = count_tokens([o for _, _, o in candidates])
        for (index, prompt, _), p_len, o_len in zip(candidates, prompt_lens, output_lens):
            if (p_len >= min_len and o_len >= min_len
                    and (max_prompt_len is None or p_len <= max_prompt_len)
                    and (max_total_len is None or p_len + o_len <= max_total_len)
                    and (limit is None or len(requests) < limit)):
                requests.append(TraceRequest(f"sharegpt-{index:05d}", 0.0, p_len, o_len, prompt=prompt))
        candidates.clear()

    for index, (line, conversation) in enumerate(reader):
        scan.conversations += 1
        exchange = first_exchange(conversation, where(path, line, record=index))
        if exchange is not None:
            scan.with_exchange += 1
            candidates.append((index, *exchange))
        if len(candidates) >= 1024 or (limit is not None and len(candidates) >= limit - len(requests)):
            flush()
            if limit is not None and len(requests) >= limit:
                break
    flush()
    scan.kept = len(requests)
    scan.broken_tail_line = reader.broken_tail_line
    return requests, scan


def describe_filter(min_len: int, max_prompt_len: int | None, max_total_len: int | None) -> str:
    parts = [f"prompt_len >= {min_len}", f"output_len >= {min_len}"]
    if max_prompt_len is not None:
        parts.append(f"prompt_len <= {max_prompt_len}")
    if max_total_len is not None:
        parts.append(f"prompt_len + output_len <= {max_total_len}")
    return "filter " + ", ".join(parts)


def load_sharegpt(path: str | Path, *, limit: int | None = None, tokenizer=None, min_len: int = MIN_LEN,
                  max_prompt_len: int | None = MAX_PROMPT_LEN, max_total_len: int | None = MAX_TOTAL_LEN) -> Trace:
    """Raw ShareGPT JSON -> a trace of the first exchanges passing vLLM's length filter,
    in file order, all arriving at 0 (re-time with ``rate=`` to spread them)."""
    requests, scan = sharegpt_requests(path, tokenizer, limit=limit, min_len=min_len,
                                       max_prompt_len=max_prompt_len, max_total_len=max_total_len)
    source = (f"sharegpt: prompt = first human turn, output = the gpt turn after it; {scan.describe(path)}; "
              f"{describe_filter(min_len, max_prompt_len, max_total_len)}; all arrivals at 0")
    return finalize(requests, source if limit is None else f"{source}; first {limit} requests kept")
