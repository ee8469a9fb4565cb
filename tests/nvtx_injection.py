"""Build the NVTX recording tool (``nvtx_injection.c``) and read what it recorded.

A process run with ``NVTX_INJECTION64_PATH=<library>`` and ``NVTX_INJECTION_RECORD=<file>`` writes
every NVTX domain creation, push and pop to the file: what Nsight Systems would have received.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("nvtx_injection.c")
HEADER = Path("nvtx3") / "nvToolsExt.h"


class ToolUnavailable(RuntimeError):
    """No C compiler or no NVTX v3 headers on this machine (the message says which)."""


def find_nvtx_include() -> Path | None:
    """A directory holding ``nvtx3/nvToolsExt.h``: $NVTX_INCLUDE_DIR, the ``nvidia-nvtx`` wheel
    (``site-packages/nvidia/<cuXX>/include``), or the CUDA toolkit."""
    candidates: list[Path] = []
    if os.environ.get("NVTX_INCLUDE_DIR"):
        candidates.append(Path(os.environ["NVTX_INCLUDE_DIR"]))
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(root).glob("*/include")) + [Path(root) / "include"]
    for cuda in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cuda:
            candidates.append(Path(cuda) / "include")
    return next((path for path in candidates if (path / HEADER).is_file()), None)


def find_compiler() -> str | None:
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    return next(filter(None, map(shutil.which, names + ["cc", "gcc", "clang"])), None)


def build(out_dir: Path) -> Path:
    """Compile the tool into ``out_dir``; returns the shared library. Raises ToolUnavailable."""
    compiler = find_compiler()
    if compiler is None:
        raise ToolUnavailable("no C compiler (cc, gcc, clang or $CC) to build the NVTX injection library")
    include = find_nvtx_include()
    if include is None:
        raise ToolUnavailable("no NVTX v3 headers (pip install nvidia-nvtx, or set NVTX_INCLUDE_DIR)")
    library = Path(out_dir) / "libnvtx_injection.so"
    command = [compiler, "-shared", "-fPIC", "-O2", "-Wall", f"-I{include}", str(SOURCE), "-o", str(library),
               "-lpthread"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the NVTX injection library failed:\n{' '.join(command)}\n{result.stderr}")
    return library


def tool_env(library: Path, record: Path | None) -> dict[str, str]:
    """Environment variables that attach the tool (recording to ``record`` when given)."""
    env = {"NVTX_INJECTION64_PATH": str(library)}
    if record is not None:
        env["NVTX_INJECTION_RECORD"] = str(record)
    return env


@dataclass(frozen=True)
class Range:
    """One pushed-and-popped range; ``parents`` are the enclosing ranges' messages, outermost first."""

    message: str
    domain: str
    parents: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.message.split(" ", 1)[0]

    @property
    def parent(self) -> str | None:
        return self.parents[-1].split(" ", 1)[0] if self.parents else None


@dataclass
class Record:
    initialized: bool
    domains: list[str]
    #: Ranges in push order, all threads together.
    ranges: list[Range]
    #: Raw events: (kind, thread, domain, message) for push/pop/mark.
    events: list[tuple[str, str, str, str]]


def read(path: Path) -> Record:
    """Parse a record, pairing each pop with its thread's latest push (NVTX's stack is per thread).

    Raises AssertionError if a pop has no push, pops another domain's range, or a range is left open.
    """
    initialized, domains, ranges, events = False, [], [], []
    stacks: dict[str, list[tuple[str, str]]] = {}
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    for line in lines:
        kind, *fields = line.split("\t")
        if kind == "init":
            initialized = True
        elif kind == "domain":
            domains.append(fields[0])
        elif kind == "push":
            thread, domain, message = fields
            stack = stacks.setdefault(thread, [])
            ranges.append(Range(message, domain, tuple(m for _, m in stack)))
            stack.append((domain, message))
            events.append((kind, thread, domain, message))
        elif kind == "pop":
            thread, domain = fields
            stack = stacks.get(thread)
            assert stack, f"pop on thread {thread} (domain {domain!r}) without a matching push"
            pushed_domain, message = stack.pop()
            assert pushed_domain == domain, f"pop in domain {domain!r} closes {message!r} of {pushed_domain!r}"
            events.append((kind, thread, domain, ""))
        elif kind == "mark":
            events.append((kind, *fields))
        else:
            raise AssertionError(f"unknown record line {line!r}")
    left_open = {thread: [m for _, m in stack] for thread, stack in stacks.items() if stack}
    assert not left_open, f"ranges never popped: {left_open}"
    return Record(initialized, domains, ranges, events)
