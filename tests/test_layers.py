"""The package's folders form a one-way chain of layers: a module imports only from its own layer or
the layers below it (README, "Layout"). Checked twice: statically, every import statement of every
module (function-level ones included), and at run time, importing a layer in a fresh interpreter
loads no module of a layer above it. A third check: every module is reachable from the product's
entry points, so nothing in the package lives only for ``profiles/`` or the tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Bottom first. ``graphrt`` stands for the modules directly in ``graphrt/`` (engine and API) but the CLI.
LAYERS = (
    "graphrt.base",
    "graphrt.kernels",
    "graphrt.sampling",
    "graphrt.attention",
    "graphrt.capture",
    "graphrt.models",
    "graphrt.loader",
    "graphrt",
    "graphrt.serve",  # the HTTP server over the engine and LLM
    "graphrt.cli",  # the command line, over everything (serve among it)
)

#: Folder on disk -> import name (pyproject's package-dir mapping).
FOLDERS = {"graphrt": "graphrt", "attention": "graphrt.attention", "capture": "graphrt.capture"}


def package_modules() -> dict[str, Path]:
    """Import name -> file, for every module the package installs."""
    modules = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((name, *parts))] = path
    return modules


def layer_of(module: str) -> int:
    """Index in ``LAYERS`` of the deepest layer whose name prefixes ``module``."""
    best = None
    for index, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            if best is None or len(layer) > len(LAYERS[best]):
                best = index
    assert best is not None, f"{module} belongs to no layer"
    return best


def _lazy_exports() -> dict[str, str]:
    """graphrt/__init__'s ``_EXPORTS`` table: public name -> the module that defines it."""
    tree = ast.parse((ROOT / "graphrt" / "__init__.py").read_text())
    table = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "_EXPORTS")
    return {k.value: v.value for k, v in zip(table.keys, table.values)}


LAZY_EXPORTS = _lazy_exports()


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved; for
    ``from package import name`` the target is ``package.name`` when that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    known = package_modules()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target not in known and source == "graphrt" and alias.name in LAZY_EXPORTS:
                    target = LAZY_EXPORTS[alias.name]  # ``from graphrt import LLM`` imports graphrt.llm
                found.append((node.lineno, target if target in known else source))
    return [(line, name) for line, name in found if name == "graphrt" or name.startswith("graphrt.")]


def test_every_import_points_down_the_chain():
    violations = []
    for module, path in package_modules().items():
        own = layer_of(module)
        for line, target in imports_of(module, path):
            if module.startswith(target + ".") or module == target:
                continue  # a package's own __init__ runs first anyway
            if layer_of(target) > own:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[own]}) imports "
                                  f"{target} ({LAYERS[layer_of(target)]}), a layer above it")
    assert not violations, "\n".join(violations)


def test_the_check_catches_an_upward_import(tmp_path):
    """The static check is not vacuous: an import from the engine inside a kernel module is found."""
    path = tmp_path / "gemv.py"
    path.write_text("def f():\n    from graphrt.engine import LLMEngine\n")
    [(line, target)] = imports_of("graphrt.kernels.gemv", path)
    assert (line, target) == (2, "graphrt.engine")
    assert layer_of(target) > layer_of("graphrt.kernels.gemv")
    path.write_text("def f():\n    from graphrt import LLM, __version__\n")  # through the lazy exports
    assert [t for _, t in imports_of("graphrt.kernels.gemv", path)] == ["graphrt.llm", "graphrt"]


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_importing_a_layer_loads_nothing_above_it(layer):
    """A fresh interpreter imports ``layer`` (and every module in it); no module of a higher layer
    may be loaded then."""
    modules = [m for m in package_modules() if layer_of(m) == LAYERS.index(layer)]
    # Modules that compile Triton kernels at import are imported where Triton runs: on the CPU its
    # interpreter, as the kernel tests use it.
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m == 'graphrt' or m.startswith('graphrt.'))))\n"
    )
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env={**__import__("os").environ, **env}, timeout=300)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    above = [m for m in loaded if m != "graphrt" and layer_of(m) > LAYERS.index(layer)]
    assert not above, f"importing {layer} loaded {above}"


#: Where users and the CLI come in: the public API, the command line, and the two packages an
#: embedding engine imports directly.
ENTRY_POINTS = ("graphrt", "graphrt.cli", "graphrt.capture", "graphrt.attention")


def test_every_module_is_reachable_from_an_entry_point():
    """No module is imported only by ``profiles/`` or the tests: each is reached from an entry point
    through the package's own imports (lazy ``graphrt`` exports included)."""
    modules = package_modules()
    edges = {m: {t for _, t in imports_of(m, p)} for m, p in modules.items()}
    # graphrt/__init__ exports by name through __getattr__; its table lists their modules.
    init = ast.parse(modules["graphrt"].read_text())
    exports = next(n.value for n in ast.walk(init) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "_EXPORTS")
    edges["graphrt"] |= {v.value for v in exports.values}
    seen, todo = set(), list(ENTRY_POINTS)
    while todo:
        module = todo.pop()
        if module in seen or module not in modules:
            continue
        seen.add(module)
        todo += edges[module]
        todo += [m for m in modules if m.rpartition(".")[0] == module and m in edges.get(module, ())]
        parent = module.rpartition(".")[0]
        if parent:
            todo.append(parent)
    unreached = sorted(set(modules) - seen)
    assert not unreached, f"modules no entry point imports: {unreached}"
