"""LLM: offline batch generation over LLMEngine (all requests in, step until done).

    llm = LLM()                                         # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=16))
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""
from __future__ import annotations

from core import InvalidRequestError, SamplingParams
from realexec.config import EngineArgs
from realexec.engine.llm_engine import LLMEngine, RequestOutput

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def sleep(self, level: int = 1) -> int:
        """See LLMEngine.sleep: -> bytes of device memory released."""
        return self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = False) -> list[RequestOutput]:
        """Final RequestOutputs in input order. A single str or a flat list of token ids is
        one prompt. For beam search a request's outputs are its beams, best first.
        ``use_tqdm``: a bar of output tokens on stderr (None: only on a terminal)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | None = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them; each is
        rendered with the tokenizer's chat template, ready for the assistant's reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([self.engine.encode_chat(c) for c in conversations], sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], sampling_params, use_tqdm: bool | None = False) -> list[RequestOutput]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        engine = self.engine
        if engine.is_sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() before generating")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p))
        except Exception:
            for rid in ids:                       # all or nothing: the engine stays clean
                engine.abort_request(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        wanted = set(ids)
        progress = None
        if use_tqdm is not False:
            from realexec.progress import TokenProgress, bar
            caps = [p.max_tokens for p in params]           # None: up to max_model_len, total unknown
            total = None if None in caps else sum(caps)
            progress = TokenProgress(bar(total, "generating", "tok", use_tqdm))
        try:
            while len(finals) < len(ids):
                outputs = engine.step()
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                if progress is not None:
                    progress.update(outputs)
        finally:
            if progress is not None:
                progress.close()
        return [finals[rid] for rid in ids]
