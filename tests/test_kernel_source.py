"""Source rules for the Triton kernels that the compilers used here do not enforce alike.

A ``@triton.jit`` helper that returns values must not return early, even under a static (constexpr)
condition: some Triton versions (the GPU machine's) still compile the statements after such a return,
and those statements may not compile for the launch that took the early return (the rows kernel's
unsplit launch passes placeholders that the split path's atomics cannot take). Branches that each end
the function (a final ``if``/``else``) are fine. Kernels themselves may return early with no value: that
is a runtime exit of a program."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _is_jit(function: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in function.decorator_list)


def _early_value_returns(statements: list[ast.stmt]) -> list[int]:
    """Lines of ``return <value>`` statements that are not where the function ends: the last statement,
    or the last statement of each branch of a final if/else."""
    lines = []
    for index, statement in enumerate(statements):
        last = index == len(statements) - 1
        if isinstance(statement, ast.Return):
            if not last and statement.value is not None:
                lines.append(statement.lineno)
        elif isinstance(statement, ast.If) and last and statement.orelse:
            lines += _early_value_returns(statement.body) + _early_value_returns(statement.orelse)
        else:
            lines += [node.lineno for node in ast.walk(statement)
                      if isinstance(node, ast.Return) and node.value is not None]
    return lines


def _jit_functions():
    for folder in ("graphrt", "attention", "capture"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and _is_jit(node):
                    yield path.relative_to(ROOT), node


def test_jit_helpers_return_only_where_they_end():
    functions = list(_jit_functions())
    assert len(functions) > 20  # the scan found the kernels
    problems = [f"{path}:{line} {function.name}" for path, function in functions
                for line in _early_value_returns(function.body)]
    assert not problems, "early returns with a value in @triton.jit functions: " + ", ".join(problems)


def test_the_rule_catches_a_static_early_return():
    source = ("def helper(x, SPLIT: tl.constexpr):\n    if SPLIT == 1:\n        return x\n    y = x + 1\n"
              "    return y\n")
    assert _early_value_returns(ast.parse(source).body[0].body) == [3]
    ends = "def helper(x, SPLIT: tl.constexpr):\n    if SPLIT == 1:\n        y = x\n    else:\n        y = x + 1\n    return y\n"
    assert _early_value_returns(ast.parse(ends).body[0].body) == []
