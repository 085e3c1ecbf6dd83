"""Imports point one way, as docs/architecture.md's two layer tables say: the package's (top-level
modules and packages) and the engine's (``_lazy/``). Each module imports only rows below its own,
no module below the package root imports it (the rows above it present the whole package under
PyTorch/XLA's name), there is no import cycle anywhere in ``spmd_torch/``, and no engine import
hides inside a function to dodge a cycle."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "spmd_torch"
ENGINE = PACKAGE / "_lazy"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, source: str | None = None) -> list[tuple[str, bool]]:
    """(module imported, inside a function) for every import of ours in ``path``: relative ones
    resolved, ``from m import a`` read as importing ``m.a`` when that is a module, else ``m``."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent)
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
            for alias in node.names:
                name = f"{module}.{alias.name}"
                found.append((name if name in MODULES else module, nested))
    return [(name, nested) for name, nested in found if name.split(".")[0] == "spmd_torch"]


# --- the layer tables ----------------------------------------------------------------------------


def _rows(prefix: str) -> list[str]:
    """A layer table's rows, top first: ``_lazy/dispatch.py``, ``distributed/``..."""
    rows = re.findall(rf"^\| `({prefix}[\w/.]*?)` \|", ARCHITECTURE.read_text(), re.M)
    assert rows, f"no layer table of {prefix or 'the package'} found in {ARCHITECTURE}"
    return rows


def _package_rows() -> list[str]:
    return [row for row in _rows("") if not row.startswith("_lazy/") or row == "_lazy/"]


def _engine_rows() -> list[str]:
    return [row for row in _rows("_lazy/") if row != "_lazy/"]


def _row_of(module: str, rows: list[str]) -> str | None:
    """The most specific row holding ``module``: its file, or the folder it lives under."""
    path = MODULES[module].relative_to(PACKAGE).as_posix()
    holding = [row for row in rows if path == row or (row.endswith("/") and path.startswith(row))]
    return max(holding, key=len, default=None)


def _upward(path: pathlib.Path, rows: list[str], source: str | None = None) -> list[str]:
    """The imports of ``path`` that do not point to a row below its own."""
    module = _module_name(path)
    mine = _row_of(module, rows)
    offenders = []
    above_root = rows.index(mine) < rows.index("__init__.py") if "__init__.py" in rows else False
    for name, _ in _imports(path, source):
        if name == "spmd_torch" and module != "spmd_torch" and not above_root:
            offenders.append(f"{module} imports the package root")
            continue
        theirs = _row_of(name, rows) if name in MODULES else None
        if theirs is None or theirs == mine:
            continue
        if rows.index(theirs) <= rows.index(mine):
            offenders.append(f"{module} ({mine}) imports {name} ({theirs})")
    return offenders


def test_every_module_has_a_row_in_each_table():
    package_rows, engine_rows = _package_rows(), _engine_rows()
    missing = [m for m in MODULES if _row_of(m, package_rows) is None]
    assert not missing, f"add rows to docs/architecture.md's package table for: {missing}"
    engine = [m for m in MODULES if m.startswith("spmd_torch._lazy.") and m != "spmd_torch._lazy"]
    missing = [m for m in engine if _row_of(m, engine_rows) is None]
    assert not missing, f"add rows to docs/architecture.md's engine table for: {missing}"


def test_no_table_row_is_stale():
    for row in _package_rows() + _engine_rows():
        exists = (PACKAGE / row).is_dir() if row.endswith("/") else (PACKAGE / row).is_file()
        assert exists, f"docs/architecture.md lists {row}, which does not exist"


def test_modules_import_only_rows_below_theirs():
    offenders = [line for p in PACKAGE.rglob("*.py") for line in _upward(p, _package_rows())]
    assert not offenders, "\n".join(offenders)


def test_engine_modules_import_only_rows_below_theirs():
    offenders = [line for p in ENGINE.rglob("*.py") for line in _upward(p, _engine_rows())]
    assert not offenders, "\n".join(offenders)


def test_no_engine_module_imports_inside_a_function():
    hidden = [
        f"{path.relative_to(PACKAGE)} imports {name} inside a function"
        for path in sorted(ENGINE.rglob("*.py"))
        for name, nested in _imports(path)
        if nested
    ]
    assert not hidden, "\n".join(hidden)


# --- no cycles -----------------------------------------------------------------------------------


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _edges(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    edges = {}
    for module, path in MODULES.items():
        source = (sources or {}).get(module)
        edges[module] = {n for n, _ in _imports(path, source) if n in MODULES} - {module}
    return edges


def test_no_import_cycle_anywhere():
    assert _cycles(_edges()) == []


# --- the checks see what they must ---------------------------------------------------------------


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
def test_engine_check_sees_upward_imports(source, upward):
    assert bool(_upward(ENGINE / "tensor.py", _engine_rows(), source)) is upward


@pytest.mark.parametrize(
    "module, source, upward",
    [
        ("runtime.py", "from spmd_torch.core import xla_model\n", True),
        ("core/xla_model.py", "import spmd_torch\n", True),  # the root, from inside
        ("core/xla_model.py", "from spmd_torch import sync\n", True),
        ("core/xla_model.py", "from spmd_torch import runtime\n", False),  # a module below
        ("_lazy/engine.py", "from spmd_torch.distributed import xla_backend\n", True),
    ],
)
def test_package_check_sees_upward_imports(module, source, upward):
    assert bool(_upward(PACKAGE / module, _package_rows(), source)) is upward


def test_cycle_check_sees_a_new_circle_in_distributed():
    sources = {"spmd_torch.distributed.spmd.validate": "from .mesh import Mesh\n"}
    assert ["spmd_torch.distributed.spmd.mesh", "spmd_torch.distributed.spmd.validate"] in (
        _cycles(_edges(sources))
    )


def test_import_check_sees_imports_inside_functions():
    source = "import jax\n\ndef f():\n    from .execute import to_cpu\n"
    found = _imports(ENGINE / "tensor.py", source)
    assert ("spmd_torch._lazy.execute", True) in found and ("jax", False) not in found


# --- what `import spmd_torch` costs ----------------------------------------------------------------


def test_import_leaves_dtensor_and_checkpointing_for_their_first_use():
    """``import spmd_torch`` takes torch and JAX only: the DTensor and checkpoint packages, which
    ``_XLAC`` (PyTorch/XLA's binding) needs, took as long again; they come with its first use."""
    heavy = ("torch.distributed.tensor", "orbax.checkpoint", "spmd_torch._XLAC")
    code = (
        "import sys, spmd_torch\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
        "spmd_torch._XLAC._xla_runtime_is_initialized()\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    run = [sys.executable, "-c", code]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["[]", repr(list(heavy))]
