"""The graph carries sharding constraints: they reach the program and the cache key."""

from __future__ import annotations

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import spmd_torch
from spmd_torch._lazy import compile as compiler
from spmd_torch._lazy.graph import linearize
from tests.helpers import assert_close

dev = spmd_torch.device()


def _program_of(t):
    program = linearize([t._ref()])
    return program, [node.arrays[i] for node, i in program.leaves]


def test_node_sharding_constraint_reaches_the_program_and_the_key():
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    x = torch.arange(32.0).reshape(8, 4).to(dev)
    spmd_torch.sync()
    data = x._storage.ref[0]  # replicate it over the mesh, as placing data on a mesh will
    data.arrays[0] = jax.device_put(data.arrays[0], NamedSharding(mesh, PartitionSpec()))
    y = x * 2
    program, arrays = _program_of(y)
    unconstrained = compiler.cache_key(program, arrays, (False,)).parts()
    y._ref()[0].shardings = (NamedSharding(mesh, PartitionSpec("x", None)),)
    constrained = compiler.cache_key(program, arrays, (False,)).parts()
    assert constrained != unconstrained
    hlo = compiler.stablehlo_text(program, arrays)
    assert "sharding_constraint" in hlo or "custom_call @Sharding" in hlo  # Shardy or GSPMD
    result = spmd_torch._lazy.execute.materialize([y])[0]
    assert result.sharding.shard_shape(result.shape) == (1, 4)
    assert_close(y, torch.arange(32.0).reshape(8, 4) * 2)
