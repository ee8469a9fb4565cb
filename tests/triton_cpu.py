"""Triton kernel modules in tests without CUDA: they must run under Triton's CPU interpreter.

``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates (triton 3.6 and 3.9 alike), and conftest.py
sets it before any test module imports a kernel; a module imported earlier without it (another test's
import chain, an explicit ``TRITON_INTERPRET=0``) still holds compiled-kernel objects, which need a GPU.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def interpreted(module: ModuleType, kernel: str) -> ModuleType:
    """``module``, reloaded so that its kernels run in the interpreter when there is no CUDA device and
    ``module.<kernel>`` (one of its ``@triton.jit`` kernels) was decorated without it."""
    if not torch.cuda.is_available() and type(getattr(module, kernel)).__name__ != "InterpretedFunction":
        module = importlib.reload(module)
    return module
