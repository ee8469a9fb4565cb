"""Output files written whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_when_done(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` (same folder and extension, so writers that choose a format by
    the extension still do) to write to; it replaces ``path`` when the block ends, and is removed if the
    block raises, so a failed write (a full disk, a size limit, an interrupt) leaves no half-written
    file where a finished one is expected."""
    target = Path(path)
    temporary = target.with_name(f".{target.stem}.{os.getpid()}.partial{target.suffix}")
    try:
        yield temporary
        os.replace(temporary, target)
    except OSError as exc:
        if exc.filename is not None and Path(exc.filename) == temporary:  # name the file the user asked for
            raise OSError(exc.errno, f"cannot write {str(target)!r}: {exc.strerror}") from exc
        raise
    finally:
        temporary.unlink(missing_ok=True)


def write_json(path: str | os.PathLike, data) -> None:
    """``data`` as indented JSON at ``path``, written whole or not at all (``replaced_when_done``)."""
    with replaced_when_done(path) as partial, open(partial, "w") as f:
        json.dump(data, f, indent=2)
