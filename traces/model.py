"""Trace record types, the input error, and helpers shared by the loaders.

Pure Python: nothing here (or in any loader) imports torch or transformers.
"""
from __future__ import annotations

import gzip
import io
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Arrival times are rounded to the microsecond so that files stay compact and a
# save/load round trip reproduces them exactly.
TIME_DECIMALS = 6


class TraceError(Exception):
    """A trace file (or trace option) is wrong; the message names the file and the
    record/line and says what is wrong, so the CLI prints it without a traceback."""


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    arrival_time: float  # seconds from the first arrival of the trace
    prompt_len: int  # tokens
    output_len: int  # tokens to generate
    prompt: str | None = None
    # Present when the loader knows or generates the prompt's token ids (Mooncake's
    # hashed blocks: a lazy read-only Sequence[int]; see traces.mooncake).
    prompt_token_ids: Sequence[int] | None = None


@dataclass
class Trace:
    requests: list[TraceRequest]
    source: str = ""  # provenance: where the requests came from and what was done to them

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> TraceRequest:
        return self.requests[i]

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival."""
        return self.requests[-1].arrival_time - self.requests[0].arrival_time if self.requests else 0.0


def finalize(requests: list[TraceRequest], source: str) -> Trace:
    """Sort by arrival (stable: ties keep file order), shift so that the first
    arrival is at 0 and round times to the microsecond: every loader's contract.
    Updates the (freshly made) requests in place."""
    requests = sorted(requests, key=lambda r: r.arrival_time)
    t0 = requests[0].arrival_time if requests else 0.0
    for r in requests:
        r.arrival_time = round(r.arrival_time - t0, TIME_DECIMALS) + 0.0  # + 0.0: no -0.0
    return Trace(requests, source)


# ---- field parsing with file/line context -------------------------------------------

def where(path: str | Path, line: int | None = None, record: int | None = None) -> str:
    """'path, line 3' / 'path, record 5' prefix for TraceError messages."""
    parts = [str(path)]
    if record is not None:
        parts.append(f"record {record}")
    if line is not None:
        parts.append(f"line {line}")
    return ", ".join(parts)


def parse_float(value: object, name: str, at: str) -> float:
    """A finite number (int, float or numeric string)."""
    if isinstance(value, bool):
        raise TraceError(f"{at}: {name}: expected a number, got {value!r}")
    try:
        x = float(value.strip()) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceError(f"{at}: {name}: expected a number, got {value!r}") from None
    if not math.isfinite(x):
        raise TraceError(f"{at}: {name}: expected a finite number, got {value!r}")
    return x


def parse_length(value: object, name: str, at: str) -> int:
    """A token count: a non-negative integer (``"12"`` and ``12.0`` are accepted)."""
    x = parse_float(value, name, at)
    if not x.is_integer():
        raise TraceError(f"{at}: {name}: expected an integer, got {value!r}")
    if x < 0:
        raise TraceError(f"{at}: {name}: negative length {int(x)}")
    return int(x)


GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: str | Path) -> bool:
    """Whether the file starts with the gzip magic bytes (whatever its name)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def open_text(path: str | Path, newline: str | None = None) -> io.TextIOBase:
    """Open a trace for reading as UTF-8 text (a BOM skipped), decompressing it on the
    fly when it is gzip-compressed: every loader reads ``x.jsonl.gz`` like ``x.jsonl``.
    An unreadable file raises a TraceError."""
    try:
        if is_gzip(path):
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline=newline)
        return open(path, encoding="utf-8-sig", newline=newline)
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None


def logical_suffix(path: str | Path) -> str:
    """The extension that says what the content is: '.jsonl' for 'x.jsonl.gz'."""
    path = Path(path)
    if path.suffix.lower() == ".gz":
        path = path.with_suffix("")
    return path.suffix.lower()


# What a damaged gzip stream raises while it is read.
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


def read_text(path: str | Path) -> str:
    """The whole file as UTF-8 text; I/O and decoding problems become TraceErrors."""
    return "".join(iter_lines(path))


def iter_lines(path: str | Path) -> Iterator[str]:
    """The file's lines (UTF-8, line ends kept; gzip decompressed), streamed; an
    unreadable, damaged, non-UTF-8 or empty file raises a TraceError."""
    with open_text(path, newline="") as f:
        empty, line_no = True, 0
        try:
            for line_no, line in enumerate(f, 1):  # noqa: B007 (line_no: read by the except clauses)
                empty = empty and not line.strip()
                yield line
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not UTF-8 text (near line {line_no + 1})") from None
        except GZIP_ERRORS as e:
            raise TraceError(f"{path}: damaged gzip data near line {line_no + 1}: {e}") from None
    if empty:
        raise TraceError(f"{path}: empty file")
