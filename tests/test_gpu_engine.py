"""On a CUDA device: the engine (both attention backends, fused and unfused kernels) against HF
transformers on the same GPU, and the fused kernels against the unfused path.

float32 must match as tightly as on the CPU; bfloat16 is judged by bf16 tolerances, and the measured
agreement (greedy tokens equal to HF's, largest logit difference) is recorded as test properties and
printed, so a run with ``-s`` or ``--junitxml`` carries the figures.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from graphrt import LLM, SamplingParams  # noqa: E402
from hf_reference import graphrt_greedy_with_logits, hf_greedy, hf_step_logits  # noqa: E402
from random_checkpoints import NAMES, random_prompts, write_random_checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW_TOKENS = 24
#: bf16 keeps 8 mantissa bits: logits of magnitude ~10 carry ~0.05 of rounding, more after two layers.
BF16_LOGIT_TOLERANCE = 0.25


@pytest.fixture(scope="module", params=NAMES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_random_checkpoint(request.param, path)


def _first_divergence(ours: list[int], theirs: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


@pytest.mark.parametrize("backend,kernels", [("reference", "unfused"), ("triton", "unfused"), ("triton", "fused")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_engine_agrees_with_hf(checkpoint, dtype, backend, kernels, record_property):
    name, path, cpu_model = checkpoint
    hf_model = cpu_model.to("cuda", dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    # A fixed cache: engines of earlier tests still hold theirs, and a memory fraction would see that.
    options = dict(dtype=dtype_name, device="cuda", attention_backend=backend, progress=False, max_model_len=256,
                   num_kv_blocks=512, max_num_seqs=8, fused_kernels=kernels == "fused")
    llm = LLM(str(path), **options)  # decodes through CUDA graphs
    # Logits are read by wrapping compute_logits, which a graph replay never calls: an eager twin.
    eager_llm = LLM(str(path), **options, enforce_eager=True)
    prompts = random_prompts(seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)

    tokens_equal = tokens_total = 0
    max_logit_diff = 0.0
    for prompt, out in zip(prompts, outputs):
        reference = hf_greedy(hf_model, prompt, NEW_TOKENS)
        tokens_equal += _first_divergence(out.token_ids, reference)
        tokens_total += NEW_TOKENS
        # Logits compared teacher-forced on our own tokens, step by step.
        tokens, ours = graphrt_greedy_with_logits(eager_llm, prompt, NEW_TOKENS)
        theirs = hf_step_logits(hf_model, prompt, tokens)
        max_logit_diff = max(max_logit_diff, (ours - theirs).abs().max().item())
        best = theirs.max(dim=-1).values
        chosen = theirs.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        if dtype == torch.float32:
            tolerance = 1e-3 if backend == "reference" else 0.05  # Triton's float32 dots use tf32
        else:
            tolerance = BF16_LOGIT_TOLERANCE
        assert (best - chosen).max().item() <= tolerance, "chose a token HF ranks clearly below its best"

    agreement = tokens_equal / tokens_total
    record_property("token_agreement", agreement)
    record_property("max_logit_diff", max_logit_diff)
    print(f"\n[{name} {dtype_name} {backend} {kernels}] greedy tokens equal to HF before first divergence: "
          f"{tokens_equal}/{tokens_total} ({agreement:.1%}); largest logit difference {max_logit_diff:.4g}")
    if dtype == torch.float32 and backend == "reference":
        assert agreement == 1.0
        assert max_logit_diff < 1e-3
    elif dtype == torch.float32:  # Triton's float32 dots run in tf32
        assert max_logit_diff < 0.05
    else:
        assert max_logit_diff < BF16_LOGIT_TOLERANCE * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_kernels_agree_with_unfused(checkpoint, dtype, record_property):
    """Greedy tokens through CUDA graphs, fused against unfused (Triton attention both), and the
    largest logit difference of their eager twins, teacher-forced on the unfused tokens."""
    name, path, _ = checkpoint
    dtype_name = str(dtype).removeprefix("torch.")
    options = dict(dtype=dtype_name, device="cuda", attention_backend="triton", progress=False, max_model_len=256,
                   num_kv_blocks=512, max_num_seqs=8)
    prompts = random_prompts(seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens, logits = {}, {}
    for fused in (False, True):
        llm = LLM(str(path), **options, fused_kernels=fused)
        tokens[fused] = [out.token_ids for out in llm.generate(prompts, params)]
        eager = LLM(str(path), **options, fused_kernels=fused, enforce_eager=True)
        logits[fused] = [graphrt_greedy_with_logits(eager, p, NEW_TOKENS) for p in prompts]
        del llm, eager
    equal = sum(_first_divergence(a, b) for a, b in zip(tokens[True], tokens[False]))
    total = NEW_TOKENS * len(prompts)
    max_diff = 0.0
    for (fused_tokens, fused_logits), (unfused_tokens, unfused_logits) in zip(logits[True], logits[False]):
        same = _first_divergence(fused_tokens, unfused_tokens)  # logits are comparable up to a divergence
        max_diff = max(max_diff, (fused_logits[: same + 1] - unfused_logits[: same + 1]).abs().max().item())
    record_property("token_agreement", equal / total)
    record_property("max_logit_diff", max_diff)
    print(f"\n[{name} {dtype_name}] fused vs unfused greedy tokens equal before first divergence: "
          f"{equal}/{total}; largest logit difference {max_diff:.4g}")
    if dtype == torch.float32:
        assert equal == total
        assert max_diff < 0.05  # both sides' attention dots run in tf32
    else:
        assert max_diff < BF16_LOGIT_TOLERANCE
