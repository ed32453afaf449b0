"""The format registry, format detection and ``load_trace``."""
from __future__ import annotations

import csv
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path

from .csv_formats import load_azure, load_burstgpt, load_vidur
from .model import GZIP_ERRORS, Trace, TraceError, logical_suffix, open_text
from .mooncake import load_mooncake
from .retime import retime
from .sharegpt import load_sharegpt
from .twinserve_json import load_twinserve

# name -> loader(path, *, limit=None, **options) -> Trace
LOADERS: dict[str, Callable[..., Trace]] = {
    "twinserve": load_twinserve,
    "sharegpt": load_sharegpt,
    "azure": load_azure,
    "burstgpt": load_burstgpt,
    "mooncake": load_mooncake,
    "vidur": load_vidur,
}

# CSV formats, recognized by their header (case-insensitive)
CSV_COLUMNS = {
    "vidur": {"arrived_at", "num_prefill_tokens", "num_decode_tokens"},
    "azure": {"timestamp", "contexttokens", "generatedtokens"},
    "burstgpt": {"timestamp", "request tokens", "response tokens"},
}


def register_format(name: str, loader: Callable[..., Trace]) -> None:
    """Add (or replace) a loader; it must accept ``(path, *, limit=None, ...)``."""
    LOADERS[name] = loader


def _head(path: str | Path, size: int = 1 << 16) -> str:
    """The first ``size`` characters of the (decompressed) content."""
    try:
        with open_text(path) as f:
            f.reconfigure(errors="replace")
            return f.read(size)
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    except GZIP_ERRORS as e:
        raise TraceError(f"{path}: damaged gzip data: {e}") from None


def detect_format(path: str | Path) -> str:
    """Guess the format from the content (first 64 KiB, decompressed if gzip), the
    extension (without '.gz') breaking ties:
    ``{"format": "twinserve-trace"`` -> twinserve, ``[`` -> sharegpt, a JSON object
    per line with ``input_length``/``hash_ids`` (or a .jsonl file) -> mooncake, a CSV
    header -> azure / burstgpt / vidur by its columns (for a .csv file, the format
    sharing the most columns with it, so that its loader names what is missing)."""
    text = _head(path).lstrip("\ufeff \t\r\n")
    suffix = logical_suffix(path)
    if not text:
        raise TraceError(f"{path}: empty file")
    first_line = text.split("\n", 1)[0].strip()
    if re.match(r'\{\s*"format"\s*:\s*"twinserve-trace"', text):
        return "twinserve"
    if text.startswith("["):
        return "sharegpt"
    if text.startswith("{"):
        try:
            record = json.loads(first_line)
        except json.JSONDecodeError:
            record = None
        if suffix == ".jsonl" or (isinstance(record, dict) and {"input_length", "hash_ids"} & set(record)):
            return "mooncake"
        if suffix == ".json":
            return "twinserve"  # its loader explains what is missing
    else:
        columns = {c.strip().lower() for c in next(csv.reader([first_line]), [])}
        for name, needed in CSV_COLUMNS.items():
            if needed <= columns:
                return name
        # A .csv header that matches one format best: let its loader name the missing columns.
        overlap = sorted(((len(needed & columns), name) for name, needed in CSV_COLUMNS.items()), reverse=True)
        if suffix == ".csv" and overlap[0][0] > overlap[1][0]:
            return overlap[0][1]
    raise TraceError(f"{path}: cannot detect the trace format (first line: {first_line[:80]!r}); "
                     f"pass a format, one of: {', '.join(LOADERS)}")


def load_trace(path: str | Path, fmt: str = "auto", *, limit: int | None = None, rate: float | None = None,
               burstiness: float = 1.0, time_scale: float | None = None, num_requests: int | None = None,
               seed: int = 0, **options) -> Trace:
    """Load a trace file in format ``fmt`` ("auto": ``detect_format``), keeping its
    first ``limit`` requests, then re-time it if any re-timing option is given (see
    ``traces.retime.retime``). ``options`` go to the loader (e.g. ``tokenizer`` for
    sharegpt, ``vocab_size`` / ``block_size`` / ``token_seed`` for mooncake)."""
    name = detect_format(path) if fmt == "auto" else fmt
    if name not in LOADERS:
        raise TraceError(f"{path}: unknown trace format {fmt!r}; known: auto, {', '.join(LOADERS)}")
    loader = LOADERS[name]
    unknown = sorted(set(options) - set(inspect.signature(loader).parameters))
    if unknown:
        raise TraceError(f"{path}: the {name} format takes no option(s) {', '.join(unknown)}")
    trace = loader(path, limit=limit, **options)
    if rate is not None or time_scale is not None or num_requests is not None or burstiness != 1.0:
        trace = retime(trace, rate=rate, burstiness=burstiness, time_scale=time_scale,
                       num_requests=num_requests, seed=seed)
    return trace
