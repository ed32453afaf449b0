"""vLLM's own decisions as step logs: the recorder's conversion of vLLM scheduler outputs
(on synthetic objects shaped like vLLM 0.32's: CI has no vLLM), its patching of the
scheduler class, and `sim replay` on the committed recordings in tests/fixtures/vllm/."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.cost.step_log import load_log
from realexec.bench.peers import vllm_recorder as vr
from sim.twin.replay import format_report, replay

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"
LIGHT, PREEMPT, SERVED = FIXTURES / "light.jsonl", FIXTURES / "preempt.jsonl", FIXTURES / "served.jsonl"
RECORDINGS = pytest.mark.parametrize("path", [LIGHT, PREEMPT, SERVED], ids=["light", "preempt", "served"])


# ----------------------------------------------------------------------------- synthetic vLLM objects

def new_req(rid, computed):
    return SimpleNamespace(req_id=rid, num_computed_tokens=computed)


def sched_output(new, cached, scheduled):
    """A SchedulerOutput: new = [(rid, computed)], cached = [(rid, computed)], scheduled =
    {rid: tokens} in vLLM's scheduling order."""
    return SimpleNamespace(
        scheduled_new_reqs=[new_req(r, c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached],
                                              resumed_req_ids={"c"}),
        num_scheduled_tokens=dict(scheduled), total_num_scheduled_tokens=sum(scheduled.values()))


def test_step_decision_reads_starts_samples_blocks_and_order():
    # running "z" decodes, running "b" is mid-prefill, new "c" hits 32 cached tokens and
    # finishes its prompt, new "a" starts a prompt it cannot finish; vLLM scheduled them in
    # that order (the SchedulerOutput lists new requests before running ones)
    so = sched_output(new=[("c", 32), ("a", 0)], cached=[("z", 40), ("b", 16)],
                      scheduled={"z": 1, "b": 16, "c": 8, "a": 100})
    num_tokens = {"z": 41, "b": 64, "c": 40, "a": 300}
    blocks = {"z": 3, "b": 2, "c": 3, "a": 7}
    d = vr.step_decision(so, num_tokens, blocks, ["f", "e"], used_blocks=17)
    assert d["batch"] == [["z", 40, 1, 1, 3], ["b", 16, 16, 0, 2], ["c", 32, 8, 1, 3], ["a", 0, 100, 0, 7]]
    assert d["preempted"] == ["f", "e"]            # vLLM's order, not sorted
    assert (d["swap_out"], d["swap_in"], d["copy"], d["used_gpu_blocks"]) == (0, 0, 0, 17)
    extra = vr.step_extra(so, num_free_blocks=40)
    assert extra["new"] == ["c", "a"] and extra["prefix_hits"] == {"c": 32} and extra["resumed"] == ["c"]


def test_step_decision_names_a_request_it_cannot_place():
    so = sched_output(new=[], cached=[("a", 4)], scheduled={"a": 1, "zz": 3})
    with pytest.raises(ValueError, match="'zz'"):
        vr.step_decision(so, {"a": 5, "zz": 9}, {"a": 1, "zz": 1}, [], 1)


def test_finish_status_maps_vllm_request_statuses():
    assert vr.finish_status(SimpleNamespace(name="FINISHED_LENGTH_CAPPED")) == "length"
    assert vr.finish_status(SimpleNamespace(name="FINISHED_STOPPED")) == "stop"
    assert vr.finish_status(SimpleNamespace(name="FINISHED_ABORTED")) == "abort"


# ----------------------------------------------------------------------------- the patched scheduler

class FakeRequest:
    def __init__(self, rid, prompt, max_tokens):
        self.request_id, self.prompt_token_ids = rid, list(prompt)
        self.sampling_params = SimpleNamespace(max_tokens=max_tokens)
        self.arrival_time = 0.0                  # epoch seconds: long ago -> t_arrival clamps to 0
        self.output: list[int] = []
        self.num_computed_tokens = 0
        self.status = SimpleNamespace(name="RUNNING")

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output)

    @property
    def num_output_tokens(self):
        return len(self.output)

    @property
    def output_token_ids(self):
        return self.output


class FakeScheduler:
    """vLLM's Scheduler surface the recorder patches, with a tiny rule: block size 4, a
    budget of 6 tokens per step, running first; `victims` preempts by step number."""

    def __init__(self, victims=None):
        self.requests, self.running, self.waiting = {}, [], []
        self.victims = victims or {}
        self.steps = 0
        self.blocks: dict[str, int] = {}
        pool = SimpleNamespace(get_num_free_blocks=lambda: 20 - sum(self.blocks.values()))
        self.kv_cache_manager = SimpleNamespace(block_pool=pool, get_block_ids=lambda rid: ([0] * self.blocks[rid],))
        self.kv_cache_config = SimpleNamespace(num_blocks=21)

    def add_request(self, request):
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _preempt_request(self, request, timestamp):
        self.blocks.pop(request.request_id, None)
        request.num_computed_tokens = 0
        self.waiting.insert(0, request)

    def _free_request(self, request):
        self.blocks.pop(request.request_id, None)
        del self.requests[request.request_id]

    def schedule(self):
        for rid in self.victims.get(self.steps, ()):
            req = self.requests[rid]
            self.running.remove(req)
            self._preempt_request(req, 0.0)
        budget, sched, new, cached = 6, {}, [], []
        for req in list(self.running) + list(self.waiting):
            if budget == 0:
                break
            n = min(budget, req.num_tokens - req.num_computed_tokens)
            (cached if req in self.running else new).append((req.request_id, req.num_computed_tokens))
            sched[req.request_id] = n
            budget -= n
            req.num_computed_tokens += n
            self.blocks[req.request_id] = -(-req.num_computed_tokens // 4)
            if req in self.waiting:
                self.waiting.remove(req)
                self.running.append(req)
        self.steps += 1
        return sched_output(new, cached, sched)

    def update_from_output(self, so, model_output):
        for rid in so.num_scheduled_tokens:
            req = self.requests[rid]
            if req.num_computed_tokens == req.num_tokens:
                req.output.append(7)
                if len(req.output) == req.sampling_params.max_tokens:
                    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
                    self.running.remove(req)
                    self._free_request(req)
        return {}


def drive(victims=None, decode=None):
    cls = type("PatchedScheduler", (FakeScheduler,), {})
    rec = vr.Recorder(decode=decode)
    rec.install(cls)
    s = cls(victims)
    s.add_request(FakeRequest("warm", [1, 2], 1))       # recording off: not logged
    s.update_from_output(s.schedule(), None)
    rec.on = True
    s.add_request(FakeRequest("x", [1] * 5, 2))
    s.add_request(FakeRequest("y", [2] * 3, 2))
    while s.requests:
        s.update_from_output(s.schedule(), None)
    return rec


def test_recorder_logs_steps_arrivals_and_finishes_but_not_the_warmup():
    rec = drive()
    steps = [r for r in rec.records if r["kind"] == "step"]
    arrivals = [r for r in rec.records if r["kind"] == "arrival"]
    finishes = {r["req_id"]: r for r in rec.records if r["kind"] == "finish"}
    assert [a["req_id"] for a in arrivals] == ["x", "y"] and all(a["step"] == 0 for a in arrivals)
    assert arrivals[0]["prompt_token_ids"] == [1] * 5 and arrivals[0]["max_tokens"] == 2
    assert [s["step"] for s in steps] == list(range(len(steps)))
    # step 0: x's whole prompt (5, samples) + 1 token of y; step 1: x decodes, y's rest (2)
    assert steps[0]["decision"]["batch"] == [["x", 0, 5, 1, 2], ["y", 0, 1, 0, 1]]
    assert steps[1]["decision"]["batch"] == [["x", 5, 1, 1, 2], ["y", 1, 2, 1, 1]]
    assert steps[0]["vllm"]["new"] == ["x", "y"] and steps[1]["vllm"]["finished"] == ["x"]
    assert set(finishes) == {"x", "y"} and finishes["x"]["status"] == "length"
    assert finishes["x"]["num_output_tokens"] == 2
    used = [s["decision"]["used_gpu_blocks"] for s in steps]
    assert used[0] == 3                           # 21 blocks - null block - 17 free
    assert all(s["t_end"] >= s["t_start"] and s["step_s"] == pytest.approx(s["t_end"] - s["t_start"]) for s in steps)


def test_first_text_token_is_the_first_output_token_whose_text_shows():
    text = {1: "", 2: "Hi", 3: "\xe2", 4: "\u2014"}         # 1: a special token; 3 + 4: one character
    def decode(ids):
        out = "".join(text[t] for t in ids)
        return out.replace("\xe2\u2014", "\u2014") if "\xe2\u2014" in out else out.replace("\xe2", "\ufffd")
    assert vr.first_text_token(decode, [2, 1]) == 1
    assert vr.first_text_token(decode, [1, 1, 2]) == 3              # silent special tokens first
    assert vr.first_text_token(decode, [1, 3, 4, 2]) == 3           # not before the character is whole
    assert vr.first_text_token(decode, [1, 1]) is None
    assert vr.first_text_token(decode, []) is None


def test_recorder_finish_says_when_the_text_first_showed():
    rec = drive(decode=lambda ids: "a" * (len(ids) - 1))       # the first output token is silent
    finishes = {r["req_id"]: r for r in rec.records if r["kind"] == "finish"}
    assert finishes["x"]["first_text_token"] == 2 and finishes["y"]["first_text_token"] == 2
    rec = drive()                                               # no tokenizer: unknown
    assert all(r["first_text_token"] is None for r in rec.records if r["kind"] == "finish")


def test_recorder_loads_the_models_tokenizer_when_the_scheduler_is_built(monkeypatch, capsys):
    import transformers

    loaded = []

    class Tok:
        @staticmethod
        def decode(ids, skip_special_tokens):
            assert skip_special_tokens
            return "".join("" if t == 7 else "b" for t in ids)

    def from_pretrained(path):
        loaded.append(path)
        if path == "/models/missing":
            raise OSError("no such directory")
        return Tok()

    def scheduler_class(model, tokenizer):
        config = SimpleNamespace(model_config=SimpleNamespace(model=model, tokenizer=tokenizer))
        return type("PatchedScheduler", (FakeScheduler,), {"vllm_config": config})

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    rec = vr.Recorder()
    cls = scheduler_class("/models/m", "/models/tok")
    rec.install(cls)
    cls()
    cls()                                                       # loaded once, at the first build
    assert loaded == ["/models/tok"] and rec.decode([7, 8]) == "b"
    rec = vr.Recorder()
    cls = scheduler_class("/models/missing", None)             # no tokenizer path: the model's
    rec.install(cls)
    cls()
    assert loaded[-1] == "/models/missing" and rec.decode is None
    assert "first_text_token null" in capsys.readouterr().err


def test_recorder_logs_the_victims_of_the_step_that_preempted_them():
    cls = type("PatchedScheduler", (FakeScheduler,), {})
    rec = vr.Recorder()
    rec.install(cls)
    s = cls(victims={1: ["b", "a"]})
    rec.on = True
    for rid in ("a", "b", "c"):
        s.add_request(FakeRequest(rid, [3, 4], 3))
    while s.requests:
        s.update_from_output(s.schedule(), None)
    steps = [r for r in rec.records if r["kind"] == "step"]
    assert [st["decision"]["preempted"] for st in steps][:3] == [[], ["b", "a"], []]
    # c keeps running and decodes; the victims start over from token 0, their one output included
    assert steps[1]["decision"]["batch"] == [["c", 2, 1, 1, 1], ["a", 0, 3, 1, 1], ["b", 0, 2, 0, 1]]


def test_config_record_and_written_log_load_as_a_step_log(tmp_path):
    rec = drive()
    sc = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=64, enable_chunked_prefill=True,
                         long_prefill_token_threshold=0, max_num_partial_prefills=1, async_scheduling=False)
    rec.scheduler.scheduler_config = sc
    rec.scheduler.cache_config = SimpleNamespace(block_size=4, enable_prefix_caching=False)
    cfg = rec.config_record("0.32.0", ["python", "rec.py", "--x"], "/m")
    out = tmp_path / "log.jsonl"
    rec.write(str(out), cfg)
    config, arrivals, steps, finishes = load_log(str(out))
    assert config["cache"]["num_gpu_blocks"] == 20 and config["engine"] == "vllm"
    assert config["vllm"]["command"] == "python rec.py --x" and config["vllm"]["version"] == "0.32.0"
    assert len(arrivals) == 2 and len(finishes) == 2 and len(steps) == len(
        [r for r in rec.records if r["kind"] == "step"])


def _requests_file(tmp_path, items) -> str:
    path = tmp_path / "requests.json"
    path.write_text(json.dumps({"requests": items}))
    return str(path)


@pytest.mark.parametrize("steps, match", [
    ([0, -1], r"request 1: 'at_step' must be an integer >= 0, got -1"),
    ([0, True], r"request 1: 'at_step' must be an integer >= 0, got True"),
    ([0, None], r"1 of 2 requests have 'at_step': give it to every request or none"),
])
def test_a_requests_file_with_bad_arrival_steps_is_refused_with_where(tmp_path, steps, match):
    items = [{"prompt_token_ids": [1, 2], "max_tokens": 1, **({} if k is None else {"at_step": k})} for k in steps]
    with pytest.raises(ValueError, match=match):
        vr.read_requests(_requests_file(tmp_path, items))


class FakeEngine:
    """vLLM's LLMEngine as run_stepped drives it: each step decodes one token of every
    request in it; a request leaves when it has its max_tokens."""

    def __init__(self):
        self.live, self.log, self.steps = {}, [], 0

    def add_request(self, request_id, prompt, params):
        self.log.append((self.steps, request_id, len(prompt["prompt_token_ids"])))
        self.live[request_id] = params.max_tokens

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        assert self.live, "stepped with nothing to do"
        self.steps += 1
        self.live = {r: m - 1 for r, m in self.live.items() if m > 1}


def test_stepped_recording_adds_each_request_before_its_step_and_skips_idle_steps():
    reqs = [{"prompt_token_ids": [1] * 3, "max_tokens": 4, "at_step": 0},
            {"prompt_token_ids": [2] * 5, "max_tokens": 1, "at_step": 2},
            {"prompt_token_ids": [3] * 7, "max_tokens": 2, "at_step": 2},
            {"prompt_token_ids": [4] * 9, "max_tokens": 1, "at_step": 20, "req_id": "late"}]
    assert vr.arrival_plan(reqs) == [(0, [0]), (2, [1, 2]), (20, [3])]
    engine = FakeEngine()
    params = lambda rs: [SimpleNamespace(max_tokens=r["max_tokens"]) for r in rs]   # noqa: E731
    ran = vr.run_stepped(engine, reqs, params)
    # the engine's step count when each entered: 0, then 2 and 2 (while request 0 decodes),
    # then the idle engine's next step (4 steps ran: the plan's step 20 is the 5th)
    assert engine.log == [(0, "0", 3), (2, "1", 5), (2, "2", 7), (4, "late", 9)]
    assert engine.steps == 5 and ran == 21 and not engine.live


def test_recorder_places_an_arrival_between_a_schedule_and_an_update(tmp_path):
    """Under async scheduling vLLM schedules a step before the previous one lands: an arrival
    then records the batches scheduled and those landed, and the config says async."""
    cls = type("PatchedScheduler", (FakeScheduler,), {})
    rec = vr.Recorder()
    rec.install(cls)
    s = cls()
    rec.on = True
    s.add_request(FakeRequest("x", [1] * 10, 3))
    first = s.schedule()                        # x's first 6 prompt tokens
    second = s.schedule()                       # its last 4, before the first step lands
    s.add_request(FakeRequest("y", [2] * 3, 1))
    s.update_from_output(first, None)
    s.update_from_output(second, None)
    arrivals = {r["req_id"]: r for r in rec.records if r["kind"] == "arrival"}
    assert (arrivals["x"]["step"], arrivals["x"]["landed"]) == (0, 0)
    assert (arrivals["y"]["step"], arrivals["y"]["landed"]) == (2, 0)
    assert [r["step"] for r in rec.records if r["kind"] == "step"] == [0, 1]
    rec.scheduler.scheduler_config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=64,
                                                     enable_chunked_prefill=True, async_scheduling=True)
    rec.scheduler.cache_config = SimpleNamespace(block_size=4, enable_prefix_caching=False)
    cfg = rec.config_record("0.32.0", ["python", "rec.py"], "/m")
    assert cfg["scheduler"]["async_scheduling"] is True and cfg["vllm"]["async_scheduling"] is True


# ----------------------------------------------------------------------------- the committed recordings

def fixture(path: Path):
    if not path.is_file():
        pytest.fail(f"{path} is missing (tests/fixtures/vllm/README.md says how to record it)")
    return load_log(str(path))


@RECORDINGS
def test_recording_is_consistent_with_its_config(path):
    config, arrivals, steps, finishes = fixture(path)
    sc, cc = config["scheduler"], config["cache"]
    assert config["vllm"]["version"] and config["vllm"]["command"]
    sampled: dict[str, int] = {}
    for st in steps:
        batch = st["decision"]["batch"]
        assert sum(b[2] for b in batch) <= sc["max_num_batched_tokens"]
        assert len(batch) <= sc["max_num_seqs"]
        assert st["decision"]["used_gpu_blocks"] <= cc["num_gpu_blocks"]
        for rid, _start, _n, samples, nblocks in batch:
            sampled[rid] = sampled.get(rid, 0) + samples
            assert nblocks * cc["block_size"] >= _start + _n      # the table covers what is computed
    # every request sampled exactly the tokens it finished with (recomputation samples nothing extra)
    assert sampled == {rid: f["num_output_tokens"] for rid, f in finishes.items()}
    assert {a["req_id"] for a in arrivals} == set(finishes)


def test_the_served_recording_has_arrivals_between_steps():
    *_, arrivals, _steps, _ = fixture(SERVED)
    assert len({a["step"] for a in arrivals}) > 1      # Poisson arrivals: not all before the first step


def test_the_light_recording_has_no_preemption_and_the_queueing_one_has_some():
    *_, light_steps, _ = fixture(LIGHT)
    *_, pre_steps, _ = fixture(PREEMPT)
    assert not any(s["decision"]["preempted"] for s in light_steps)
    assert any(s["decision"]["preempted"] for s in pre_steps)


@RECORDINGS
def test_replay_of_a_vllm_recording_takes_vllms_decision_at_every_step(path):
    """The issue's target on a recorded vLLM run: the core with the vllm-v1 rules (the
    default for a vLLM log) schedules the same requests, token ranges, samples, block
    tables, preemptions and blocks in use at every step."""
    report = replay(str(path))
    assert "vllm-v1 rules" in report.engine and "log: vLLM 0.32.0" in report.engine
    assert report.equal, format_report(report)
    assert report.num_equal_steps == report.num_logged_steps > 0
    assert "nan" not in format_report(report)           # no CPU seconds in vLLM's log: no CPU split


def altered(tmp_path, path: Path, change) -> tuple[Path, int]:
    """A copy of the recording whose step k (chosen by `change(steps)`) was edited."""
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    k = change([r for r in recs if r["kind"] == "step"])
    out = tmp_path / f"altered-{path.name}"
    out.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return out, k


def test_replay_names_the_first_step_where_vllm_decided_otherwise(tmp_path):
    def more_tokens(steps):
        k = len(steps) // 2
        steps[k]["decision"]["batch"][0][2] += 1
        return k
    log, k = altered(tmp_path, LIGHT, more_tokens)
    report = replay(str(log))
    assert not report.equal and report.first_divergence["step"] == k
    assert report.num_equal_steps == report.num_logged_steps - 1        # only that step differs
    text = format_report(report)
    assert f"DIVERGE at step {k}" in text and "batch: real" in text


def test_replay_catches_a_preemption_the_core_did_not_make(tmp_path):
    def drop_preemption(steps):
        k = next(i for i, s in enumerate(steps) if s["decision"]["preempted"])
        steps[k]["decision"]["preempted"] = []
        return k
    log, k = altered(tmp_path, PREEMPT, drop_preemption)
    d = replay(str(log)).first_divergence
    assert d["step"] == k and d["sim"]["preempted"] and not d["real"]["preempted"]


# ----------------------------------------------------------------------------- `vllm serve`: live recording

FAKE_SCHEDULER = '''
from types import SimpleNamespace


class Scheduler:
    """The surface of vLLM's v1 Scheduler the recorder patches (one token per step)."""

    def __init__(self):
        self.requests, self.blocks = {}, {}
        self.scheduler_config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                                                enable_chunked_prefill=True)
        self.cache_config = SimpleNamespace(block_size=16, enable_prefix_caching=True)
        self.kv_cache_config = SimpleNamespace(num_blocks=10)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="/models/fake"))
        pool = SimpleNamespace(get_num_free_blocks=lambda: 9 - len(self.blocks))
        self.kv_cache_manager = SimpleNamespace(block_pool=pool, get_block_ids=lambda rid: ([1],))

    def add_request(self, request):
        self.requests[request.request_id] = request

    def _preempt_request(self, request, timestamp):
        pass

    def _free_request(self, request):
        del self.requests[request.request_id]

    def schedule(self):
        new = [SimpleNamespace(req_id=rid, num_computed_tokens=0) for rid in self.requests]
        for rid in self.requests:
            self.blocks[rid] = 1
        return SimpleNamespace(scheduled_new_reqs=new,
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                               num_scheduled_tokens={rid: 2 for rid in self.requests},
                               total_num_scheduled_tokens=2 * len(self.requests))

    def update_from_output(self, so, model_output):
        for rid in list(so.num_scheduled_tokens):
            self.requests[rid].num_output_tokens = 1
            self.requests[rid].status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
            self.blocks.pop(rid)
            self._free_request(self.requests[rid])
'''

SERVE_LIKE = '''
import time
from types import SimpleNamespace
from vllm.v1.core.sched.scheduler import Scheduler   # the sitecustomize's hook patches it on import

s = Scheduler()
s.add_request(SimpleNamespace(request_id="r1", prompt_token_ids=[5, 6], arrival_time=time.time(),
                              sampling_params=SimpleNamespace(max_tokens=1), num_tokens=2))
s.update_from_output(s.schedule(), None)
'''


def test_vllm_serve_recording_through_the_sitecustomize_hook(tmp_path):
    """The sitecustomize that `sim validate --real vllm` puts on vLLM's PYTHONPATH patches
    the scheduler class when its module is imported and writes the log live, config first
    (a stand-in vllm package: CI has no vLLM)."""
    import os
    import subprocess
    import sys

    from sim.twin import vllm_serve

    pkg = tmp_path / "fake" / "vllm" / "v1" / "core" / "sched"
    pkg.mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text('__version__ = "0.32.0-fake"\n')
    for d in ("v1", "v1/core", "v1/core/sched"):
        (tmp_path / "fake" / "vllm" / d / "__init__.py").write_text("")
    (pkg / "scheduler.py").write_text(FAKE_SCHEDULER)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(vllm_serve.SITECUSTOMIZE)
    log = tmp_path / "steps.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{tmp_path / 'fake'}", vllm_serve.LOG_ENV: str(log),
           vllm_serve.RECORDER_ENV: str(vllm_serve.RECORDER), vllm_serve.COMMAND_ENV: "vllm serve /models/fake"}
    r = subprocess.run([sys.executable, "-c", SERVE_LIKE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    config, arrivals, steps, finishes = load_log(str(log))
    assert config["vllm"]["version"] == "0.32.0-fake" and config["vllm"]["model"] == "/models/fake"
    assert config["vllm"]["command"] == "vllm serve /models/fake" and config["policies"]["scheduler"] == "vllm-v1"
    assert [a["req_id"] for a in arrivals] == ["r1"] and arrivals[0]["t_arrival"] <= arrivals[0]["t"]
    assert [s["decision"]["batch"] for s in steps] == [[["r1", 0, 2, 1, 1]]]
    assert finishes["r1"]["status"] == "length"


def test_validate_simulates_a_vllm_log_with_the_vllm_v1_rules():
    from sim.twin.validate import sim_config_from_log

    config, *_ = fixture(PREEMPT)
    policies = {"queue": "fcfs", "preemption": "recompute", "victim": "tail", "eviction": "lru",
                "scheduler": "vllm-v1"}
    sc = sim_config_from_log({**config, "policies": policies}, "cost.json")
    assert sc.scheduler == "vllm-v1" and sc.async_scheduling is False
    assert (sc.num_gpu_blocks, sc.block_size) == (config["cache"]["num_gpu_blocks"], config["cache"]["block_size"])
    # a log of an engine scheduling asynchronously (vLLM's default on GPUs) is simulated so
    asynchronous = {**config, "policies": policies, "scheduler": {**config["scheduler"], "async_scheduling": True}}
    assert sim_config_from_log(asynchronous, "cost.json").async_scheduling is True


def test_vllm_serve_command_keeps_host_and_port_its_own():
    from sim.twin.vllm_serve import vllm_serve_cmd

    cmd = vllm_serve_cmd("/venv/bin/python", "/m", 1234, ["--max-num-seqs", "8"])
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "1234"
    with pytest.raises(ValueError, match="--port"):
        vllm_serve_cmd("/venv/bin/python", "/m", 1234, ["--port=9"])


# ----------------------------------------------------------------------------- fitting on vLLM's steps

def test_fit_samples_count_the_gap_to_the_next_step_as_overhead():
    from core.cost.vllm_fit import fit_samples

    def step(t0, execute, step_s, batch):
        return {"t_start": t0, "t_end": t0 + step_s, "step_s": step_s, "execute_s": execute,
                "decision": {"batch": batch}}
    steps = [step(0.0, 0.08, 0.1, [["a", 0, 50, 1, 1]]),
             step(0.13, 0.02, 0.03, [["a", 50, 1, 1, 1]]),       # 0.03 s after the first ended
             step(5.0, 0.02, 0.03, [["a", 51, 1, 1, 1]]),        # the engine sat idle before it
             step(5.04, 0.02, 0.03, [["a", 52, 1, 1, 1]])]
    samples = fit_samples(steps)
    assert len(samples) == 2                     # the step before the idle gap and the last are left out
    assert samples[0]["execute_s"] == pytest.approx(0.08) and samples[0]["overhead_s"] == pytest.approx(0.05)
    assert (samples[0]["seqs"], samples[0]["tokens"]) == (1, 50)
    assert samples[1]["overhead_s"] == pytest.approx(0.01 + 0.01)


def test_fit_vllm_on_the_recordings_writes_a_cost_model_sim_reads(tmp_path):
    from core.cost.fitted import FittedCostModel
    from core.cost.vllm_fit import fit_logs

    model = fit_logs([str(LIGHT), str(PREEMPT)])
    assert model["engine"]["block_size"] == 128 and model["profile"]["engine"] == "vllm"
    path = tmp_path / "vllm-cost.json"
    path.write_text(json.dumps(model))
    FittedCostModel.from_file(str(path), None)         # the file `sim run --cost-model` loads
    with pytest.raises(ValueError, match="not a vLLM recording"):
        bad = tmp_path / "ours.jsonl"
        bad.write_text(LIGHT.read_text().replace('"engine":"vllm",', "", 1))
        fit_logs([str(bad)])
    # 24 short prompts at once: one prefill step; the error says how to record a fittable log
    with pytest.raises(ValueError, match=r"1 prefill steps, the fit needs at least 5 .*--max-num-batched-tokens"):
        fit_logs([str(LIGHT)])


def test_a_calibration_prices_a_vllm_logs_steps_to_the_next_schedule_as_its_fit_does(tmp_path):
    """`sim calibrate --real vllm` compares each served step with the model's price of it;
    a vLLM model (fit-vllm) prices a step up to the next step's schedule(), so the served
    side must be measured the same way, not by the schedule-to-update time alone."""
    from core.cost.fit import StepCostEvaluator
    from core.cost.step_log import loop_step_seconds
    from core.cost.vllm_fit import fit_logs, fit_samples
    from sim.twin.served_steps import log_step_rows

    model = fit_logs([str(PREEMPT), str(SERVED)])
    rows = log_step_rows(SERVED, StepCostEvaluator(model), "wall")
    _, arrivals, steps, _ = load_log(str(SERVED))
    timed = loop_step_seconds(steps, arrivals)
    assert len(rows) == len(timed) == len(fit_samples(steps, arrivals)) <= len(loop_step_seconds(steps)) < len(steps)
    assert [r.measured for r in rows] == pytest.approx([sec for _, sec in timed])
    assert [r.measured for r in rows] == pytest.approx([s["step_s"] for s in fit_samples(steps, arrivals)])
    assert any(sec > s["step_s"] for s, sec in timed)
    with pytest.raises(ValueError, match="wall seconds only"):
        log_step_rows(SERVED, StepCostEvaluator(model), "cpu")


@pytest.mark.parametrize("extra, message", [
    ([], "--real vllm needs --vllm-python"),
    (["--vllm-python", sys.executable], "--real vllm needs --model-dir"),
    (["--vllm-python", sys.executable, "--model-dir", "."], "give the calibration loads"),
    (["--vllm-python", sys.executable, "--model-dir", ".", "--load", "2:8", "--grid", "8:4:24"],
     "--grid serves runs for fitting vLLM's step costs: it needs --real vllm and no --cost-model"),
])
def test_calibrate_against_vllm_says_what_it_needs(extra, message, tmp_path, capsys):
    from core.cost.vllm_fit import fit_logs
    from sim.cli import main

    cost = tmp_path / "vllm-cost.json"
    cost.write_text(json.dumps(fit_logs([str(PREEMPT), str(SERVED)])))
    assert main(["calibrate", "traces/sharegpt.json", "--real", "vllm", "--cost-model", str(cost),
                 "--out", str(tmp_path / "out.json"), *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("grid, message", [
    ("8:4", "--grid '8:4': expected SEQS:STEPS:MAX_PROMPT[:ENGINE ARGS]"),
    ("0:4:24", "--grid '0:4:24': SEQS, STEPS and MAX_PROMPT must be >= 1"),
])
def test_a_malformed_grid_is_a_usage_error_that_says_the_form(grid, message, capsys):
    from sim.cli import main

    with pytest.raises(SystemExit) as e:
        main(["calibrate", "traces/sharegpt.json", "--grid", grid])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _bench_from_log(log: Path) -> dict:
    """A bench result consistent with a served log: each request's client saw its tokens 5 ms
    after the engine made them (the fields `sim calibrate` reads)."""
    from core.cost.step_log import sample_times

    _, arrivals, steps, _ = load_log(str(log))
    arrivals.sort(key=lambda a: a.get("t_arrival", a["t"]))
    times = sample_times(steps)
    out = {"ttfts": [], "itls": [], "input_lens": [], "output_lens": [], "errors": []}
    for a in arrivals:
        t, t0 = times[a["req_id"]], a.get("t_arrival", a["t"])
        out["ttfts"].append(t[0] - t0 + 0.005)
        out["itls"].append([b - a_ for a_, b in zip(t, t[1:])])
        out["input_lens"].append(len(a["prompt_token_ids"]))
        out["output_lens"].append(len(t))
        out["errors"].append("")
    return out


def test_calibrate_fits_vllms_step_costs_on_its_grid_runs_and_calibration_runs(tmp_path, capsys):
    """`sim calibrate --real vllm --grid ...` (here on runs already served: --reuse-real) fits
    on the grid run's steps and the calibration run's together."""
    from core.cost.vllm_fit import fit_samples
    from sim.cli import main

    work = tmp_path / "work"
    (work / "grid1").mkdir(parents=True)
    (work / "grid1" / "real1.steps.jsonl").write_text(PREEMPT.read_text())      # stands in for a grid run
    (work / "real1.steps.jsonl").write_text(SERVED.read_text())
    (work / "real1.bench.json").write_text(json.dumps(_bench_from_log(SERVED)))
    assert main(["calibrate", "traces/sharegpt.json", "--real", "vllm", "--vllm-python", sys.executable,
                 "--model-dir", ".", "--load", "2:16", "--grid", "8:4:24:--block-size 32", "--reuse-real",
                 "--work", str(work), "--out", str(tmp_path / "cal.json")]) == 0
    n = sum(len(fit_samples(*[load_log(str(p))[i] for i in (2, 1)])) for p in (PREEMPT, SERVED))
    assert f"fitted vLLM's step costs on {n} served steps of the 1 grid and calibration runs" in capsys.readouterr().out
    saved = json.loads((tmp_path / "cal.json").read_text())
    assert saved["calibration"]["grids"] == [{"grid": {"max_seqs": 8, "steps_per_size": 4, "max_prompt": 24},
                                              "engine_args": "--block-size 32"}]
    (work / "grid1" / "real1.steps.jsonl").unlink()
    assert main(["calibrate", "traces/sharegpt.json", "--real", "vllm", "--vllm-python", sys.executable,
                 "--model-dir", ".", "--load", "2:16", "--grid", "8:4:24", "--reuse-real",
                 "--work", str(work), "--out", str(tmp_path / "cal.json")]) == 2
    assert "--reuse-real: grid run 1 is not in" in capsys.readouterr().err
