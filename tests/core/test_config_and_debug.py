"""The bf16 switches, recompilation reasons and the pending graph as text / StableHLO."""

from __future__ import annotations

import jax.numpy as jnp
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


def test_debug_level_names_the_changed_node(capsys):
    compiler.clear_cache()  # the reason compares with earlier keys: only these two
    with config.override(PT_XLA_DEBUG_LEVEL=1):
        for n in (4, 5):
            (torch.ones(n, device=dev) * 2).sum().item()
    lines = [line for line in capsys.readouterr().err.splitlines() if "compile key=" in line]
    assert "MISS" in lines[-1] and "test_config_and_debug.py" in lines[-1]
    assert "graph changed at node 0 (op/args): aten.ones.default(((4,),)" in lines[-1]
    assert "-> aten.ones.default(((5,),)" in lines[-1]


def test_debug_level_names_a_rewired_node(capsys):
    a, b = torch.ones(3).to(dev), torch.zeros(3).to(dev)
    spmd_torch.sync()
    compiler.clear_cache()  # the reason compares with earlier keys: only these two
    with config.override(PT_XLA_DEBUG_LEVEL=1):
        (a - b).cpu()
        (a - a).cpu()  # the same op, wired to other inputs
    lines = [line for line in capsys.readouterr().err.splitlines() if "compile key=" in line]
    assert "graph changed at node 0 (inputs): aten.sub.Tensor" in lines[-1]


def test_debug_level_explains_an_input_shape_change(capsys):
    spmd_torch.sync()
    with config.override(PT_XLA_DEBUG_LEVEL=1):
        for n in (6, 7):
            x = torch.ones(n).to(dev)
            spmd_torch.sync()
            (x * 3).cpu()
    last = [line for line in capsys.readouterr().err.splitlines() if "compile key=" in line][-1]
    assert "input shapes/dtypes/shardings changed: input 0: ((6,)" in last, last


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


def test_debug_level_2_dumps_the_graph_with_source_lines(capsys):
    with config.override(PT_XLA_DEBUG_LEVEL=2):
        x = torch.ones(3).to(dev)
        (x * 5).cpu()
    err = capsys.readouterr().err
    assert "aten.mul.Tensor(%in0" in err and "# test_config_and_debug.py:" in err
