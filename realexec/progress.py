"""Progress bars for the CLI's long work (tqdm, on stderr).

`enabled=None` (the CLI's choice) shows them only when stderr is a terminal, so logs and
pipes get no carriage-return noise; tqdm's own `TQDM_DISABLE=1` turns them off too.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from tqdm import tqdm


def bar(total: float | None, desc: str, unit: str, enabled: bool | None = None) -> tqdm:
    """A bar counting `unit`s up to `total`; tqdm's rate column is the running `unit`/s."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, mininterval=0.25,
                disable=None if enabled is None else not enabled)


@contextmanager
def busy(desc: str, enabled: bool | None = None) -> Iterator[tqdm]:
    """For one blocking call with no steps to count (loading a model): the elapsed time
    ticks on while it runs; the line stays with 'done' after, and is cleared on error."""
    pbar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}{postfix}", file=sys.stderr,
                disable=None if enabled is None else not enabled)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            pbar.refresh()

    ticker = threading.Thread(target=tick, name="progress-ticker", daemon=True)
    ticker.start()
    try:
        yield pbar
    except BaseException:
        pbar.leave = False
        raise
    else:
        pbar.set_postfix_str("done", refresh=False)
    finally:
        stop.set()
        ticker.join()
        pbar.close()


class TokenProgress:
    """Counts the output tokens of running requests from the cumulative outputs that
    `LLMEngine.step()` returns (the longest sample or beam of each request)."""

    def __init__(self, pbar: tqdm):
        self.pbar = pbar
        self._seen: dict[str, int] = {}

    def update(self, outputs: Iterable) -> None:
        new = 0
        for out in outputs:
            count = max((len(c.token_ids) for c in out.outputs), default=0)
            new += count - self._seen.get(out.request_id, 0)
            if out.finished:
                self._seen.pop(out.request_id, None)
            else:
                self._seen[out.request_id] = count
        if new:
            self.pbar.update(new)

    def close(self) -> None:
        self.pbar.close()
