"""CSV request traces: Azure LLM inference, BurstGPT and Vidur.

Each loader keeps the lengths and arrival times of the rows (no prompt text) and
returns them sorted, starting at 0. ``limit`` keeps the first N requests of the file.
"""
from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from .model import Trace, TraceError, TraceRequest, finalize, iter_lines, parse_float, parse_length, where


def csv_rows(path: str | Path, columns: list[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line number, {column: text}) for each data row; column names match
    case-insensitively, extra columns are ignored, blank lines skipped."""
    reader = csv.reader(iter_lines(path))
    header = [name.strip() for name in next(reader)]
    if not any(header):
        raise TraceError(f"{where(path, 1)}: expected a CSV header line, got a blank line")
    index = {name.lower(): i for i, name in enumerate(header)}
    missing = [c for c in columns if c.lower() not in index]
    if missing:
        shown = ", ".join(map(repr, header))
        raise TraceError(f"{where(path, 1)}: missing column(s) {', '.join(map(repr, missing))}; "
                         f"the header has {shown if len(shown) <= 120 else shown[:120] + '...'}")
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise TraceError(f"{where(path, reader.line_num)}: expected {len(header)} fields, got {len(row)}")
        yield reader.line_num, {c: row[index[c.lower()]] for c in columns}


def _limited(source: str, limit: int | None) -> str:
    return source if limit is None else f"{source}, first {limit} requests"


# ---- Azure LLM inference trace (2023/2024): TIMESTAMP is a date-time string ----------

_DATETIME = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?\s*(Z|[+-]\d\d:?\d\d)?")


def parse_azure_timestamp(text: str, at: str) -> tuple[int, float]:
    """'2023-11-16 18:15:46.6805900' -> (whole epoch seconds, fraction). Kept apart so
    that sub-microsecond digits survive (epoch seconds as one float would not);
    naive times are taken as UTC."""
    m = _DATETIME.fullmatch(text.strip())
    if m is None:
        raise TraceError(f"{at}: TIMESTAMP: expected a date-time like '2023-11-16 18:15:46.680590', got {text!r}")
    stamp, fraction, zone = m.groups()
    zone = "+00:00" if zone in (None, "Z") else zone[:3] + ":" + zone[-2:]
    try:
        whole = datetime.fromisoformat(stamp + zone).astimezone(timezone.utc)
    except ValueError as e:
        raise TraceError(f"{at}: TIMESTAMP: {e}: {text!r}") from None
    return int(whole.timestamp()), float("0." + fraction) if fraction else 0.0


def load_azure(path: str | Path, *, limit: int | None = None) -> Trace:
    """Azure LLM inference trace CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``."""
    requests, first_second = [], None
    for line, row in csv_rows(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]):
        if limit is not None and len(requests) >= limit:
            break
        at = where(path, line)
        second, fraction = parse_azure_timestamp(row["TIMESTAMP"], at)
        first_second = second if first_second is None else first_second
        requests.append(TraceRequest(
            request_id=f"azure-{len(requests)}",
            arrival_time=(second - first_second) + fraction,
            prompt_len=parse_length(row["ContextTokens"], "ContextTokens", at),
            output_len=parse_length(row["GeneratedTokens"], "GeneratedTokens", at),
        ))
    return finalize(requests, _limited(f"azure {path}", limit))


# ---- BurstGPT: Timestamp in seconds ---------------------------------------------------

def load_burstgpt(path: str | Path, *, limit: int | None = None, skip_failed: bool = True,
                  model: str | None = None) -> Trace:
    """BurstGPT CSV: ``Timestamp, Model, Request tokens, Response tokens, Total tokens,
    Log Type``. Rows with 0 response tokens are failed requests and are skipped unless
    ``skip_failed=False``; ``model`` keeps only that Model (e.g. 'ChatGPT', 'GPT-4')."""
    requests, failed, other_model = [], 0, 0
    for line, row in csv_rows(path, ["Timestamp", "Model", "Request tokens", "Response tokens"]):
        if limit is not None and len(requests) >= limit:
            break
        at = where(path, line)
        arrival = parse_float(row["Timestamp"], "Timestamp", at)
        prompt_len = parse_length(row["Request tokens"], "Request tokens", at)
        output_len = parse_length(row["Response tokens"], "Response tokens", at)
        if model is not None and row["Model"].strip() != model:
            other_model += 1
        elif skip_failed and output_len == 0:
            failed += 1
        else:
            requests.append(TraceRequest(f"burstgpt-{len(requests)}", arrival, prompt_len, output_len))
    source = f"burstgpt {path}"
    if model is not None:
        source += f", model {model} only ({other_model} other rows skipped)"
    if skip_failed:
        source += f", {failed} failed rows (0 response tokens) skipped"
    return finalize(requests, _limited(source, limit))


# ---- Vidur request CSV: arrived_at in seconds ------------------------------------------

def load_vidur(path: str | Path, *, limit: int | None = None) -> Trace:
    """Vidur trace CSV: ``arrived_at`` (s), ``num_prefill_tokens``, ``num_decode_tokens``."""
    requests = []
    for line, row in csv_rows(path, ["arrived_at", "num_prefill_tokens", "num_decode_tokens"]):
        if limit is not None and len(requests) >= limit:
            break
        at = where(path, line)
        requests.append(TraceRequest(
            request_id=f"vidur-{len(requests)}",
            arrival_time=parse_float(row["arrived_at"], "arrived_at", at),
            prompt_len=parse_length(row["num_prefill_tokens"], "num_prefill_tokens", at),
            output_len=parse_length(row["num_decode_tokens"], "num_decode_tokens", at),
        ))
    return finalize(requests, _limited(f"vidur {path}", limit))
