"""Lines that native libraries write to the process's stderr (file descriptor 2, below Python's
``sys.stderr``), filtered: torch.profiler's Kineto prints ``USDT: ... profiler_start`` and
``profiler_stop`` lines there that no option turns off."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def filtered_native_stderr(drop: Callable[[str], bool]) -> Iterator[None]:
    """Hold what is written to file descriptor 2 during the block (Python's writes too: they share
    it) and pass on, when it ends, each line for which ``drop`` is false, in order."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True) if not drop(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def kineto_notice(line: str) -> bool:
    """Whether ``line`` is one of Kineto's profiler start/stop notices."""
    return line.startswith("USDT:")
