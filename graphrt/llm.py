"""``graphrt.LLM``: load a model once, then generate for batches of prompts."""

from __future__ import annotations

import numbers
from collections.abc import Sequence as SequenceABC

from graphrt.base.errors import GraphrtError, InvalidRequestError
from graphrt.config import EngineConfig
from graphrt.engine import LLMEngine
from graphrt.loader.tokenizer import Tokenizer
from graphrt.outputs import RequestOutput
from graphrt.sampling.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Offline generation over the engine.

    >>> llm = LLM(model="random:tiny", device="cpu")
    >>> [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    >>> len(out.token_ids)
    4

    ``model``: an HF directory, a ``.gguf`` file, ``random:PRESET``, or None for the default
    SmolLM2-135M-Instruct GGUF. Other keyword arguments are ``EngineConfig`` fields.

    ``close()`` frees the weights, the KV cache and the decode graphs' memory at once (``with LLM(...)
    as llm:`` closes on leaving the block); an ``LLM`` nobody references is freed by garbage collection.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str | None = "auto",
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        block_size: int = 16,
        enforce_eager: bool = False,
        progress: bool = True,
        **engine_options,
    ) -> None:
        config = EngineConfig(
            model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            block_size=block_size, enforce_eager=enforce_eager, **engine_options,
        )
        self.engine = LLMEngine(config, progress=progress)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def close(self) -> None:
        """Free the model's device memory now (``LLMEngine.close``); the ``LLM`` is unusable after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of either); returns one
        finished output per prompt, in order. An invalid request gets ``finish_reason="error"`` and an
        ``error`` message while the others still run."""
        if self.engine.closed:
            raise GraphrtError("this LLM is closed")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        results: list[RequestOutput | None] = [None] * len(prompts)
        pending: dict[str, int] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                pending[self.engine.add_request(prompt, p)] = index
            except GraphrtError as exc:
                results[index] = self.engine.error_output(prompt, exc, request_id=f"rejected-{index}")
        unfinished = len(pending)
        while unfinished:
            for output in self.engine.step():
                # Requests added through the engine directly may share these steps: not ours to return.
                if output.finished and output.request_id in pending:
                    results[pending[output.request_id]] = output
                    unfinished -= 1
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: str | list[str],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to user messages, each wrapped in the model's chat template."""
        messages = [messages] if isinstance(messages, str) else list(messages)
        return self.generate([self.chat_prompt_ids(m) for m in messages], sampling_params)

    def chat_prompt_ids(self, user_message: str) -> list[int]:
        """Token ids of one user turn rendered through the chat template, ready for the assistant."""
        if self.tokenizer is None:
            raise GraphrtError("this model has no tokenizer, so it has no chat template")
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": user_message}])
        return self.tokenizer.encode(rendered, add_special_tokens=False)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids (any integer type: NumPy's too)
    return list(prompts)


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"{len(params)} sampling params given for {count} prompts")
    return params
