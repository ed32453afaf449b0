"""The one stop check: does a sequence end after appending `token`?

Used by every path that appends tokens (the scheduler's single- and multi-sample
updates, beam search's candidates and its length limit), so the rules live once:
  * EOS (unless ignore_eos) or a stop token id ends it as STOPPED, but only once
    min_tokens outputs exist;
  * max_tokens outputs or max_model_len tokens end it as LENGTH.
Stop *strings* need detokenized text and are applied by the layer that has it.
"""
from __future__ import annotations

from core.sched.request import RequestStatus
from core.sampling_params import SamplingParams

STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH


def stop_status(params: SamplingParams, eos_token_id: int | None, token: int | None, num_output_tokens: int,
                num_tokens: int, max_model_len: int) -> RequestStatus | None:
    """The finish status of a sequence whose last token is `token` (None: check only the
    length limits), with `num_output_tokens` outputs and `num_tokens` tokens in all."""
    if token is not None and ((token == eos_token_id and not params.ignore_eos) or token in params.stop_token_ids) \
            and num_output_tokens >= params.min_tokens:
        return STOPPED
    max_tokens = params.max_tokens
    if (max_tokens is not None and num_output_tokens >= max_tokens) or num_tokens >= max_model_len:
        return LENGTH
    return None
