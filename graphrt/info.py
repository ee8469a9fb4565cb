"""What ``graphrt info`` reports: library versions, the device, and which attention backends can run."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

import torch

from graphrt.attention import BACKENDS
from graphrt.base.errors import ModelLoadError

_LIBRARIES = ("torch", "triton", "xformers", "nvtx", "gguf", "tokenizers", "safetensors")


def _library_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device_description() -> str:
    if not torch.cuda.is_available():
        return "cpu (torch sees no CUDA device)"
    props = torch.cuda.get_device_properties(0)
    return (f"cuda: {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}")


def collect_info() -> dict:
    """A JSON-able report of the installation."""
    from graphrt.loader import default_model_path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = {}
    for name, backend in BACKENDS.items():
        reason = backend.unusable_reason(device)
        backends[name] = "usable" if reason is None else f"unusable: {reason}"
    try:
        default_model = default_model_path()
    except ModelLoadError as exc:
        default_model = f"missing: {exc}"
    from graphrt.attention.xformers_compat import xformers_status

    return {
        "python": platform.python_version(),
        "xformers_prefill": xformers_status().describe(),
        "libraries": {name: _library_version(name) for name in _LIBRARIES},
        "device": _device_description(),
        "attention_backends": backends,
        "default_model": default_model,
    }


def format_info(info: dict) -> str:
    lines = [f"python      {info['python']}"]
    lines += [f"{name:<11} {version}" for name, version in info["libraries"].items()]
    lines.append(f"device      {info['device']}")
    lines.append(f"prefill     {info['xformers_prefill']}")
    lines.append("attention backends:")
    lines += [f"  {name:<10} {status}" for name, status in info["attention_backends"].items()]
    lines.append(f"default model: {info['default_model']}")
    return "\n".join(lines)
