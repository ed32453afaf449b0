"""`python -m realexec bench serve`: a serving benchmark against any OpenAI-compatible
server (ours, vLLM, ...), in the manner of vLLM's `bench serve`.

Requests come from a trace (`traces.load_trace`: the prompt text when it has one, else
its token ids, else random token ids of the traced length), arrive as a Poisson process
at --rate (gamma gaps with --burstiness != 1; --rate inf sends all at once), optionally
capped at --max-concurrency in flight, and stream from --endpoint with
max_tokens = the traced output length (capped by --max-tokens-cap), ignore_eos, and
temperature 0. Everything is measured on the client over HTTP (httpx): TTFT = send to
the first chunk with text; ITL = gaps between later chunks with text; TPOT =
(E2EL - TTFT) / (output tokens - 1); E2EL = send to the end of the stream.

Output tokens come from the server's `usage` (we ask for `stream_options.include_usage`);
a server that sends no usage is counted by tokenizing the generated text with
--tokenizer if given, else as the number of text chunks. The result's
`output_tokens_source` says which. Field names follow vLLM's saved JSON.

Pure Python + httpx: no torch, no engine import, so it runs from a light environment.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int               # from the trace (the server's usage replaces it when given)
    max_tokens: int
    arrival_time: float


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    output_tokens_source: str = "usage"
    ttft: float = 0.0             # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""


# ----------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL [http://127.0.0.1:8000]")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions [/v1/completions]")
    parser.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    parser.add_argument("--trace", default="traces/sharegpt.json", help="trace file (any traces format) "
                        "[traces/sharegpt.json]")
    parser.add_argument("--num-requests", type=int, default=100, help="requests to send [100]")
    parser.add_argument("--skip", type=int, default=0, metavar="N",
                        help="leave out the trace's first N requests (e.g. a calibration slice disjoint "
                             "from a validation one) [0]")
    parser.add_argument("--rate", type=float, default=float("inf"),
                        help="mean arrival rate, req/s; inf sends all at t=0 [inf]")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 more regular [1]")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    parser.add_argument("--max-tokens-cap", type=int, default=None, help="cap each request's max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature [0]")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly max_tokens (needs a server that accepts ignore_eos) [on]")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to report [99]")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer to count output tokens when the server reports no usage")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds [600]")
    parser.add_argument("--save-result", default=None, metavar="OUT.json", help="write the result JSON here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times and random prompts [0]")
    return parser


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] < 0:
            raise ValueError(f"--goodput {item!r}: must be >= 0 ms")
    return slos


def _check_args(args) -> None:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if getattr(args, "skip", 0) < 0:
        raise ValueError(f"--skip must be >= 0, got {args.skip}")
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0 (or inf), got {args.rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise ValueError(f"--max-tokens-cap must be >= 1, got {args.max_tokens_cap}")
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    if args.endpoint not in ("/v1/completions", "/v1/chat/completions"):
        raise ValueError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {args.endpoint}")


def build_requests(args) -> list[BenchRequest]:
    from traces import TraceError, arrival_times, load_trace, retime
    from traces.model import Trace

    skip = getattr(args, "skip", 0)
    trace = load_trace(args.trace, limit=skip + args.num_requests)
    if len(trace) <= skip:
        raise TraceError(f"{args.trace}: {len(trace)} requests, none left after --skip {skip}")
    if skip:
        trace = Trace(trace.requests[skip:], f"{trace.source}, first {skip} requests skipped")
    if len(trace) < args.num_requests:
        trace = retime(trace, num_requests=args.num_requests)      # replay to reach N
    n = args.num_requests
    times = [0.0] * n if math.isinf(args.rate) else arrival_times(n, args.rate, args.burstiness, args.seed)
    rng = random.Random(args.seed)
    chat = args.endpoint.endswith("/chat/completions")
    out = []
    for r, t in zip(trace.requests[:n], times):
        if r.prompt:
            prompt: str | list[int] = r.prompt
        elif chat:
            raise ValueError(f"{args.trace}: request {r.request_id} has no prompt text; "
                             f"use --endpoint /v1/completions (token-id prompts)")
        elif r.prompt_token_ids is not None:
            prompt = list(r.prompt_token_ids)
        else:        # a length-only trace: random ids, clear of most vocabularies' special tokens
            prompt = [rng.randrange(1000, 10000) for _ in range(r.prompt_len)]
        max_tokens = min(r.output_len, args.max_tokens_cap or r.output_len)
        out.append(BenchRequest(prompt, r.prompt_len, max(1, max_tokens), t))
    return out


# ----------------------------------------------------------------------------- one request

def _payload(req: BenchRequest, args, model: str, chat: bool) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(client, url: str, payload: dict, chat: bool, prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    parts: list[str] = []
    usage = None
    num_chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                result.error = f"HTTP {resp.status_code}: {str(body)[:300]}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if num_chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        num_chunks += 1
                        parts.append(text)
        result.latency = time.perf_counter() - start
        result.generated_text = "".join(parts)
        if usage is not None:
            result.output_len = int(usage.get("completion_tokens") or 0)
            result.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
        else:
            result.output_len, result.output_tokens_source = num_chunks, "chunks"
        result.success = num_chunks > 0 or result.output_len > 0
        if not result.success:
            result.error = "the stream carried no text"
    except Exception as e:     # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


# ----------------------------------------------------------------------------- the run

async def resolve_model(client, base_url: str, model: str | None) -> str:
    """`model`, else the first of the server's /v1/models. Either way the server is asked
    first, so nothing listening at the URL is one clear error (a ConnectionError), not
    every request failing."""
    import httpx

    try:
        resp = await client.get(base_url + "/v1/models")
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise ConnectionError(f"no server at {base_url} ({e}); start one with `python -m realexec serve` "
                              f"or pass --url") from None
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
        raise ValueError(f"--url {base_url!r}: {e}") from None
    if model:
        return model
    if resp.status_code != 200:
        raise ConnectionError(f"{base_url}/v1/models answered HTTP {resp.status_code}: pass --model, or check "
                              f"--url{' (and the API key)' if resp.status_code in (401, 403) else ''}")
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def benchmark(args, requests: list[BenchRequest],
                    progress: bool | None = None) -> tuple[dict, list[RequestResult]]:
    """``progress``: a bar of finished requests with their output tok/s (None: on a terminal)."""
    import httpx

    from realexec.progress import bar

    base = args.url.rstrip("/")
    chat = args.endpoint.endswith("/chat/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await resolve_model(client, base, args.model)
        url = base + args.endpoint
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        in_flight = 0
        max_in_flight = 0
        pbar = bar(len(requests), "bench serve", "req", progress)
        output_tokens = failed = 0

        async def one(req: BenchRequest) -> RequestResult:
            nonlocal in_flight, max_in_flight, output_tokens, failed
            if sem is not None:
                await sem.acquire()
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                result = await send_request(client, url, _payload(req, args, model, chat), chat, req.prompt_len)
            finally:
                in_flight -= 1
                if sem is not None:
                    sem.release()
            output_tokens += result.output_len
            failed += not result.success
            pbar.set_postfix_str(f"{output_tokens / (time.perf_counter() - start):.1f} out tok/s, "
                                 f"{in_flight} in flight" + (f", {failed} failed" if failed else ""), refresh=False)
            pbar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req in requests:
            delay = start + req.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        try:
            results = await asyncio.gather(*tasks)
        finally:
            pbar.close()
        duration = time.perf_counter() - start
    if args.tokenizer:
        _recount_with_tokenizer(args.tokenizer, results)
    meta = {"model_id": model, "max_concurrent_requests": max_in_flight}
    return {**meta, **summarize(results, duration, parse_goodput(args.goodput), _percentiles(args))}, results


def _recount_with_tokenizer(name: str, results: list[RequestResult]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    for r in results:
        if r.success and r.output_tokens_source == "chunks":
            r.output_len = len(tok(r.generated_text, add_special_tokens=False).input_ids)
            r.output_tokens_source = "tokenizer"


def _percentiles(args) -> list[float]:
    try:
        return [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: expected numbers like 50,90,99, got "
                         f"{args.metric_percentiles!r}") from None


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    from core.metrics import percentile

    v = sorted(values)
    if not v:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    mean = sum(v) / len(v)
    out = {"mean": mean, "median": percentile(v, 50), "std": math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(v, p)
    return out


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float],
              percentiles: list[float] = (99,)) -> dict:
    ok = [r for r in results if r.success]
    tpots = {id(r): (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0 for r in ok}
    good = 0
    for r in ok:
        ms = {"ttft": r.ttft * 1e3, "tpot": tpots[id(r)] * 1e3, "e2el": r.latency * 1e3}
        good += all(ms[k] <= v for k, v in slos.items())
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    sources = sorted({r.output_tokens_source for r in ok})
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": (good / duration if duration > 0 else 0.0) if slos else None,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "output_tokens_source": "+".join(sources) if sources else "none",
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [tpots[id(r)] for r in ok if r.output_len > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        for stat, value in _stats(values, list(percentiles)).items():
            summary[f"{stat}_{name}_ms"] = value * 1e3
    summary.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    })
    return summary


def print_summary(s: dict, slos: dict[str, float], percentiles: list[float]) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Maximum request concurrency:", s.get("max_concurrency") or "none"),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            (f"Total generated tokens ({s['output_tokens_source']}):", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}")]
    if slos:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
             ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value!s:<10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        stats = ["mean", "median"] + [f"p{p:g}" for p in percentiles]
        for stat in stats:
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            print(f"{label + ' ' + key.upper() + ' (ms):':<40}{s[f'{stat}_{key}_ms']:<10.2f}")
    print("=" * w)
    errors = [e for e in s["errors"] if e]
    if errors:
        print(f"{len(errors)} request(s) failed; first error: {errors[0]}")


def run(args) -> int:
    _check_args(args)
    slos = parse_goodput(args.goodput)
    percentiles = _percentiles(args)
    requests = build_requests(args)
    print(f"bench serve: {len(requests)} requests from {args.trace} to {args.url}{args.endpoint} at "
          f"{'all at once' if math.isinf(args.rate) else f'{args.rate:g} req/s'}"
          f"{'' if args.burstiness == 1.0 else f' (burstiness {args.burstiness:g})'}"
          f"{f', max concurrency {args.max_concurrency}' if args.max_concurrency else ''}", flush=True)
    summary, _ = asyncio.run(benchmark(args, requests))
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint.endswith("/chat/completions") else "openai",
        "base_url": args.url, "endpoint": args.endpoint, "trace": args.trace,
        "num_prompts": args.num_requests,
        "request_rate": "inf" if math.isinf(args.rate) else args.rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "max_tokens_cap": args.max_tokens_cap, "seed": args.seed,
        "goodput_slos_ms": slos or None,
        **summary,
    }
    print_summary(result, slos, percentiles)
    if args.save_result:
        path = Path(args.save_result)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, allow_nan=False))
        print(f"saved {path}")
    return 0 if summary["completed"] else 1
