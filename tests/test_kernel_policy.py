"""The kernel policy a model is built with: chosen once from the measured GEMV bounds, refused where
its options contradict each other, and the one place a model's token choice is made."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphrt.attention.reference import ReferenceAttentionBackend
from graphrt.loader.random_presets import PRESETS
from graphrt.models.kernel_policy import GEMV_THRESHOLDS, KernelPolicy, layer_weight_bytes
from graphrt.models.llama import LlamaForCausalLM
from graphrt.sampling.params import SamplingParams
from graphrt.sampling.sampler import SamplingTensors, sample


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m", "llama-3.2-1b", "llama-3-8b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_bytes_are_the_built_layers_weights(preset, dtype):
    model = LlamaForCausalLM(PRESETS[preset], ReferenceAttentionBackend, 64, dtype, "meta")
    layer = model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert layer_weight_bytes(PRESETS[preset], dtype) == sum(linear.weight.nbytes for linear in linears)


def test_the_bounds_come_from_the_thresholds_given():
    config = PRESETS["smollm2-135m"]
    size = layer_weight_bytes(config, torch.bfloat16)
    tight = dataclasses.replace(GEMV_THRESHOLDS, max_layer_bytes=size - 1, max_dependent_layer_bytes=size,
                                small_layer_bytes=size - 1)
    assert KernelPolicy.choose(config, torch.bfloat16, True, thresholds=tight).gemv_max_tokens == 0
    assert KernelPolicy.choose(config, torch.bfloat16, True, True, thresholds=tight).gemv_max_tokens == 1
    small = dataclasses.replace(tight, small_layer_bytes=size, rows_max_tokens=16)
    policy = KernelPolicy.choose(config, torch.bfloat16, True, True, thresholds=small)
    assert policy.gemv_max_tokens == 4 and policy.gemv_rows_max_tokens == 16
    assert [policy.runs_gemv_rows(n) for n in (1, 4, 5, 16, 17)] == [False, False, True, True, False]
    assert KernelPolicy.choose(config, torch.bfloat16, True, True, thresholds=small,
                               quantization="fp8").gemv_rows_max_tokens == 0  # 16-bit weights only
    assert "H200" in GEMV_THRESHOLDS.measured_on and "profiles/notes" in GEMV_THRESHOLDS.measured_on


def test_the_rows_kernel_takes_16bit_layers_from_the_measured_size():
    """Fused 16-bit layers of at least rows_kernel_min_layer_bytes (the 1B's, the 8B's) run 2-16 tokens on
    the rows kernel; SmolLM2's smaller ones, float32 and FP8 layers and unfused models never."""
    assert GEMV_THRESHOLDS.rows_kernel_max_tokens == 16
    for preset, expected in (("llama-3.2-1b", 16), ("llama-3-8b", 16), ("smollm2-135m", 0), ("tiny", 0)):
        assert KernelPolicy.choose(PRESETS[preset], torch.bfloat16, True, True).rows_kernel_max_tokens == expected
    assert KernelPolicy.choose(PRESETS["llama-3.2-1b"], torch.bfloat16, False).rows_kernel_max_tokens == 0
    assert KernelPolicy.choose(PRESETS["llama-3.2-1b"], torch.float16, True).rows_kernel_max_tokens == 16
    assert KernelPolicy.choose(PRESETS["llama-3.2-1b"], torch.float32, True).rows_kernel_max_tokens == 0  # unmeasured
    assert KernelPolicy.choose(PRESETS["llama-3.2-1b"], torch.bfloat16, True, True,
                               quantization="fp8").rows_kernel_max_tokens == 0
    with pytest.raises(ValueError, match="rows kernel for 16-bit layers needs fused_kernels"):
        KernelPolicy(fused=False, rows_kernel_max_tokens=16)
    with pytest.raises(ValueError, match="rows kernel for 16-bit layers needs fused_kernels"):
        KernelPolicy(fused=True, quantization="fp8", rows_kernel_max_tokens=16)


def test_contradicting_options_are_refused():
    with pytest.raises(ValueError, match="dependent_launch needs fused_kernels"):
        KernelPolicy(fused=False, dependent_launch=True)
    with pytest.raises(ValueError, match="GEMV layers need fused_kernels"):
        KernelPolicy(fused=False, gemv_max_tokens=1)
    with pytest.raises(ValueError, match="dependent_launch needs fused_kernels"):
        KernelPolicy.choose(PRESETS["tiny"], torch.float32, False, True)
    with pytest.raises(ValueError, match="few-row GEMV layers need the GEMV layers and 16-bit weights"):
        KernelPolicy(fused=True, gemv_rows_max_tokens=16)


@pytest.mark.parametrize("tokens,runs", [(0, False), (1, True), (2, False)])
def test_gemv_layers_run_for_one_token_only(tokens, runs):
    assert KernelPolicy(fused=True, gemv_max_tokens=1).runs_gemv(tokens) is runs
    assert KernelPolicy(fused=True).runs_gemv(tokens) is False


def test_unfused_sampling_is_the_sorting_sampler_into_out():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 97, generator=generator)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=7),
              SamplingParams(temperature=1.1, top_p=0.6), SamplingParams(temperature=0.5), SamplingParams()]
    rows = SamplingTensors.from_params(params, seeds=[11, 12, 13, 14, 15], steps=[0, 1, 2, 3, 4],
                                       device=torch.device("cpu"))
    out = torch.full((5,), -7, dtype=torch.int64)
    policy = KernelPolicy()
    assert policy.sample(logits, rows, out=out) is out
    assert torch.equal(out, sample(logits, rows))
    assert torch.equal(policy.sample(logits, rows), out)
