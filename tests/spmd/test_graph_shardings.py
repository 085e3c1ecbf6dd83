"""A sharding constraint is an ordinary node: it reaches the program, its text and the cache key;
an output nobody marked is laid out by the partitioner, as for ``jax.jit``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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
        r"sharding=\{devices=\[8,1\]0,1,2,3,4,5,6,7\}",
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


def test_an_unmarked_output_is_laid_out_as_jax_jit_lays_it_out():
    """PyTorch/XLA's test_sharding_propagation model (one marked layer, SGD): the partitioner
    chooses the layout of the output nobody marked, the one it chooses for the same step written
    in JAX and compiled by ``jax.jit`` with the same input layouts; values as that step's."""
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(128, 64), torch.nn.Linear(64, 1)
    names = {"w1": (fc1, "weight"), "b1": (fc1, "bias"), "w2": (fc2, "weight"), "b2": (fc2, "bias")}
    params = {k: layer.state_dict()[kind].numpy().copy() for k, (layer, kind) in names.items()}
    x = torch.randn(128, 128)
    fc1, fc2 = fc1.to(dev), fc2.to(dev)
    xs.mark_sharding(fc1.weight, xs.Mesh(np.arange(8), (1, 8)), (0, 1))
    optimizer = torch.optim.SGD([*fc1.parameters(), *fc2.parameters()], lr=0.1)
    output = fc2(torch.relu(fc1(x.to(dev))))
    (output**2).mean().backward()
    optimizer.step()
    spmd_torch.sync()

    def step(p, x):
        def loss(p):
            z = jax.nn.relu(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
            return (z**2).mean(), z

        (_, z), grads = jax.value_and_grad(loss, has_aux=True)(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), z

    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("a", "b"))
    layouts = {k: PartitionSpec("a", "b") if k == "w1" else PartitionSpec() for k in params}
    placed = {k: jax.device_put(v, NamedSharding(mesh, layouts[k])) for k, v in params.items()}
    inputs = jax.device_put(jnp.asarray(x.numpy()), NamedSharding(mesh, PartitionSpec()))
    compiled = jax.jit(step).lower(placed, inputs).compile()
    _, z = compiled(placed, inputs)
    ours = global_array(output)
    assert ours.sharding.shard_shape(ours.shape) == z.sharding.shard_shape(z.shape)
    assert ours.sharding.is_fully_replicated == z.sharding.is_fully_replicated
    assert_close(output, torch.from_numpy(np.array(z)), atol=1e-5, rtol=1e-5)
