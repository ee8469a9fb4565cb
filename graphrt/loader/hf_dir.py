"""Hugging Face model directories: ``config.json`` plus one or many ``*.safetensors`` files."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from graphrt.base.errors import ConfigError, ModelLoadError
from graphrt.loader.fp8_checkpoint import fp8_checkpoint_format
from graphrt.loader.tokenizer import Tokenizer
from graphrt.models.config import ModelConfig, token_ids_field

_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


@dataclass
class HFCheckpoint:
    """A model directory in HF layout. Tensors are read lazily, one at a time, from safetensors."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer | None
    weight_files: list[Path]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, CPU tensor in the checkpoint's dtype) for every tensor of every weight file."""
        for file in self.weight_files:
            with _open_weights(file) as f:
                for name in f.keys():
                    try:
                        tensor = f.get_tensor(name)
                    except (SafetensorError, OSError) as exc:
                        raise ModelLoadError(f"{file}: tensor {name!r} cannot be read: {exc}") from None
                    yield name, tensor

    def num_tensors(self) -> int:
        return sum(len(_tensor_names(file)) for file in self.weight_files)


@contextmanager
def _open_weights(file: Path):
    """``safe_open`` of one weight file, a corrupt or unreadable one reported as ModelLoadError naming it."""
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from None
    with handle as f:
        yield f


def read_hf_dir(path: str | Path) -> HFCheckpoint:
    """Open an HF model directory; refuses pickle ``.bin`` weights, which can run code on load."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model directory")
    raw = _read_json(config_file)
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    extra_eos = _generation_eos_ids(path)
    if extra_eos:
        config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys((*config.eos_token_ids, *extra_eos))))
    weight_files = _weight_files(path)
    if raw.get("quantization_config") is not None:
        names = [name for file in weight_files for name in _tensor_names(file)]
        config = dataclasses.replace(config, fp8_checkpoint=fp8_checkpoint_format(
            raw["quantization_config"], names, where=str(config_file)))
    return HFCheckpoint(path, config, Tokenizer.from_hf_dir(path), weight_files)


def _tensor_names(file: Path) -> list[str]:
    with _open_weights(file) as f:
        return list(f.keys())


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    """The ``eos_token_id`` (an id or a list) of ``generation_config.json``, which HF's generation stops
    on and which may add ids to ``config.json``'s (an instruct model's end of turn); () without the file."""
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    raw = _read_json(file)
    try:
        return token_ids_field(raw, "eos_token_id", where=str(file)) if isinstance(raw, dict) else ()
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from None


def _read_json(file: Path) -> Any:
    """The contents of a JSON file of the model directory; ModelLoadError naming it when it is not JSON."""
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a JSON object with a weight_map: {exc}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index}: weight_map must map tensor names to weight file names")
        files = sorted({path / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names weight files that are missing: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any((path / name).exists() for name in _PICKLE_WEIGHTS) or any(path.glob("*.bin")):
        raise ModelLoadError(
            f"{path} holds only pickle (.bin/.pt) weights, which graphrt refuses to load because unpickling "
            "can run arbitrary code; convert them to safetensors (e.g. with transformers: "
            "model.save_pretrained(dir, safe_serialization=True))"
        )
    raise ModelLoadError(f"{path} has no *.safetensors weight files")
