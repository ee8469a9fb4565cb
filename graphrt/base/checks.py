"""Small checks shared by every layer: option values and the Triton mode."""

from __future__ import annotations

import numbers
import os
from typing import Any


def is_count(value: Any) -> bool:
    """An integer >= 0 of any integer type (NumPy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def triton_interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to run kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
