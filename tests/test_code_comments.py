"""Comments and docstrings in the package keep rules and reasons; measurements, result files, change
numbers and experiment history live in ``profiles/`` notes. This scans every comment and docstring in
``graphrt/``, ``attention/`` and ``capture/`` for what belongs there instead."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: (what it is, pattern) of text a comment or docstring must not hold.
FORBIDDEN = (
    ("a timing", re.compile(r"\b\d+(\.\d+)?\s*(ms|µs|us|ns|s/step|ms/step)\b")),
    ("a bandwidth or rate", re.compile(r"\b\d+(\.\d+)?\s*(GB/s|TB/s|GiB/s|TFLOP/s|tok/s|tokens/s)")),
    ("a speed-up", re.compile(r"\b\d+(\.\d+)?\s*(x|×)\s+(faster|slower)|\bspeed-?up of\b", re.I)),
    ("a result file", re.compile(r"profiles/results|[\w./-]+\.(json|log|png|csv)\b(?<!config\.json)"
                                 r"(?<!tokenizer\.json)(?<!index\.json)")),
    ("a change, issue or wave number", re.compile(r"\b(change|issue|wave|PR)\s*#?\d+\b", re.I)),
    ("a design file outside the repository", re.compile(r"DESIGN\.md")),
    ("a register count", re.compile(r"ptxas|\b\d+\s+registers\b")),
    ("a benchmark machine", re.compile(r"\bH[12]00\b")),
)


def _sources() -> list[Path]:
    return sorted(p for folder in ("graphrt", "attention", "capture") for p in (ROOT / folder).rglob("*.py"))


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in the file."""
    source = path.read_text()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                found.append((node.body[0].lineno, doc))
    return found


def findings(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for line, text in comments_and_docstrings(path):
        for what, pattern in FORBIDDEN:
            match = pattern.search(text)
            if match:
                offset = text[: match.start()].count("\n")
                out.append(f"{path.relative_to(root)}:{line + offset}: {what}: {match.group(0)!r}")
    return out


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_cite_no_measurements_or_history(path):
    found = findings(path)
    assert not found, "move these to a profiles/ notes file:\n" + "\n".join(found)


def test_the_scan_finds_what_it_forbids(tmp_path):
    path = tmp_path / "module.py"
    path.write_text('"""Runs in 0.8 ms on the H200 (see bench_x.json)."""\n# change 7 made this 2x faster\nx = 1\n')
    kinds = {finding.split(": ")[1] for finding in findings(path, root=tmp_path)}
    assert kinds >= {"a timing", "a benchmark machine", "a result file", "a change, issue or wave number",
                     "a speed-up"}
