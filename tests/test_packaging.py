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
