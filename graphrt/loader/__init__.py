"""Model sources: HF directories, GGUF files, random-weight presets; one entry point to open any."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Union

import torch

from graphrt.base.checks import is_count
from graphrt.base.errors import ConfigError, ModelLoadError
from graphrt.base.progress import progress_bar
from graphrt.loader.gguf_file import GGUFCheckpoint, default_model_path, read_gguf
from graphrt.loader.hf_dir import HFCheckpoint, read_hf_dir
from graphrt.loader.random_presets import PREFIX as RANDOM_PREFIX
from graphrt.loader.random_presets import PRESETS as RANDOM_PRESETS
from graphrt.loader.random_presets import RandomCheckpoint, read_random_preset

Checkpoint = Union[HFCheckpoint, GGUFCheckpoint, RandomCheckpoint]


def open_checkpoint(spec: str | None, init_std: float = 0.02, seed: int = 0) -> Checkpoint:
    """Resolve a ``--model`` value: None (the default SmolLM2 GGUF), ``random:NAME``, a ``.gguf`` file
    or an HF directory. Only metadata is read here; weights stream in ``load_weights_into``."""
    random_preset = spec is not None and spec.startswith(RANDOM_PREFIX)
    if not random_preset and (init_std, seed) != (0.02, 0):
        raise ConfigError(f"loader_options init_std and seed draw random presets' weights; model {spec!r} has "
                          "stored weights")
    if spec is None:
        return read_gguf(default_model_path())
    if random_preset:
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or not (
                math.isfinite(init_std) and init_std >= 0):
            raise ConfigError(f"loader_options init_std must be a finite number >= 0, got {init_std!r}")
        if not is_count(seed):
            raise ConfigError(f"loader_options seed must be an integer >= 0, got {seed!r}")
        return read_random_preset(spec, init_std=init_std, seed=seed)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r} not found: give an HF model directory, a .gguf file, or one of "
            f"{', '.join(RANDOM_PREFIX + p for p in RANDOM_PRESETS)}"
        )
    if path.is_dir():
        return read_hf_dir(path)
    return read_gguf(path)


def load_weights_into(model: torch.nn.Module, checkpoint: Checkpoint, progress: bool = True) -> None:
    """Fill ``model``'s parameters from the checkpoint, with a progress bar on stderr when it is a terminal
    (redirected, a bar would leave its frames and a line of spaces in the file)."""
    if isinstance(checkpoint, RandomCheckpoint):
        checkpoint.initialize(model)
        return
    tensors = progress_bar(checkpoint.tensors(), progress, total=checkpoint.num_tensors(), desc="loading weights",
                           unit="tensor")
    try:
        model.load_weights(tensors)
    except ModelLoadError as exc:
        where = str(checkpoint.path)
        if where in str(exc):
            raise
        raise ModelLoadError(f"{where}: {exc}") from None


__all__ = ["Checkpoint", "open_checkpoint", "load_weights_into", "RANDOM_PRESETS"]
