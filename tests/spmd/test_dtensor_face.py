"""XLAShardedTensor's DTensor face of PyTorch/XLA 2.9: mesh_shape, partition_spec, _spec (a
DTensorSpec, cached), placements, and the constructor's mesh_shape / partition_spec /
requires_grad; each answer read from the tensor's own sharding, so it never disagrees with the
sharding string."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import spmd_torch
import spmd_torch.distributed.spmd as xs
from spmd_torch._lazy import placement
from tests.helpers import assert_close

dev = spmd_torch.device()


def _named_mesh() -> xs.Mesh:
    return xs.Mesh(np.arange(8), (4, 2), ("x", "y"))


# ---- mesh_shape, partition_spec, placements ----------------------------------------------------


@pytest.mark.parametrize(
    "mesh_shape, names, spec, placements",
    [
        ((8,), None, (0, None), (Shard(0),)),
        ((4, 2), ("x", "y"), ("x", None), (Shard(0), Replicate())),
        ((4, 2), ("x", "y"), (None, 1), (Replicate(), Shard(1))),
        ((2, 4), None, (1, 0), (Shard(1), Shard(0))),
        ((2, 4), None, (None, None), (Replicate(), Replicate())),
    ],
    ids=str,
)
def test_mark_sharding_answers_the_mesh_shape_spec_and_placements(
    mesh_shape, names, spec, placements
):
    mesh = xs.Mesh(np.arange(8), mesh_shape, names)
    xt = xs.mark_sharding(torch.ones(8, 8).to(dev), mesh, spec)
    assert xt.mesh_shape == mesh_shape
    assert xt.partition_spec == spec  # as the caller wrote it
    assert xt.placements == placements
    assert isinstance(xt, DTensor)  # a DTensor subclass, as PyTorch/XLA 2.9's


def test_spec_is_a_dtensor_spec_of_the_layout():
    xt = xs.mark_sharding(torch.ones(8, 6).to(dev), _named_mesh(), (None, "y"))
    spec = xt._spec
    assert isinstance(spec, DTensorSpec)
    assert spec.mesh.device_type == "xla" and spec.mesh.mesh_dim_names == ("x", "y")
    assert torch.equal(spec.mesh.mesh, torch.arange(8, dtype=torch.int32).reshape(4, 2))
    assert spec.placements == (Replicate(), Shard(1))
    meta = spec.tensor_meta
    assert (meta.shape, meta.stride, meta.dtype) == (torch.Size([8, 6]), (6, 1), torch.float32)
    assert xt.device_mesh is spec.mesh


def test_spec_is_cached_until_invalidated():
    xt = xs.mark_sharding(torch.ones(8, 4).to(dev), _named_mesh(), ("x", None))
    first = xt._spec
    assert xt._cached_spec is first and xt._spec is first and xt.placements is first.placements
    xt.invalidate_spec_cache()
    assert xt._cached_spec is None
    again = xt._spec
    assert again is not first and again.placements == first.placements
    assert xt._cached_spec is again


def test_spec_follows_a_new_sharding_of_the_tensor():
    t = torch.ones(8, 4).to(dev)
    xt = xs.mark_sharding(t, _named_mesh(), ("x", None))
    first = xt._spec
    xs.mark_sharding(t, _named_mesh(), (None, "y"))  # re-marked behind the wrapper's back
    assert xt._spec is not first
    assert xt.placements == (Replicate(), Shard(1))
    assert xt.partition_spec == (None, "y")  # the old spec no longer describes the layout


def test_a_tensor_wrapped_after_the_fact_reads_its_layout():
    named = torch.ones(8, 8).to(dev)
    xs.mark_sharding(named, _named_mesh(), (("x", "y"), None))
    xt = xs.XLAShardedTensor(named)
    assert (xt.mesh_shape, xt.partition_spec) == ((4, 2), (("x", "y"), None))
    assert xt.placements == (Shard(0), Shard(0))
    unnamed = torch.ones(8, 8).to(dev)
    xs.mark_sharding(unnamed, xs.Mesh(np.arange(8), (2, 4)), (None, 1))
    xt = xs.XLAShardedTensor(unnamed)
    assert (xt.mesh_shape, xt.partition_spec) == ((2, 4), (None, 1))


def test_without_a_sharding_there_is_no_layout_to_answer():
    for t in (torch.ones(3), torch.ones(3).to(dev)):
        xt = xs.XLAShardedTensor(t)
        assert xt.mesh_shape is None and xt.partition_spec is None
    with pytest.raises(ValueError, match=r"_spec: the tensor of shape \(3,\) has no sharding"):
        xs.XLAShardedTensor(torch.ones(3).to(dev))._spec
    with pytest.raises(ValueError, match=r"^Placements not available") as caught:
        xs.XLAShardedTensor(torch.ones(3)).placements
    assert "placements needs a tensor on the xla device" in str(caught.value.__cause__)


# ---- through DTensor's API ---------------------------------------------------------------------


def test_distribute_tensor_answers_the_dtensor_face():
    mesh = DeviceMesh("xla", torch.arange(8))
    cpu = torch.randn(16, 8)
    xt = distribute_tensor(cpu, mesh, [Shard(0)])
    assert xt.placements == (Shard(0),) and xt._spec.placements == (Shard(0),)
    assert (xt.mesh_shape, xt.partition_spec) == ((8,), (0, None))
    assert xt._spec.mesh.shape == mesh.shape and xt._spec.tensor_meta.shape == cpu.shape
    assert xt.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert_close(xt.global_tensor, cpu)


def test_redistribute_gives_the_spec_in_mesh_axis_indices():
    mesh = xs.Mesh(np.arange(8), (2, 4))
    xt = xs.mark_sharding(torch.randn(8, 16).to(dev), mesh, (0, None))
    moved = xt.redistribute(mesh, [Replicate(), Shard(1)])
    assert moved.partition_spec == (None, 1) and moved.mesh_shape == (2, 4)
    assert moved.sharding_spec == "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
    assert xt.redistribute(mesh, [Replicate(), Replicate()]).partition_spec == (None, None)


# ---- the constructor and wrap_as_sharded_tensor ------------------------------------------------


def test_requires_grad_makes_the_wrapper_a_leaf_over_the_same_data():
    t = torch.randn(8, 4).to(dev)
    xs.mark_sharding(t, xs.get_1d_mesh(), (0, None))
    xt = xs.XLAShardedTensor(t, requires_grad=True)
    assert xt.requires_grad and xt.is_leaf and not t.requires_grad
    assert xt.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    (xt * 3).sum().backward()
    assert xt.grad.shape == xt.shape == (8, 4)
    assert type(xt.grad) is xs.XLAShardedTensor
    assert_close(xt.grad.full_tensor(), torch.full((8, 4), 3.0))
    with torch.no_grad():
        t.add_(1)  # the wrapper's tensor is an alias of t, not a copy
    assert_close(xt.global_tensor, t.cpu())


def test_wrap_with_a_mesh_shape_and_spec_lays_the_tensor_out():
    cpu = torch.randn(100, 50)
    xt = xs.wrap_as_sharded_tensor(cpu.to(dev), mesh_shape=(8,), partition_spec=(0, None))
    assert (xt.mesh_shape, xt.partition_spec) == ((8,), (0, None))
    assert xt.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    first = xt._spec
    again = xs.wrap_as_sharded_tensor(xt, mesh_shape=(2, 4), partition_spec=(0, 1))
    assert again is xt and (xt.mesh_shape, xt.partition_spec) == ((2, 4), (0, 1))
    assert xt.sharding_spec == "{devices=[2,4]0,1,2,3,4,5,6,7}"
    assert xt._spec is not first and xt._spec.placements == (Shard(0), Shard(1))
    assert_close(xt.global_tensor, cpu)  # values never change


def test_wrap_with_one_of_the_two_keeps_the_other():
    xt = xs.XLAShardedTensor(torch.randn(8, 8).to(dev), mesh_shape=(8,), partition_spec=(0, None))
    xs.wrap_as_sharded_tensor(xt, mesh_shape=(2, 4))
    assert (xt.mesh_shape, xt.partition_spec) == ((2, 4), (0, None))
    assert xt.sharding_spec == "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    xt.partition_spec = (None, 1)
    assert (xt.mesh_shape, xt.placements) == ((2, 4), (Replicate(), Shard(1)))
    xt.mesh_shape = (4, 2)
    assert xt.sharding_spec == "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"


def test_wrap_keeps_the_mesh_the_tensor_is_sharded_over():
    mesh = xs.Mesh(np.arange(8)[::-1], (2, 4), ("data", "model"))
    t = torch.randn(8, 8).to(dev)
    xs.mark_sharding(t, mesh, ("data", None))
    layout = placement.sharding_of(t)
    xt = xs.wrap_as_sharded_tensor(t, mesh_shape=(2, 4), partition_spec=(0, None))
    assert placement.sharding_of(t) is layout  # laid out so already: nothing moves
    assert xt.partition_spec == (0, None)
    xt.partition_spec = ("model", None)
    assert xt.sharding_spec == "{devices=[4,1,2]7,3,6,2,5,1,4,0 last_tile_dim_replicate}"


def test_wrap_takes_the_global_mesh_of_that_shape():
    xs.set_global_mesh(xs.Mesh(np.arange(8)[::-1], (8,), ("fsdp",)))
    try:
        xt = xs.wrap_as_sharded_tensor(torch.randn(8).to(dev), (8,), ("fsdp",))
        assert xt.sharding_spec == "{devices=[8]7,6,5,4,3,2,1,0}"
    finally:
        xs.set_global_mesh(None)


def test_wrap_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="no sharding to keep the partition spec of"):
        xs.wrap_as_sharded_tensor(torch.ones(8).to(dev), mesh_shape=(8,))
    with pytest.raises(ValueError, match="no mesh_shape given"):
        xs.wrap_as_sharded_tensor(torch.ones(8).to(dev), partition_spec=(0,))
    with pytest.raises(ValueError, match="mesh_shape .* holds 16 devices"):
        xs.wrap_as_sharded_tensor(torch.ones(8).to(dev), (2, 8), (0,))
    with pytest.raises(ValueError, match="needs a tensor on the xla device"):
        xs.XLAShardedTensor(torch.ones(8), mesh_shape=(8,), partition_spec=(0,))
