"""Imports point one way, as docs/architecture.md's layer table says: the engine never imports the
API layers above it, each engine module imports only modules below its own row, and no import
hides inside a function to dodge a cycle."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "spmd_torch"
ENGINE = PACKAGE / "_lazy"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
ABOVE_ENGINE = ("core", "distributed", "debug", "utils", "runtime", "amp", "experimental")


def _imports(path: pathlib.Path, source: str | None = None) -> list[tuple[str, bool]]:
    """(absolute module name, inside a function) of every import in ``path`` (relative ones
    resolved); ``from m import a`` also yields ``m.a``, which may be a module."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    tree = ast.parse(source if source is not None else path.read_text())
    in_function = {
        id(inner)
        for outer in ast.walk(tree)
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(outer)
    }
    found = []
    for node in ast.walk(tree):
        nested = id(node) in in_function
        if isinstance(node, ast.Import):
            found += [(alias.name, nested) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found += [(module, nested)] + [(f"{module}.{a.name}", nested) for a in node.names]
    return found


def _layers() -> list[str]:
    """Engine units from the architecture table, top row first: 'dispatch', 'lowering', ..."""
    rows = re.findall(r"^\| `_lazy/([\w/]+?)(?:\.py|/)` \|", ARCHITECTURE.read_text(), re.M)
    assert rows, f"no layer table found in {ARCHITECTURE}"
    return rows


def _unit(path: pathlib.Path) -> str:
    """The table row a file belongs to: its module, or its subpackage (lowering/)."""
    return path.relative_to(ENGINE).parts[0].removesuffix(".py")


def _engine_unit(name: str) -> str | None:
    prefix = "spmd_torch._lazy."
    return name[len(prefix) :].split(".")[0] if name.startswith(prefix) else None


def _upward_imports(path: pathlib.Path, source: str | None = None) -> list[str]:
    layers = _layers()
    unit = _unit(path)
    offenders = []
    for name, _ in _imports(path, source):
        target = _engine_unit(name)
        if target is None or target == unit:
            continue
        if target not in layers or layers.index(target) <= layers.index(unit):
            offenders.append(f"_lazy/{path.relative_to(ENGINE)} ({unit}) imports {name}")
    return offenders


def _engine_files() -> list[pathlib.Path]:
    return [p for p in sorted(ENGINE.rglob("*.py")) if p != ENGINE / "__init__.py"]


def test_every_engine_module_has_a_row_in_the_architecture_table():
    missing = {_unit(p) for p in _engine_files()} - set(_layers())
    assert not missing, f"add these to docs/architecture.md's layer table: {sorted(missing)}"
    stale = set(_layers()) - {_unit(p) for p in _engine_files()}
    assert not stale, f"the layer table lists modules that do not exist: {sorted(stale)}"


def test_engine_modules_import_only_layers_below_them():
    offenders = [line for path in _engine_files() for line in _upward_imports(path)]
    assert not offenders, "\n".join(offenders)


def test_engine_imports_nothing_above_it():
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted(ENGINE.rglob("*.py"))
        for name, _ in _imports(path)
        if any(name.startswith(f"spmd_torch.{layer}") for layer in ABOVE_ENGINE)
    ]
    assert not offenders, "\n".join(offenders)


def test_no_engine_module_imports_inside_a_function():
    hidden = [
        f"{path.relative_to(PACKAGE)} imports {name} inside a function"
        for path in sorted(ENGINE.rglob("*.py"))
        for name, nested in _imports(path)
        if nested
    ]
    assert not hidden, "\n".join(hidden)


@pytest.mark.parametrize(
    "source, upward",
    [
        ("from .execute import to_cpu\n", True),  # tensor -> the barrier: up
        ("from . import dispatch\n", True),
        ("from .graph import Node\n", False),  # tensor -> graph: down
        ("import spmd_torch._lazy.compile\n", True),
        ("from .lowering.dtypes import to_jax_dtype\n", False),
    ],
)
def test_layering_check_sees_upward_imports(source, upward):
    assert bool(_upward_imports(ENGINE / "tensor.py", source)) is upward


def test_layering_check_sees_imports_inside_functions():
    source = "import jax\n\ndef f():\n    from .execute import to_cpu\n"
    found = _imports(ENGINE / "tensor.py", source)
    assert ("jax", False) in found and ("spmd_torch._lazy.execute", True) in found
