"""Progress bars on stderr for the slow parts of start-up (loading weights, capturing graphs)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

Item = TypeVar("Item")


def progress_bar(items: Iterable[Item], progress: bool, **options) -> Iterable[Item]:
    """``items`` with a tqdm bar (``options`` its description and units; shown only where stderr is a
    terminal: redirected, a bar would leave its frames in the file), or ``items`` themselves when
    ``progress`` is False. Then no tqdm object is made at all: tqdm's first bar in a process creates a
    multiprocessing lock (a named semaphore), which a tensor-parallel rank killed with SIGKILL could not
    release, and the resource tracker would report it leaked."""
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, disable=None, leave=False, **options)
