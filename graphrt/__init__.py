"""graphrt: a CUDA-graph-optimized decode runtime for LLM inference."""

from .config import EngineConfig, ModelConfig
from .errors import ConfigError, GraphrtError, InvalidRequestError, ModelLoadError
from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "GraphrtError",
    "ConfigError",
    "InvalidRequestError",
    "ModelLoadError",
    "__version__",
]
