"""A sharding constraint is an ordinary node: it reaches the program, its text and the cache key."""

from __future__ import annotations

import re

import torch

import spmd_torch
import spmd_torch.debug.graph as graph
import spmd_torch.distributed.spmd as xs
from spmd_torch._lazy import compile as compiler
from spmd_torch._lazy.execute import global_array
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()


def _doubled(x: torch.Tensor, spec: tuple | None) -> torch.Tensor:
    y = x * 2
    if spec is not None:
        xs.mark_sharding(y, xs.get_1d_mesh("x"), spec)
    return y


def test_sharding_constraint_is_a_node_that_reaches_the_program_and_the_key():
    x = torch.arange(32.0).reshape(8, 4).to(dev)
    y = _doubled(x, ("x", None))
    assert graph.pending_text([y]).splitlines()[2:] == [  # after the input and the scalar 2
        "%0:f32[8,4] = aten.mul.Tensor(%in0, %s0)",
        "%1:f32[8,4] = sharding_constraint(%0, {x,_})",
        "return %1",
    ]
    hlo = graph.pending_hlo([y])
    assert re.search(
        r'custom-call\(f32\[8,4\]\{1,0\} %\S+\), custom_call_target="Sharding", '
        r"sharding=\{devices=\[8,1\]<=\[8\]\}",
        hlo,
    )
    spmd_torch.sync()
    result = global_array(y)
    assert result.sharding.shard_shape(result.shape) == (1, 4)
    assert_close(y, torch.arange(32.0).reshape(8, 4) * 2)


def test_a_constraint_changes_the_cache_key():
    x = torch.arange(32.0).reshape(8, 4).to(dev)
    spmd_torch.sync()
    compiler.clear_cache()
    for spec, compiles in [(None, 1), (("x", None), 1), ((None, "x"), 1), (("x", None), 0)]:
        with assert_compiles(compiles):
            y = _doubled(x, spec)
            spmd_torch.sync()
        assert_close(y, torch.arange(32.0).reshape(8, 4) * 2)
