"""Logprobs on CUDA: computed inside the decode graphs (the "logprobs" graph mode), against HF
transformers' float32 log_softmax on the same GPU, against eager decode, and without changing any
row's tokens (random checkpoints written by transformers)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("transformers")

from random_checkpoints import random_prompts, write_random_checkpoint  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402

#: Largest |graphrt - HF float32| logprob (measured on the H200: 4.4e-6 in float32; 0.080 in bfloat16,
#: which rounds the hidden states).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.2}
#: Largest |graphs - eager| logprob (measured: 1.4e-6 in float32, 0 in bfloat16; the eager decode bounds
#: attention by the batch's longest row, so its splits, and their sums' order, may differ).
GRAPHS_VS_EAGER = {"float32": 1e-5, "bfloat16": 0.05}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    return path, write_random_checkpoint("llama3-rope-scaling", path).to("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_logprobs_match_hf_and_eager(checkpoint, dtype, record_property):
    path, hf_model = checkpoint
    prompts = random_prompts(seed=3, lengths=(5, 17, 33))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=2)
    options = dict(dtype=dtype, device="cuda", progress=False, max_model_len=256, num_kv_blocks=256, max_num_seqs=8)
    outputs = {}
    for mode in ("graphs", "eager"):
        with LLM(str(path), enforce_eager=mode == "eager", **options) as llm:
            outputs[mode] = llm.generate(prompts, params)
            if mode == "graphs":
                assert sum(llm.engine.decode_runner.stats.replays_per_bucket.values()) > 0
    worst_hf = worst_eager = 0.0
    for prompt, graphs, eager in zip(prompts, outputs["graphs"], outputs["eager"]):
        assert graphs.token_ids == eager.token_ids
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + graphs.token_ids], device="cuda")).logits[0].double()
        reference = torch.log_softmax(logits, dim=-1)[:-1]
        entries = graphs.prompt_logprobs[1:] + graphs.logprobs
        sequence = prompt + graphs.token_ids
        for position, entry in enumerate(entries):
            worst_hf = max(worst_hf, abs(entry.logprob - reference[position, sequence[position + 1]].item()))
        for ours, theirs in zip(graphs.logprobs, eager.logprobs):
            worst_eager = max(worst_eager, abs(ours.logprob - theirs.logprob))
            assert ours.rank == theirs.rank == 1  # greedy tokens
            assert len(ours.top) == 5
    record_property("worst_vs_hf", worst_hf)
    record_property("worst_graphs_vs_eager", worst_eager)
    print(f"\n[{dtype}] logprobs: largest difference to HF float32 {worst_hf:.3g}, graphs vs eager {worst_eager:.3g}")
    assert worst_hf <= TOLERANCE[dtype]
    assert worst_eager <= GRAPHS_VS_EAGER[dtype]


def test_asking_for_logprobs_changes_no_token_on_the_fused_samplers(checkpoint):
    """Greedy, temperature and top-p rows decode through the "logprobs" graphs (the fused top-k / top-p
    kernels) exactly as through their own graphs (argmax, temperature race, threshold search)."""
    path, _ = checkpoint
    kinds = [dict(temperature=0), dict(temperature=0.8, seed=4), dict(temperature=1.0, top_p=0.7, seed=5)]
    prompts = random_prompts(seed=9, lengths=(4, 9, 16))
    with LLM(str(path), device="cuda", dtype="bfloat16", progress=False, max_model_len=256, num_kv_blocks=256) as llm:
        for kind in kinds:  # a batch of one kind replays that kind's own graphs
            plain = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, **kind))
            asked = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1, **kind))
            assert [o.token_ids for o in plain] == [o.token_ids for o in asked], kind
