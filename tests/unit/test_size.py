"""The engine stays within its line budget (tools/sz.py)."""

import importlib.util
import pathlib

_SZ = pathlib.Path(__file__).resolve().parents[2] / "tools" / "sz.py"


def test_engine_within_line_budget():
    spec = importlib.util.spec_from_file_location("sz", _SZ)
    sz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sz)
    total = sum(sz.engine_lines().values())
    assert 500 < total <= sz.BUDGET, f"spmd_torch/_lazy has {total} lines, budget {sz.BUDGET}"
