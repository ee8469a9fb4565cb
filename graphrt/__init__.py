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


def _map_checkout_folders() -> None:
    """In a source checkout ``graphrt.attention`` and ``graphrt.capture`` are the top-level ``attention/``
    and ``capture/`` folders beside ``graphrt/`` (pyproject.toml's package-dir; an installed wheel holds
    them inside ``graphrt/``). Resolve them to this checkout's folders, so that a checkout imported from
    its own directory (a clone on ``PYTHONPATH``) runs its own kernels, not another checkout's editable
    install, and runs at all without one."""
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folders = {f"{__name__}.{name}": root / name for name in ("attention", "capture")}
    if not (root / "pyproject.toml").is_file() or not all((folder / "__init__.py").is_file()
                                                          for folder in folders.values()):
        return
    if any(getattr(finder, "checkout_root", None) == root for finder in sys.meta_path):
        return  # graphrt imported again (a reload)

    class CheckoutFolders(importlib.abc.MetaPathFinder):
        checkout_root = root

        def find_spec(self, fullname, path=None, target=None):
            folder = folders.get(fullname)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, CheckoutFolders())


_map_checkout_folders()


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'graphrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
