"""pyproject.toml lists every package: a folder it leaves out is missing from a wheel (``pip install .``),
though an editable install still finds it."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {"graphrt." + init.parent.name for init in (ROOT / "graphrt").glob("*/__init__.py")}
    folders |= set(setuptools["package-dir"]) - {"graphrt"}
    assert folders - listed == set(), "packages missing from pyproject.toml"


def test_a_checkout_on_the_path_imports_its_own_attention_and_capture(tmp_path):
    """``graphrt.attention`` and ``graphrt.capture`` are top-level folders of the checkout: a copy imported
    from its own directory (a clone on PYTHONPATH, no install of its own) takes its own folders, not the
    editable install's (that of another checkout, which used to run silently in its place)."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "clone"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("graphrt", "attention", "capture"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", copy)
    probe = ("import graphrt, graphrt.attention.backend as backend, graphrt.capture as capture; "
             "print(graphrt.__file__); print(backend.__file__); print(capture.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=copy, env={**_environment(), "PYTHONPATH": str(copy)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    paths = [Path(line).resolve() for line in done.stdout.split()]
    assert all(copy.resolve() in path.parents for path in paths), paths


def _environment() -> dict:
    import os

    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TRITON_INTERPRET")}
