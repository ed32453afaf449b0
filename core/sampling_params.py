"""Per-request generation parameters (what an OpenAI client or a trace asks for)."""
from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
# temperature near 1e-38 overflows float32 to inf, whose softmax is NaN (every draw token 0).
SAMPLING_EPS = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine refuses up front; the message says why, `param` names the
    offending field (an OpenAI error's `param`) when one field is to blame."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1                       # parallel samples sharing the prompt (forked after prefill)
    beam_width: int = 0              # > 0: beam search with this many beams (n must be 1)
    length_penalty: float = 1.0      # beam score = cum_logprob / len ** length_penalty
    max_tokens: int | None = 16      # None: until max_model_len
    min_tokens: int = 0              # stop conditions are ignored before this many tokens
    temperature: float = 1.0         # 0 (or below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0                   # 0 = disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)           # applied by the detokenizing layer
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None      # return this many top logprobs per token
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None    # requests share cached prefix blocks only with the same salt

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 0

    @property
    def is_greedy(self) -> bool:
        """Argmax sampling: a temperature below SAMPLING_EPS, or top_k = 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}", name)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not isinstance(self.beam_width, int) or self.beam_width < 0:
            bad("beam_width", "must be an integer >= 0")
        if self.beam_width and self.n != 1:
            bad("n", "beam search returns beam_width sequences; n must be 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None for 'until the context is full')")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be in [0, max_tokens]")
        if not (0.0 <= self.temperature < float("inf")):
            bad("temperature", "must be a finite number >= 0")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            bad("seed", "must be a 64-bit signed integer")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.stop and self.beam_width:
            # Beams are reshuffled every step and detokenized only at the end (as in vLLM,
            # whose beam search does not take stop strings either): refuse, never ignore.
            bad("stop", "stop strings are not supported with beam search")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt", "must be a non-empty string")

    @property
    def num_seqs_max(self) -> int:
        """Most sequences this request can hold at once (bounds its KV demand)."""
        return self.beam_width or self.n
