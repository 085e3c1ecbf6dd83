"""The bf16 switches, recompilation reasons and the pending graph as text / StableHLO."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest
import torch

import spmd_torch
from spmd_torch import config
from spmd_torch._lazy import compile as compiler
from spmd_torch._lazy.execute import global_array
from spmd_torch.debug import graph
from tests.helpers import assert_close, assert_compiles, reference

dev = spmd_torch.device()


def test_use_bf16_computes_in_bf16_and_reports_float32():
    values = torch.tensor([1.0 + 2**-10, 3.0, -0.1])
    with config.override(XLA_USE_BF16=True):
        y = values.to(dev) * 3
        spmd_torch.sync()
        assert y.dtype == torch.float32
        assert global_array(y).dtype == jnp.bfloat16
        result = y.cpu()
    assert result.dtype == torch.float32
    assert_close(result, reference(torch.mul, values.bfloat16(), 3).float(), tol="exact")


def test_downcast_bf16_keeps_float64_as_float32():
    with config.override(XLA_DOWNCAST_BF16=True):
        d = torch.tensor([1.0 + 1e-9], dtype=torch.float64).to(dev) + 0
        spmd_torch.sync()
        assert d.dtype == torch.float64
        assert global_array(d).dtype == jnp.float32


def test_bf16_switch_is_part_of_the_cache_key():
    x = torch.ones(4).to(dev)
    spmd_torch.sync()
    compiler.clear_cache()  # an earlier test may have compiled x + 1 already
    with assert_compiles(2):
        (x + 1).cpu()
        with config.override(XLA_USE_BF16=True):
            (x + 1).cpu()


def _analyses(err: str, kind: str = "Compilation") -> list[str]:
    """The debugging tool's analyses of one kind, each as one text."""
    blocks = err.split(f"{kind} Analysis: " + "=" * 80)
    return [b for b in blocks[1:] if f"{kind} Cause" in b]


def test_debug_level_names_the_changed_node(capsys):
    compiler.clear_cache()  # the reason compares with earlier keys: only these two
    with config.override(PT_XLA_DEBUG_LEVEL=1):
        for n in (4, 5):
            (torch.ones(n, device=dev) * 2).sum().item()
    last = _analyses(capsys.readouterr().err)[-1]
    assert "most likely user code trying to access tensor value" in last  # .item(), no barrier
    assert "test_config_and_debug.py" in last and "Graph Hash: " in last
    assert "graph changed at node 0 (op/args): aten.ones.default(((4,),)" in last
    assert "-> aten.ones.default(((5,),)" in last


def test_debug_level_names_a_rewired_node(capsys):
    a, b = torch.ones(3).to(dev), torch.zeros(3).to(dev)
    spmd_torch.sync()
    compiler.clear_cache()  # the reason compares with earlier keys: only these two
    with config.override(PT_XLA_DEBUG_LEVEL=1):
        (a - b).cpu()
        (a - a).cpu()  # the same op, wired to other inputs
    last = _analyses(capsys.readouterr().err)[-1]
    assert "graph changed at node 0 (inputs): aten.sub.Tensor" in last


def test_debug_level_explains_an_input_shape_change(capsys):
    spmd_torch.sync()
    with config.override(PT_XLA_DEBUG_LEVEL=1):
        for n in (6, 7):
            x = torch.ones(n).to(dev)
            spmd_torch.sync()
            (x * 3).cpu()
    last = _analyses(capsys.readouterr().err)[-1]
    assert "input shapes/dtypes/shardings changed: input 0: ((6,)" in last, last


def test_debug_level_2_analyses_each_run_and_names_the_barrier(capsys):
    x = torch.ones(3).to(dev)
    spmd_torch.sync()
    with config.override(PT_XLA_DEBUG_LEVEL=2):
        for _ in range(2):
            y = x * 5
            spmd_torch.sync()
    err = capsys.readouterr().err
    runs = _analyses(err, "Execution")
    assert len(runs) == 2 and all("user spmd_torch.sync (xm.mark_step)" in r for r in runs)
    assert len(_analyses(err)) <= 1  # the second run hits the cache
    assert "Number of Graph Outputs: 1" in runs[-1]
    assert_close(y, torch.full((3,), 5.0))


def test_metrics_analysis_names_frequent_compiles_reads_and_fallbacks():
    """PyTorch/XLA's pt-xla-profiler lines, with where in the user's code each happened."""
    from spmd_torch.debug import metrics as met

    met.clear_all()
    with config.override(PT_XLA_DEBUG=True):
        for n in range(1, 13):
            (torch.ones(n, device=dev) * 2).sum().item()  # a compile and a read each step
            spmd_torch.sync()
        torch.ones(4, device=dev).nonzero().cpu()  # a CPU fallback
        report = met.performance_report()
    here = f"test_config_and_debug.py:{_line_of('a compile and a read each step')}"
    assert (
        f"pt-xla-profiler: CompileTime too frequent: 13 counts during 12 steps ({here} x12"
        in report
    )
    assert f"TransferFromDeviceTime too frequent: 14 counts during 12 steps ({here} x12" in report
    assert "Op(s) not lowered: aten::nonzero (test_config_and_debug.py:" in report


def _line_of(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(
        k for k, line in enumerate(lines, start=1) if text in line and "_line_of" not in line
    )


def test_pt_xla_debug_writes_the_analysis_at_exit(tmp_path):
    """PT_XLA_DEBUG=1 ends a run with the analysis, in PT_XLA_DEBUG_FILE when set."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, spmd_torch\n"
        "d = spmd_torch.device()\n"
        "for n in range(1, 13):\n"
        "    print((torch.ones(n, device=d) * 2).sum().item())\n"
        "    spmd_torch.sync()\n"
    )
    out = tmp_path / "debug.txt"
    env = {**os.environ, "PT_XLA_DEBUG": "1", "PT_XLA_DEBUG_FILE": str(out)}
    subprocess.run([sys.executable, str(script)], env=env, check=True, capture_output=True)
    text = out.read_text()
    assert "Compilation Analysis: Compilation Cause" in text  # PT_XLA_DEBUG: level 100
    final = text.rstrip().splitlines()[-2:]
    assert final == [
        "pt-xla-profiler: CompileTime too frequent: 12 counts during 12 steps (train.py:4 x12)",
        "pt-xla-profiler: TransferFromDeviceTime too frequent: 12 counts during 12 steps "
        "(train.py:4 x12)",
    ], final


def test_ir_debug_puts_the_users_lines_into_the_ir_and_hlo_debug_into_the_hlo():
    with config.override(XLA_IR_DEBUG=True):
        x = torch.ones(3).to(dev)
        y = x * 5  # the line the text names
    text = graph.get_tensors_text([y])
    assert f"# test_config_and_debug.py:{_line_of('the line the text names')}" in text
    with config.override(XLA_IR_DEBUG=True, XLA_HLO_DEBUG=True):
        z = x * 7  # the line the HLO names
        hlo = graph.get_tensors_hlo([z])
    assert _hlo_source(hlo, "multiply(") == (__file__, _line_of("the line the HLO names"))
    spmd_torch.sync()


def _hlo_source(hlo: str, opcode: str) -> tuple[str, int]:
    """(file, line) of the first ``opcode`` instruction: its metadata's source_file and
    source_line, or (XLA's newer form) its stack frame through the module's tables."""
    op = next(line for line in hlo.splitlines() if opcode in line)
    if "source_file=" in op:
        return re.search(r'source_file="([^"]+)"', op)[1], int(
            re.search(r"source_line=(\d+)", op)[1]
        )
    table = {}
    for name in ("FileNames", "FileLocations", "StackFrames"):
        block = hlo.split(f"\n{name}\n", 1)[1].split("\n")
        table[name] = {
            int(row.split(" ", 1)[0]): row.split(" ", 1)[1]
            for row in itertools.takewhile(lambda r: r[:1].isdigit(), block)
        }
    frame = table["StackFrames"][int(re.search(r"stack_frame_id=(\d+)", op)[1])]
    location = table["FileLocations"][int(re.search(r"file_location_id=(\d+)", frame)[1])]
    file = table["FileNames"][int(re.search(r"file_name_id=(\d+)", location)[1])].strip('"')
    return file, int(re.search(r" line=(\d+)", location)[1])


def test_a_cpu_fallback_warning_points_at_the_users_line():
    from spmd_torch._lazy import dispatch

    dispatch._WARNED.discard(torch.ops.aten.nonzero.default)
    with pytest.warns(UserWarning, match="runs on the CPU") as caught:
        torch.ones(4, device=dev).nonzero().cpu()
    assert caught[0].filename == __file__


def test_pending_graph_as_text_hlo_and_stablehlo():
    x = torch.ones(2, 3).to(dev)
    spmd_torch.sync()
    y = (x * 2).sum(dim=1)
    text = graph.get_tensors_text([y])
    assert "aten.mul.Tensor" in text and "aten.sum.dim_IntList" in text and "f32[2]" in text
    hlo = graph.get_tensors_hlo([y])
    assert "f32[2,3]{1,0} multiply(f32[2,3]{1,0} %" in hlo and "f32[2]{0} reduce(" in hlo
    stablehlo = graph.pending_stablehlo([y])
    assert "stablehlo.multiply" in stablehlo and "stablehlo.reduce" in stablehlo
    assert_close(y, torch.full((2,), 6.0))
