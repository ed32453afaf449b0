"""The one stop check (core.sched.stop) every token-appending path uses."""
from __future__ import annotations

from core import RequestStatus, SamplingParams
from core.sched.stop import stop_status

EOS = 2
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def check(token, num_out, num_tokens=100, max_model_len=1000, **params):
    return stop_status(SamplingParams(**params), EOS, token, num_out, num_tokens, max_model_len)


def test_eos_and_stop_tokens_stop_only_after_min_tokens():
    assert check(EOS, 3, max_tokens=10) is STOPPED
    assert check(EOS, 3, max_tokens=10, min_tokens=4) is None
    assert check(EOS, 4, max_tokens=10, min_tokens=4) is STOPPED
    assert check(7, 2, max_tokens=10, stop_token_ids=[7]) is STOPPED
    assert check(7, 2, max_tokens=10, stop_token_ids=[7], min_tokens=3) is None
    assert check(EOS, 3, max_tokens=10, ignore_eos=True) is None


def test_length_limits():
    assert check(5, 10, max_tokens=10) is LENGTH
    assert check(5, 9, max_tokens=10) is None
    assert check(5, 9, max_tokens=None, num_tokens=1000) is LENGTH
    assert check(None, 10, max_tokens=10) is LENGTH            # length only (beam search)
    assert check(None, 3, max_tokens=10) is None
    # A stop token on the last allowed token is a stop, not a length finish.
    assert check(EOS, 10, max_tokens=10) is STOPPED
    # min_tokens never extends past max_tokens.
    assert check(EOS, 10, max_tokens=10, min_tokens=10) is STOPPED
