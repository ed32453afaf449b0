"""--sim-first-token-no-text: a share of simulated requests starts with a special token that
has no text, as a real model's end-of-turn token (that ignore_eos runs past) does. The
real server then streams a request's first chunk one step later: the simulated server's
TTFT must see the same (SmolLM2 does it on about a fifth of the ShareGPT completions)."""
from __future__ import annotations

import pytest

from core import SamplingParams
from realexec.config import EngineArgs
from realexec.executor.simulated import FakeClock

from tests.realexec.executor.test_simulated import run, sim_engine

PROMPTS = [list(range(1000 + 50 * i, 1012 + 50 * i)) for i in range(200)]


def _first_text_step(engine, prompt, params) -> tuple[int, list[int]]:
    """(index of the first output with text, the request's tokens)."""
    rid = engine.add_request(prompt, params)
    step, first, tokens = 0, None, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                tokens = list(o.outputs[0].token_ids)
                if first is None and o.outputs[0].text_delta:
                    first = step
        step += 1
    return first, tokens


def test_every_request_starts_without_text_at_share_one():
    engine = sim_engine(FakeClock(), sim_first_token_no_text=1.0)
    silent = engine.executor.driver.no_text_token
    assert silent in engine.tokenizer.all_special_ids and silent != engine.eos_token_id
    assert engine.tokenizer.decode([silent], skip_special_tokens=True) == ""
    for params in (SamplingParams(max_tokens=6, temperature=0.0),              # no ignore_eos: still runs on
                   SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)):
        first, tokens = _first_text_step(engine, PROMPTS[0], params)
        assert first == 1 and len(tokens) == 6 and tokens[0] == silent
        assert silent not in tokens[1:]                                     # only the first token
    # a client that stops on that token id gets text from the first token on
    first, tokens = _first_text_step(engine, PROMPTS[0], SamplingParams(max_tokens=6, stop_token_ids=[silent]))
    assert first == 0 and silent not in tokens


def test_the_share_of_requests_is_seeded_per_request():
    share = 0.25
    engine = sim_engine(FakeClock(), sim_first_token_no_text=share)
    silent = engine.executor.driver.no_text_token
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = run(engine, [(p, greedy) for p in PROMPTS])
    firsts = [choices[0][0] for choices in outs.values()]
    late = sum(t == silent for t in firsts)
    assert 0.15 * len(PROMPTS) <= late <= 0.35 * len(PROMPTS)               # 200 draws at p = 0.25
    again = run(sim_engine(FakeClock(), sim_first_token_no_text=share), [(p, greedy) for p in PROMPTS])
    assert [c[0][0] for c in again.values()] == firsts                      # deterministic per prompt
    # the rest of a request's tokens are the ones it gets without the option
    plain = run(sim_engine(FakeClock()), [(p, greedy) for p in PROMPTS])
    for with_share, without in zip(outs.values(), plain.values()):
        assert with_share[0][0] in (silent, without[0][0])
    none = run(sim_engine(FakeClock()), [(p, greedy) for p in PROMPTS[:50]])
    assert all(c[0][0] != silent for c in none.values())


def test_listed_prompts_and_only_they_start_without_text(tmp_path):
    """--sim-first-token-no-text-prompts: a recorded run's silent starts replayed. The
    listed prompts (a text, tokenized as the server does, and a token-id list) start with
    the silent token, greedy or sampled; no other prompt does."""
    import json

    engine = sim_engine(FakeClock())
    text = "What are the best mods for ARK: Survival Evolved?"
    text_ids = list(engine.tokenizer(text).input_ids)
    listed = tmp_path / "silent.json"
    listed.write_text(json.dumps([text, PROMPTS[3]]))
    engine = sim_engine(FakeClock(), sim_first_token_no_text_prompts=str(listed))
    silent = engine.executor.driver.no_text_token
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [text_ids, PROMPTS[3]] + PROMPTS[4:40] + [PROMPTS[3][:-1]]
    outs = run(engine, [(p, greedy) for p in prompts])
    firsts = [choices[0][0] for choices in outs.values()]
    assert firsts[:2] == [silent, silent] and silent not in firsts[2:]
    sampled = run(engine, [(PROMPTS[3], SamplingParams(max_tokens=2, temperature=1.0, seed=7, ignore_eos=True))])
    assert [c[0][0] for c in sampled.values()] == [silent]


@pytest.mark.parametrize("content, match", [
    ("[\"a\", 3]", r"item 1 is neither a prompt text nor a non-empty list of token ids: 3"),
    ("[[]]", r"item 0 is neither"),
    ("{\"a\": 1}", r"expected a JSON list of prompts, got dict"),
    ("[1,", r"not JSON"),
    (None, r"cannot read it"),
])
def test_a_bad_prompt_list_is_refused_naming_the_file_and_item(tmp_path, content, match):
    path = tmp_path / "silent.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=r"--sim-first-token-no-text-prompts .*silent.json: " + match):
        sim_engine(FakeClock(), sim_first_token_no_text_prompts=str(path))


@pytest.mark.parametrize("kwargs, match", [
    (dict(simulate="roofline", sim_first_token_no_text=1.5), r"must be in \[0, 1\], got 1.5"),
    (dict(simulate="roofline", sim_first_token_no_text=-0.1), r"must be in \[0, 1\], got -0.1"),
    (dict(sim_first_token_no_text=0.2), r"--sim-first-token-no-text only applies with --simulate"),
    (dict(sim_first_token_no_text_prompts="x.json"), r"--sim-first-token-no-text-prompts only applies with --simulate"),
    (dict(simulate="roofline", sim_first_token_no_text=0.2, sim_first_token_no_text_prompts="x.json"),
     r"give --sim-first-token-no-text \(a share of requests\) or --sim-first-token-no-text-prompts"),
])
def test_bad_shares_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs).validate()
