"""Imports only point down the data flow: the engine (_lazy) never imports the API layers above it."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "spmd_torch"
ABOVE_ENGINE = ("core", "distributed", "debug", "utils", "runtime", "amp", "experimental")


def _imported_modules(path: pathlib.Path) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_engine_imports_nothing_above_it():
    offenders = []
    for path in sorted((PACKAGE / "_lazy").rglob("*.py")):
        for name in _imported_modules(path):
            if any(name.startswith(f"spmd_torch.{layer}") for layer in ABOVE_ENGINE):
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_layering_check_sees_relative_imports():
    found = _imported_modules(PACKAGE / "_lazy" / "execute.py")
    assert "spmd_torch._lazy.compile" in found and "spmd_torch._lazy.tensor" in found
