"""`python -m realexec bench chaos`: good traffic under bad traffic, against a real server.

Starts `python -m realexec serve` as a subprocess (an API key, a body limit, a request
timeout) unless --url names a running one, then runs two phases:

  1. baseline: the good requests alone (streaming, greedy, all at once);
  2. chaos:    the same good requests mixed with malformed / oversized / unauthorized
               requests (`--bad`), clients that disconnect mid-stream (`--disconnect`)
               and clients that ask for more than the request timeout allows (`--slow`).

It reports what a team putting the server in front of users needs to know: good requests
completed, their text equal to an offline greedy run of the same prompts (LLM.generate
in this process), bad requests answered 4xx, 5xx count, KV blocks in use once idle, the
server's peak RSS, and p50/p99 TTFT of the good requests with and without the bad traffic.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.metrics import percentile
from core.procs import realexec_server

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "chaos-key"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", default=None, help="a running server (default: start one as a subprocess)")
    p.add_argument("--api-key", default=API_KEY, help="the key the server wants (a started server gets this one)")
    p.add_argument("--model", default=None, help="model for the started server and the offline reference "
                                                 "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--trace", default=str(ROOT / "traces/sharegpt.json"), help="prompts come from this trace")
    p.add_argument("--good", type=int, default=200, help="good streaming requests [200]")
    p.add_argument("--bad", type=int, default=50, help="malformed / oversized / unauthorized requests [50]")
    p.add_argument("--disconnect", type=int, default=30, help="clients that leave mid-stream [30]")
    p.add_argument("--slow", type=int, default=20, help="clients that exceed the request timeout [20]")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of a good request [16]")
    p.add_argument("--max-prompt-chars", type=int, default=300, help="truncate trace prompts to this [300]")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="the started server's --request-timeout; the slow clients ask for more [60]")
    p.add_argument("--server-args", default="--max-num-batched-tokens 512 --kv-cache-memory 0.5",
                   help="extra flags for the started server")
    p.add_argument("--save-result", default=None, help="write the results as JSON here")
    return p


@dataclass
class Outcome:
    kind: str
    status: int | None = None
    text: str = ""
    completion_tokens: int | None = None
    ttft: float | None = None
    error: str = ""
    sse_error: str | None = None
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- traffic

def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def good_request(client, key: str, index: int, prompt: str, max_tokens: int) -> Outcome:
    out = Outcome("good", extra={"index": index})
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=_headers(key)) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = (await resp.aread()).decode(errors="replace")[:300]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out.sse_error = data["error"]["code"]
                    continue
                for choice in data["choices"]:
                    if choice["text"] and out.ttft is None:
                        out.ttft = time.perf_counter() - t0
                    out.text += choice["text"]
                if data.get("usage"):
                    out.completion_tokens = data["usage"]["completion_tokens"]
    except Exception as e:   # noqa: BLE001 - a transport failure is a result too
        out.error = f"{type(e).__name__}: {e}"
    return out


def bad_bodies(n: int, key: str, rng: random.Random) -> list[tuple[str, dict]]:
    """(description, httpx request kwargs) for n bad requests, cycling through the kinds."""
    auth = _headers(key)
    kinds = [
        ("malformed JSON", dict(content=b'{"prompt": "hi", ', headers={**auth, "content-type": "application/json"})),
        ("not UTF-8", dict(content=b'{"prompt": "\xff\xfe"}', headers={**auth, "content-type": "application/json"})),
        ("no content type", dict(content=b'{"prompt": "hi"}', headers={**auth, "content-type": ""})),
        ("oversized body", dict(content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}',
                                headers={**auth, "content-type": "application/json"})),
        ("max_tokens 1e8", dict(json={"prompt": "hi", "max_tokens": 100_000_000}, headers=auth)),
        ("n too large", dict(json={"prompt": "hi", "n": 1000}, headers=auth)),
        ("negative temperature", dict(json={"prompt": "hi", "temperature": -1}, headers=auth)),
        ("unknown model", dict(json={"prompt": "hi", "model": "gpt-17"}, headers=auth)),
        ("wrong API key", dict(json={"prompt": "hi"}, headers=_headers("wrong"))),
        ("no API key", dict(json={"prompt": "hi"}, headers={})),
        ("prompt ids out of vocab", dict(json={"prompt": [10**9]}, headers=auth)),
        ("logprobs too many", dict(json={"prompt": "hi", "logprobs": 50}, headers=auth)),
    ]
    out = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(out)
    return out


async def bad_request(client, desc: str, kwargs: dict) -> Outcome:
    out = Outcome("bad", extra={"what": desc})
    try:
        resp = await client.post("/v1/completions", **kwargs)
        out.status = resp.status_code
        body = resp.json()
        if not (isinstance(body, dict) and set(body) == {"error"}):
            out.error = f"not an OpenAI error body: {resp.text[:200]}"
    except Exception as e:   # noqa: BLE001
        out.error = f"{type(e).__name__}: {e}"
    return out


async def disconnecting_request(client, key: str, prompt: str) -> Outcome:
    out = Outcome("disconnect")
    body = {"prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=_headers(key)) as resp:
            out.status = resp.status_code
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= 3:
                        break              # leave: closing the stream drops the connection
    except Exception as e:   # noqa: BLE001
        out.error = f"{type(e).__name__}: {e}"
    return out


async def slow_request(client, key: str, prompt: str) -> Outcome:
    out = Outcome("slow")
    body = {"prompt": prompt, "max_tokens": 1500, "ignore_eos": True}
    try:
        resp = await client.post("/v1/completions", json=body, headers=_headers(key))
        out.status = resp.status_code
        if resp.status_code >= 400:
            out.sse_error = resp.json()["error"]["code"]
    except Exception as e:   # noqa: BLE001
        out.error = f"{type(e).__name__}: {e}"
    return out


# ----------------------------------------------------------------------------- server

def server_log_path(args) -> Path:
    """Where a started server's output goes: next to --save-result, else results/."""
    return Path(args.save_result).with_suffix(".server.log") if args.save_result \
        else ROOT / "results" / "bench_chaos.server.log"


def start_server(args, log: Path):
    """`realexec serve` with the chaos settings: core.procs' context manager (healthy inside,
    stopped with SIGINT, SIGTERM, SIGKILL on the way out)."""
    server_args = ["--api-key", args.api_key, "--request-timeout", str(args.request_timeout),
                   "--max-request-body-bytes", str(1 << 20), "--log-level", "warning", *args.server_args.split()]
    if args.model:
        server_args += ["--model", args.model]
    return realexec_server(server_args, log, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(base: str, key: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", headers=_headers(key), timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


async def wait_idle(base: str, key: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base, key)
        if m["twinserve:num_requests_running"] == 0 and m["twinserve:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


# ----------------------------------------------------------------------------- phases

async def run_phase(base: str, args, prompts: list[str], chaos: bool, rng: random.Random) -> list[Outcome]:
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(args.request_timeout + 120),
                                 limits=limits) as client:
        tasks = [good_request(client, args.api_key, i, p, args.max_tokens) for i, p in enumerate(prompts)]
        if chaos:
            tasks += [bad_request(client, d, kw) for d, kw in bad_bodies(args.bad, args.api_key, rng)]
            tasks += [disconnecting_request(client, args.api_key, prompts[i % len(prompts)])
                      for i in range(args.disconnect)]
            tasks += [slow_request(client, args.api_key, prompts[i % len(prompts)]) for i in range(args.slow)]
            order = list(range(len(tasks)))
            rng.shuffle(order)
            tasks = [tasks[i] for i in order]
        return list(await asyncio.gather(*tasks))


def summarize(outcomes: list[Outcome], reference: list[str]) -> dict:
    good = [o for o in outcomes if o.kind == "good"]
    ok = [o for o in good if o.status == 200 and not o.error and not o.sse_error and o.completion_tokens]
    equal = sum(o.text == reference[o.extra["index"]] for o in ok)
    bad = [o for o in outcomes if o.kind == "bad"]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    slow = [o for o in outcomes if o.kind == "slow"]
    disc = [o for o in outcomes if o.kind == "disconnect"]
    return {
        "good": len(good), "good_completed": len(ok), "good_equal_offline": equal,
        "bad": len(bad), "bad_4xx": sum(1 for o in bad if o.status and 400 <= o.status < 500 and not o.error),
        "bad_kinds_not_4xx": sorted({o.extra["what"] for o in bad if not (o.status and 400 <= o.status < 500)}),
        "disconnects": len(disc), "slow": len(slow),
        "slow_timed_out": sum(1 for o in slow if o.status == 408),
        "http_5xx": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        "transport_errors": sum(1 for o in outcomes if o.error and o.kind != "bad"),
        "ttft_p50_ms": percentile(ttfts, 50) * 1000, "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "good_failures": [(o.status, o.error or o.sse_error, o.completion_tokens) for o in good if o not in ok][:10],
    }


def offline_reference(args, prompts: list[str]) -> list[str]:
    from core import SamplingParams
    from realexec import LLM

    extra = args.server_args.split()
    kw = {}
    if "--kv-cache-memory" in extra:
        kw["kv_cache_memory"] = float(extra[extra.index("--kv-cache-memory") + 1])
    llm = LLM(model=args.model, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    return [o.outputs[0].text for o in outs]


def run(args: argparse.Namespace) -> int:
    from traces import load_trace

    for name in ("good", "bad", "disconnect", "slow", "max_tokens"):
        if getattr(args, name) < (1 if name in ("good", "max_tokens") else 0):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {1 if name in ('good', 'max_tokens') else 0}")
    trace = [r for r in load_trace(args.trace, limit=args.good * 3) if r.prompt]
    if not trace:
        raise ValueError(f"{args.trace}: no request has a text prompt")
    prompts = [trace[i % len(trace)].prompt[:args.max_prompt_chars] for i in range(args.good)]
    print(f"offline greedy reference for {len(prompts)} prompts ...", flush=True)
    reference = offline_reference(args, prompts)

    if args.url:
        base, started = args.url.rstrip("/"), contextlib.nullcontext()
    else:
        print("starting the server ...", flush=True)
        started = start_server(args, server_log_path(args))
    rng = random.Random(0)
    with started as server:
        base = server.url if server else base
        t0 = time.perf_counter()
        baseline = summarize(asyncio.run(run_phase(base, args, prompts, False, rng)), reference)
        baseline["duration_s"] = time.perf_counter() - t0
        print(f"baseline done in {baseline['duration_s']:.1f} s", flush=True)
        m_before = asyncio.run(wait_idle(base, args.api_key))
        t0 = time.perf_counter()
        chaos = summarize(asyncio.run(run_phase(base, args, prompts, True, rng)), reference)
        chaos["duration_s"] = time.perf_counter() - t0
        m_after = asyncio.run(wait_idle(base, args.api_key))
        chaos["kv_blocks_in_use_after"] = m_after["twinserve:num_used_gpu_blocks"]
        baseline["kv_blocks_in_use_after"] = m_before["twinserve:num_used_gpu_blocks"]
        chaos["rejected_by_reason"] = {k.split("reason=")[1].rstrip("}"): int(v - m_before.get(k, 0))
                                       for k, v in m_after.items()
                                       if k.startswith("twinserve:request_rejected_total{") and v - m_before.get(k, 0)}
        chaos["aborted"] = int(m_after["twinserve:request_success_total{finished_reason=abort}"]
                               - m_before["twinserve:request_success_total{finished_reason=abort}"])
        rss = peak_rss_mib(server.proc.pid) if server else None
    result = {"baseline": baseline, "chaos": chaos, "server_peak_rss_mib": rss,
              "server_exit_code": server.proc.returncode if server else None}
    print_table(result, args)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2))
    return 0


def print_table(r: dict, args) -> None:
    b, c = r["baseline"], r["chaos"]
    rows = [
        ("good requests completed", f"{b['good_completed']}/{b['good']}", f"{c['good_completed']}/{c['good']}"),
        ("good text == offline greedy", f"{b['good_equal_offline']}/{b['good']}", f"{c['good_equal_offline']}/{c['good']}"),
        ("bad requests answered 4xx", "-", f"{c['bad_4xx']}/{c['bad']}"),
        ("slow requests timed out (408)", "-", f"{c['slow_timed_out']}/{c['slow']}"),
        ("clients disconnected mid-stream", "-", f"{c['disconnects']} (aborted: {c['aborted']})"),
        ("5xx responses", str(b["http_5xx"]), str(c["http_5xx"])),
        ("KV blocks in use after", f"{b['kv_blocks_in_use_after']:.0f}", f"{c['kv_blocks_in_use_after']:.0f}"),
        ("good TTFT p50 / p99 (ms)", f"{b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f}",
         f"{c['ttft_p50_ms']:.0f} / {c['ttft_p99_ms']:.0f}"),
        ("phase duration (s)", f"{b['duration_s']:.1f}", f"{c['duration_s']:.1f}"),
    ]
    print(f"\n| chaos bench ({args.good} good, {args.bad} bad, {args.disconnect} disconnect, {args.slow} slow) "
          f"| good only | good + chaos |\n|---|---|---|")
    for name, x, y in rows:
        print(f"| {name} | {x} | {y} |")
    print(f"\nserver peak RSS: {r['server_peak_rss_mib'] or float('nan'):.0f} MiB; "
          f"exit code after SIGINT: {r['server_exit_code']}")
    print(f"rejections by reason (chaos phase): {c['rejected_by_reason']}")
    for name, phase in (("baseline", b), ("chaos", c)):
        if phase["good_failures"]:
            print(f"{name}: good requests that failed (status, error, tokens): {phase['good_failures']}")
    if c["bad_kinds_not_4xx"]:
        print(f"bad requests NOT answered 4xx: {c['bad_kinds_not_4xx']}")
