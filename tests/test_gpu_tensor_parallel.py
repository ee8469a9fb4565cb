"""On two CUDA GPUs: tensor parallelism over NCCL with the all-reduces inside the captured decode and
prompt graphs. Two ranks give one rank's tokens in float32 (random checkpoints written by transformers;
greedy and seeded; pipelined steps, graphs against eager), and in bfloat16 the same greedy tokens up
to the first step whose top two logits are within rounding of each other (that step's margin is
recorded). Skips without two GPUs (the ``tensor-parallel`` stage of ``gpu_stages.sh``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from random_checkpoints import NAMES, write_random_checkpoint  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33, 70)]
REQUESTS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=24, ignore_eos=True)]


def _generate(path, tp: int, dtype: str, **options):
    with LLM(str(path), dtype=dtype, device="cuda", tensor_parallel_size=tp, progress=False, max_num_seqs=16,
             **options) as llm:
        if tp > 1:
            assert llm.engine.model.config.num_attention_heads * tp == llm.engine.model_config.num_attention_heads
        return llm.generate([p for p in PROMPTS for _ in REQUESTS], [r for _ in PROMPTS for r in REQUESTS])


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", NAMES)
def test_two_gpus_give_one_gpus_tokens_in_float32(name, enforce_eager, tmp_path):
    write_random_checkpoint(name, tmp_path)
    one = _generate(tmp_path, 1, "float32", enforce_eager=enforce_eager)
    two = _generate(tmp_path, 2, "float32", enforce_eager=enforce_eager)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one[::2], two[::2]):
        assert [x.logprob for x in b.logprobs] == pytest.approx([x.logprob for x in a.logprobs], abs=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_two_gpus_in_bfloat16_agree_up_to_a_near_tie(name, tmp_path, record_property):
    """bf16 partial sums are added in another order over two ranks: greedy tokens agree until a step
    whose top-two logprob margin (one rank's) is within bf16 rounding of the logits (0.1)."""
    write_random_checkpoint(name, tmp_path)
    one = _generate(tmp_path, 1, "bfloat16")
    two = _generate(tmp_path, 2, "bfloat16")
    for a, b in zip(one[::2], two[::2]):
        for step, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                entry = a.logprobs[step]
                margin = entry.top[0][1] - entry.top[1][1]
                record_property(f"flip_margin_{a.request_id}", margin)
                assert margin < 0.1, f"{a.request_id}: step {step} flipped with a margin of {margin}"
                break
