"""``tests/gpu_stages.sh`` runs every GPU test: each test file with the ``gpu`` marker is named, whole or by
test, in some stage, and every file a stage names exists (a GPU test left out of the stages never runs on
the device)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STAGES = (TESTS / "gpu_stages.sh").read_text()
#: A line that marks tests ``gpu``: a decorator, or an entry of a module's ``pytestmark`` list.
GPU_MARK = re.compile(r"^(?:@pytest\.mark\.gpu\b|pytestmark = \[pytest\.mark\.gpu\b|\s+pytest\.mark\.gpu,)", re.M)


def staged_paths() -> set[str]:
    """The test files the stages name (``tests/x.py`` or ``tests/x.py::test``), without the test part."""
    return {name.split("::")[0] for name in re.findall(r"tests/[\w/]+\.py(?:::\w+)?", STAGES)}


def test_every_gpu_test_file_is_in_a_stage():
    gpu_files = {f"tests/{path.name}" for path in TESTS.glob("test_*.py") if GPU_MARK.search(path.read_text())}
    assert gpu_files, "no GPU test files found"
    missing = sorted(gpu_files - staged_paths())
    assert not missing, f"GPU test files that no stage of tests/gpu_stages.sh runs: {missing}"


def test_every_staged_file_exists():
    absent = sorted(path for path in staged_paths() if not (TESTS.parent / path).is_file())
    assert not absent, f"tests/gpu_stages.sh names files that do not exist: {absent}"
