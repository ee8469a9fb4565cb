"""graphrt: a CUDA-graph-optimized decode runtime for LLM inference.

The public names below load on first use, so that importing a lower layer (``graphrt.kernels``,
``graphrt.attention``, ...) does not import the engine above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "graphrt.llm",
    "EngineConfig": "graphrt.config",
    "ModelConfig": "graphrt.models.config",
    "RequestOutput": "graphrt.outputs",
    "SamplingParams": "graphrt.sampling.params",
    "GraphrtError": "graphrt.base.errors",
    "ConfigError": "graphrt.base.errors",
    "InvalidRequestError": "graphrt.base.errors",
    "ModelLoadError": "graphrt.base.errors",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from graphrt.base.errors import ConfigError, GraphrtError, InvalidRequestError, ModelLoadError
    from graphrt.config import EngineConfig
    from graphrt.llm import LLM
    from graphrt.models.config import ModelConfig
    from graphrt.outputs import RequestOutput
    from graphrt.sampling.params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'graphrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
