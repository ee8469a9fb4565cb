"""``profiles/`` as a product: every committed result file is cited by the README or a notes file, and
the scripts use graphrt's public names only (no private import, no ``._name`` reached into)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "profiles"


def _citing_text() -> str:
    docs = [ROOT / "README.md", *sorted(ROOT.glob("*.md")), *sorted(PROFILES.glob("*.md"))]
    return "\n".join(path.read_text() for path in dict.fromkeys(docs))


@pytest.mark.parametrize("path", sorted((PROFILES / "results").iterdir()), ids=lambda p: p.name)
def test_every_result_file_is_cited(path):
    assert path.name in _citing_text(), f"profiles/results/{path.name} is cited by no README or notes file"


def private_uses(source: str) -> list[str]:
    """Private names a script imports from graphrt, or reaches for as an attribute (``x._name``);
    dunder names are public."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphrt"):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.startswith("graphrt") and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.py")), ids=lambda p: p.name)
def test_scripts_use_public_names_only(path):
    assert private_uses(path.read_text()) == []


def test_the_private_name_check_finds_them():
    source = "from graphrt.capture.graph_runner import _capture_stream\nrunner._refresh(batch, 8)\nx.__dict__\n"
    assert private_uses(source) == ["from graphrt.capture.graph_runner import _capture_stream", "line 2: ._refresh"]
