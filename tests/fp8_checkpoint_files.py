"""FP8 checkpoints written here, in each format graphrt reads, from a 16-bit HF checkpoint (shared by
tests/test_fp8_checkpoints.py and tests/test_gpu_fp8.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from graphrt.models.fp8 import FP8_DTYPE, FP8_MAX

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: format -> (quantization_config, weight block or None, scale tensor name, scale dtype)
FORMATS = {
    "fine-grained-fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                         (128, 128), "weight_scale_inv", torch.float32),
    "per-tensor-fp8": ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
                       None, "weight_scale", torch.float32),
    "compressed-tensors-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                        "dynamic": False}}}, "ignore": ["lm_head"]},
                                   "channel", "weight_scale", torch.bfloat16),
    "compressed-tensors-block": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                      "num_bits": 8, "type": "float", "strategy": "block", "symmetric": True,
                                      "block_structure": [96, 80]}}}, "ignore": ["lm_head"]},
                                 (96, 80), "weight_scale", torch.bfloat16),
}


def _quantize(weight: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale tensor as the format stores it (float32), dequantised weight float32)."""
    w = weight.float()
    rows, columns = w.shape
    if layout is None:  # one scale for the tensor
        scale = w.abs().max() / FP8_MAX
        codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return codes, scale.reshape(()), codes.float() * scale
    if layout == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [rows, 1]
        codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return codes, scale, codes.float() * scale
    b0, b1 = layout
    grid = torch.zeros(-(-rows // b0), -(-columns // b1))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / FP8_MAX
    per_element = grid.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :columns]
    codes = (w / per_element).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, grid, codes.float() * per_element


def write_fp8_checkpoint(source, target, form: str, kv_scales: bool = False) -> dict[str, torch.Tensor]:
    """Rewrite the 16-bit checkpoint in ``source`` as ``form`` into ``target``; returns the float32
    state dict of the dequantised weights (what the checkpoint means)."""
    config_json, layout, scale_name, scale_dtype = FORMATS[form]
    tensors = load_file(source / "model.safetensors")
    stored, meaning = {}, {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            codes, scale, dequantised = _quantize(tensor, layout)
            stored[name], stored[f"{module}.{scale_name}"] = codes, scale.to(scale_dtype)
            if scale_dtype != torch.float32:  # the checkpoint's scales are what the weights mean
                rounded = scale.to(scale_dtype).float()
                dequantised = _quantize_with(codes, rounded, layout)
            if form == "per-tensor-fp8":
                stored[f"{module}.input_scale"] = torch.tensor(0.02)  # static activations: graphrt ignores them
            meaning[name] = dequantised
        else:
            stored[name] = meaning[name] = tensor.float()
    if kv_scales:
        for layer in range(2):
            stored[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5 + layer)
            stored[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.25)
    target.mkdir(parents=True, exist_ok=True)
    save_file(stored, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = config_json
    (target / "config.json").write_text(json.dumps(config))
    return meaning


def _quantize_with(codes: torch.Tensor, scale: torch.Tensor, layout) -> torch.Tensor:
    rows, columns = codes.shape
    if layout is None or layout == "channel":
        return codes.float() * scale
    b0, b1 = layout
    return codes.float() * scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :columns]
