"""twinserve's own trace file: JSON, one request per line for readable diffs.

    {"format": "twinserve-trace", "version": 1, "source": "...", "build_command": "...", "requests": [
    {"id": "sharegpt-00042", "arrival_time": 0.25, "prompt_len": 12, "output_len": 40, "prompt": "..."},
    ...
    ]}

Optional per request: ``prompt`` (text), ``prompt_token_ids`` (list of ids) or
``prompt_blocks`` (Mooncake-style hashed blocks: ``{"hash_ids", "block_size",
"vocab_size", "seed"}``, expanded lazily by ``traces.mooncake.HashedBlockTokens``).
``build_command`` is optional.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from .model import Trace, TraceError, TraceRequest, finalize, parse_float, parse_length, read_text, where
from .mooncake import HashedBlockTokens, parse_hash_ids

FORMAT_NAME = "twinserve-trace"
VERSION = 1


def _request_json(r: TraceRequest) -> str:
    record: dict = {"id": r.request_id, "arrival_time": r.arrival_time,
                    "prompt_len": r.prompt_len, "output_len": r.output_len}
    if isinstance(r.prompt_token_ids, HashedBlockTokens):
        record["prompt_blocks"] = r.prompt_token_ids.spec()
    elif r.prompt_token_ids is not None:
        record["prompt_token_ids"] = list(r.prompt_token_ids)
    if r.prompt is not None:
        record["prompt"] = r.prompt
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: only \u escapes can carry them
        line = json.dumps(record)
    return line


def dumps_trace(trace: Trace, build_command: str | None = None) -> str:
    header: dict = {"format": FORMAT_NAME, "version": VERSION, "source": trace.source}
    if build_command is not None:
        header["build_command"] = build_command
    opening = json.dumps(header, ensure_ascii=False)[:-1] + ', "requests": ['
    return "\n".join([opening, ",\n".join(map(_request_json, trace.requests)), "]}"]) + "\n"


def save_trace(trace: Trace, path: str | Path, build_command: str | None = None) -> None:
    """Write ``trace`` as twinserve JSON (UTF-8, '\\n' line ends: byte-reproducible);
    gzip-compressed when the name ends in '.gz' (no name or time in the gzip header,
    so that stays byte-reproducible too)."""
    data = dumps_trace(trace, build_command).encode("utf-8")
    if str(path).lower().endswith(".gz"):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    with open(path, "wb") as f:
        f.write(data)


def _token_ids(record: dict, prompt_len: int, at: str):
    if "prompt_token_ids" in record and record["prompt_token_ids"] is not None:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise TraceError(f"{at}: prompt_token_ids: expected a list of non-negative integers")
        if len(ids) != prompt_len:
            raise TraceError(f"{at}: {len(ids)} prompt_token_ids but prompt_len {prompt_len}")
        return ids
    if "prompt_blocks" in record and record["prompt_blocks"] is not None:
        spec = record["prompt_blocks"]
        if not isinstance(spec, dict) or set(spec) != {"hash_ids", "block_size", "vocab_size", "seed"}:
            raise TraceError(f"{at}: prompt_blocks: expected {{'hash_ids', 'block_size', 'vocab_size', 'seed'}}")
        sizes = [parse_length(spec[k], f"prompt_blocks.{k}", at) for k in ("block_size", "vocab_size", "seed")]
        try:
            return HashedBlockTokens(parse_hash_ids(spec["hash_ids"], at), prompt_len, *sizes)
        except (ValueError, ZeroDivisionError) as e:
            raise TraceError(f"{at}: prompt_blocks: {e}") from None
    return None


def load_twinserve(path: str | Path, *, limit: int | None = None) -> Trace:
    """A twinserve trace JSON file (see the module doc)."""
    try:
        doc = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise TraceError(f"{where(path, e.lineno)}: not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise TraceError(f"{path}: not a twinserve trace (no \"format\": \"{FORMAT_NAME}\")")
    if doc.get("version") != VERSION:
        raise TraceError(f"{path}: unsupported twinserve trace version {doc.get('version')!r} (expected {VERSION})")
    records = doc.get("requests")
    if not isinstance(records, list):
        raise TraceError(f"{path}: \"requests\" must be a list")
    requests, seen = [], set()
    for i, record in enumerate(records[:limit]):
        at = where(path, record=i)
        if not isinstance(record, dict):
            raise TraceError(f"{at}: expected a JSON object")
        missing = [k for k in ("id", "arrival_time", "prompt_len", "output_len") if k not in record]
        if missing:
            raise TraceError(f"{at}: missing field(s) {', '.join(missing)}")
        request_id = record["id"]
        if not isinstance(request_id, str) or request_id in seen:
            raise TraceError(f"{at}: id must be a unique string, got {request_id!r}")
        seen.add(request_id)
        arrival = parse_float(record["arrival_time"], "arrival_time", at)
        if arrival < 0:
            raise TraceError(f"{at}: arrival_time: negative time {arrival}")
        prompt = record.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise TraceError(f"{at}: prompt must be a string")
        prompt_len = parse_length(record["prompt_len"], "prompt_len", at)
        requests.append(TraceRequest(request_id, arrival, prompt_len,
                                     parse_length(record["output_len"], "output_len", at),
                                     prompt, _token_ids(record, prompt_len, at)))
    source = str(doc.get("source", ""))
    return finalize(requests, source if limit is None else f"{source}; first {limit} requests")
