"""FP8 checkpoints, written here in each format graphrt reads, against HF transformers.

Each test checkpoint is a random transformers Llama (random_checkpoints.py) whose decoder linears are
replaced by FP8 E4M3 codes with scales in one format: transformers' fine-grained FP8 (128 x 128 blocks
of ``weight_scale_inv``), per-tensor ``weight_scale`` (vLLM-style tools, with static ``input_scale``),
compressed-tensors float8 per channel and per (odd-sized) block. The reference is transformers running
the dequantised weights (codes x scales, float32); where transformers reads the FP8 checkpoint itself
(fine-grained FP8, which it dequantises on a CPU), its logits too. float32 on CPU, where graphrt's FP8
layers dequantise exactly: logits agree to float32 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from fp8_checkpoint_files import FORMATS, write_fp8_checkpoint  # noqa: E402
from hf_reference import graphrt_greedy_with_logits, hf_step_logits  # noqa: E402
from random_checkpoints import random_prompts, write_random_checkpoint  # noqa: E402

from graphrt import LLM, ModelLoadError  # noqa: E402
from graphrt.models.fp8 import FP8_DTYPE, Fp8Linear  # noqa: E402
from graphrt.sampling.params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    return path, write_random_checkpoint("llama3-rope-scaling", path)


def _reference_model(hf_model, meaning):
    """The HF model with the dequantised weights in place of its own."""
    import copy

    model = copy.deepcopy(hf_model)
    model.load_state_dict(meaning, strict=False)
    return model


@pytest.mark.parametrize("form", list(FORMATS))
def test_fp8_checkpoints_load_as_stored_and_match_hf_on_their_dequantised_weights(source, tmp_path, form):
    path, hf_model = source
    meaning = write_fp8_checkpoint(path, tmp_path / form, form)
    reference = _reference_model(hf_model, meaning)
    with LLM(str(tmp_path / form), dtype="float32", device="cpu", progress=False) as llm:
        assert llm.engine.quantization == "fp8"  # FP8 without being asked
        model = llm.engine.model
        layer = model.layers[0].self_attn.qkv_proj
        assert isinstance(layer, Fp8Linear) and layer.weight.dtype == FP8_DTYPE
        # Block scales keep their blocks (one scale a row and block of columns); the others one a row.
        blocks = FORMATS[form][1]
        assert layer.scale_columns == (blocks[1] if isinstance(blocks, tuple) else None)
        q = meaning["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(layer.dequantized_weight(torch.float32)[:q.shape[0]], q)
        prompt = random_prompts(seed=3)[3]
        tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    torch.testing.assert_close(ours, hf_step_logits(reference, prompt, tokens), rtol=1e-4, atol=1e-4)


def test_transformers_loading_a_fine_grained_fp8_checkpoint_agrees_with_graphrt(source, tmp_path):
    """transformers reads the fine-grained FP8 checkpoint itself (on a CPU it dequantises the blocks);
    graphrt's logits on the same file agree with its own."""
    import transformers

    path, _ = source
    write_fp8_checkpoint(path, tmp_path / "fp8", "fine-grained-fp8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    assert any(p.dtype == torch.float32 for p in hf.parameters())
    with LLM(str(tmp_path / "fp8"), dtype="float32", device="cpu", progress=False) as llm:
        prompt = random_prompts(seed=5)[2]
        tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    theirs = hf_step_logits(hf, prompt, tokens)
    # transformers dequantises into bfloat16 weights: agreement within their rounding.
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_kv_cache_scales_come_from_the_checkpoint(source, tmp_path):
    path, _ = source
    write_fp8_checkpoint(path, tmp_path / "kv", "per-tensor-fp8", kv_scales=True)
    with LLM(str(tmp_path / "kv"), dtype="float32", device="cpu", kv_cache_dtype="fp8", progress=False) as llm:
        scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in llm.engine.model.layers]
        assert scales == [(0.5, 0.25), (1.5, 0.25)]
        assert all(cache.dtype == FP8_DTYPE for cache in llm.engine.runner.kv_caches)
    # Calibration leaves the checkpoint's scales (and captures at start-up as usual).
    with LLM(str(tmp_path / "kv"), dtype="float32", device="cpu", kv_cache_dtype="fp8", calibrate_kv_scales=True,
             progress=False) as llm:
        assert not llm.engine.calibrate_kv_scales and not llm.engine.runner.kv_scales_pending
        llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=2))
        assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in llm.engine.model.layers] == [
            (0.5, 0.25), (1.5, 0.25)]


def _rewrite(path, target, change_config=None, change_tensors=None):
    target.mkdir()
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    if change_config:
        change_config(config)
    if change_tensors:
        change_tensors(tensors)
    (target / "config.json").write_text(json.dumps(config))
    save_file(tensors, target / "model.safetensors")
    return target


QPROJ = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case,match", [
    ("gptq", "quantization method 'gptq' is not supported"),
    ("int8 weights", "only 8-bit float"),
    ("asymmetric", "asymmetric weights"),
    ("bad block", "weight_block_size must be two positive integers"),
    ("missing scale", "is FP8 but has no weight_scale"),
    ("scale shape", "scale of shape \\(3,\\) does not fit"),
    ("negative scale", "scales must be finite and positive"),
    ("zero point", "zero points"),
    ("e5m2", "graphrt reads FP8 weights as float8_e4m3fn"),
    ("scale without weight", "no weight for it"),
    ("kv scale shape", "a KV-cache scale is one float"),
    ("integer scale", "scales must be floating-point"),
    ("no quantization_config", "declares no quantization_config"),
    ("scale for a 16-bit weight", "not FP8"),
])
def test_bad_fp8_checkpoints_are_refused_naming_the_problem(source, tmp_path, case, match):
    path, _ = source
    fp8 = tmp_path / "fp8"
    write_fp8_checkpoint(path, fp8, "fine-grained-fp8")
    ct = tmp_path / "ct"
    write_fp8_checkpoint(path, ct, "compressed-tensors-channel")

    def config_change(change):
        return lambda config: change(config["quantization_config"])

    def weights(name):
        return lambda config: config["quantization_config"]["config_groups"]["group_0"]["weights"].update(name)

    cases = {
        "gptq": (fp8, config_change(lambda q: q.update(quant_method="gptq")), None),
        "int8 weights": (ct, weights({"type": "int"}), None),
        "asymmetric": (ct, weights({"symmetric": False}), None),
        "bad block": (fp8, config_change(lambda q: q.update(weight_block_size=[128])), None),
        "missing scale": (fp8, None, lambda t: t.pop(f"{QPROJ}.weight_scale_inv")),
        "scale shape": (fp8, None, lambda t: t.update({f"{QPROJ}.weight_scale_inv": torch.ones(3)})),
        "negative scale": (fp8, None, lambda t: t[f"{QPROJ}.weight_scale_inv"].neg_()),
        "zero point": (ct, None, lambda t: t.update({f"{QPROJ}.weight_zero_point": torch.zeros(256, 1)})),
        "e5m2": (fp8, None, lambda t: t.update({f"{QPROJ}.weight": t[f"{QPROJ}.weight"].to(torch.float8_e5m2)})),
        "scale without weight": (fp8, None, lambda t: t.pop(f"{QPROJ}.weight")),
        "kv scale shape": (fp8, None, lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.ones(2)})),
        "integer scale": (fp8, None, lambda t: t.update({f"{QPROJ}.weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)})),
        "no quantization_config": (fp8, lambda config: config.pop("quantization_config"), None),
        "scale for a 16-bit weight": (fp8, None, lambda t: t.update(
            {f"{QPROJ}.weight": t[f"{QPROJ}.weight"].to(torch.bfloat16)})),
    }
    base, change_config, change_tensors = cases[case]
    broken = _rewrite(base, tmp_path / "broken", change_config, change_tensors)
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(broken), dtype="float32", device="cpu", progress=False)
