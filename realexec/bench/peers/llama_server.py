"""Time a running llama.cpp `llama-server` on token-id requests (stdlib HTTP only).

Each request goes to its native `POST /completion` with the prompt as a token-id array,
`n_predict` = max_tokens, `ignore_eos`, `temperature` 0 (greedy) and no prompt cache,
`concurrency` requests in flight at once (give the server at least as many slots, `-np`).
One short warm-up request runs first, untimed. A request counts the tokens it got, up to
its max_tokens (`tokens_predicted`); a server whose slot context is too small stops
requests early, and `short_requests` says how many.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor


class PeerError(RuntimeError):
    """A peer engine could not be run or answered wrongly (one line for the user)."""


def check_url(url: str) -> str:
    """The base URL without a trailing slash; ValueError if it is not http(s)://host[:port]."""
    parsed = urllib.parse.urlparse(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--peer-url {url!r}: expected http://HOST:PORT (a running llama-server)")
    return url.rstrip("/")


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace")
        raise PeerError(f"llama-server {url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise PeerError(f"llama-server {url}: {getattr(e, 'reason', e)}") from None
    except json.JSONDecodeError:
        raise PeerError(f"llama-server {url}: the answer is not JSON") from None


def health(base: str, timeout: float = 10.0) -> None:
    """PeerError unless GET /health answers 200 (llama-server is up and its model loaded)."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout) as resp:
            if resp.status == 200:
                return
            status = resp.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError) as e:
        raise PeerError(f"--peer-url {base}: no llama-server answers ({getattr(e, 'reason', e)}); "
                        f"start one, e.g. llama-server -m MODEL.gguf -np 16 --port PORT") from None
    raise PeerError(f"--peer-url {base}: /health answered HTTP {status} (model still loading?)")


def complete(base: str, ids: list[int], max_tokens: int, timeout: float) -> int:
    """Tokens the server generated for one request (its `tokens_predicted`)."""
    out = _post(base + "/completion", {"prompt": list(ids), "n_predict": max_tokens, "ignore_eos": True,
                                       "temperature": 0.0, "cache_prompt": False, "stream": False},
                timeout)
    n = out.get("tokens_predicted") if isinstance(out, dict) else None
    if not isinstance(n, int):
        raise PeerError(f"llama-server {base}/completion: no integer 'tokens_predicted' in the answer")
    return n


def run_llama_server(url: str, requests: list[tuple[list[int], int]], concurrency: int = 16,
                     timeout: float = 1800.0) -> dict:
    """{"engine", "url", "concurrency", "requests", "output_tokens", "seconds", "short_requests"}."""
    if concurrency < 1:
        raise ValueError(f"--peer-concurrency must be >= 1, got {concurrency}")
    base = check_url(url)
    health(base)
    ids0, m0 = requests[0]
    complete(base, list(reversed(ids0)), min(m0, 8), timeout)          # warm-up, other content
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        t0 = time.perf_counter()
        got = list(pool.map(lambda r: complete(base, r[0], r[1], timeout), requests))
        seconds = time.perf_counter() - t0
    return {"engine": "llama-server", "url": base, "concurrency": concurrency, "requests": len(requests),
            "output_tokens": sum(min(n, m) for n, (_, m) in zip(got, requests)), "seconds": seconds,
            "short_requests": sum(n < m for n, (_, m) in zip(got, requests))}
