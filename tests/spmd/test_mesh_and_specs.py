"""Mesh, HybridMesh, the global mesh, and (mesh, partition spec) -> jax NamedSharding."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch.distributed.spmd import mesh as mesh_module


@pytest.fixture
def restore_global_mesh():
    saved = xs.get_global_mesh()
    yield
    xs.set_global_mesh(saved)


def test_mesh_values_match_torch_xla_example():
    mesh = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    np.testing.assert_array_equal(mesh.get_logical_mesh(), np.arange(8).reshape(4, 2))
    assert mesh.shape() == OrderedDict([("x", 4), ("y", 2)])
    assert list(mesh.shape()) == ["x", "y"]
    assert mesh.size() == 8
    assert mesh.mesh_shape == (4, 2)
    assert mesh.axis_names == ("x", "y")
    assert mesh.get_axis_name_idx("y") == 1
    assert mesh.get_axis_name_idx("z") is None


def test_mesh_unnamed_shape_keys_are_axis_indices():
    mesh = xs.Mesh(list(range(8)), (2, 4))
    assert mesh.shape() == OrderedDict([(0, 2), (1, 4)])
    assert mesh.axis_names is None
    assert mesh.get_axis_name_idx("x") is None


def test_mesh_logical_mesh_follows_device_id_order():
    ids = [7, 6, 5, 4, 3, 2, 1, 0]
    mesh = xs.Mesh(ids, (2, 4))
    np.testing.assert_array_equal(mesh.get_logical_mesh(), np.array(ids).reshape(2, 4))
    devices = mesh.get_jax_mesh().devices
    assert [d.id for d in devices.flat] == [jax.devices()[i].id for i in ids]


def test_mesh_is_frozen_hashable_and_compared_by_value():
    a = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    b = xs.Mesh(list(range(8)), [4, 2], ["x", "y"])
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != xs.Mesh(np.arange(8), (4, 2), ("y", "x"))
    assert a != xs.Mesh(np.arange(8), (2, 4), ("x", "y"))
    with pytest.raises(AttributeError, match="immutable.*mesh_shape"):
        a.mesh_shape = (8,)
    with pytest.raises(ValueError):
        a.device_ids[0] = 5  # the id array is read-only


def test_mesh_round_trips_through_str_and_pickle():
    mesh = xs.Mesh(np.arange(8)[::-1], (2, 4), ("a", "b"))
    assert xs.Mesh.from_str(str(mesh)) == mesh
    assert xs.Mesh.from_str("not a mesh") is None
    assert pickle.loads(pickle.dumps(mesh)) == mesh


def test_jax_mesh_is_plain_with_auto_axes_and_cached():
    mesh = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    jax_mesh = mesh.get_jax_mesh()
    assert isinstance(jax_mesh, jax.sharding.Mesh)
    assert jax_mesh.axis_names == ("x", "y")
    assert all(t == jax.sharding.AxisType.Auto for t in jax_mesh.axis_types)
    assert jax_mesh is xs.Mesh(np.arange(8), (4, 2), ("x", "y")).get_jax_mesh()


def test_jax_mesh_names_unnamed_axes_like_torch_xla():
    jax_mesh = xs.Mesh(np.arange(8), (2, 2, 2)).get_jax_mesh()
    assert jax_mesh.axis_names == ("0", "1", "2")


def _hybrid_reference(ici, dcn):
    """PyTorch/XLA's layout: one block of devices per DCN coordinate, put together by np.block."""
    block = int(np.prod(ici))
    granules = [np.arange(g * block, (g + 1) * block).reshape(ici) for g in range(np.prod(dcn))]
    granule_mesh = np.arange(len(granules)).reshape(dcn)
    blocks = np.vectorize(lambda g: granules[g], otypes=[object])(granule_mesh)
    return np.block(blocks.tolist())


@pytest.mark.parametrize(
    "ici, dcn",
    [
        ((1, 4), (2, 1)),
        ((2, 2), (2, 1)),
        ((2, 2), (1, 2)),
        ((1, 4, 1), (2, 1, 1)),
        ((2, 1), (2, 2)),
    ],
    ids=str,
)
def test_hybrid_mesh_orders_devices_in_blocks_per_dcn_coordinate(ici, dcn):
    mesh = xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn)
    assert mesh.mesh_shape == tuple(i * d for i, d in zip(ici, dcn))
    assert mesh.ici_mesh_shape == ici and mesh.dcn_mesh_shape == dcn
    np.testing.assert_array_equal(mesh.get_logical_mesh(), _hybrid_reference(ici, dcn))


def test_hybrid_mesh_dcn_rows_hold_contiguous_device_blocks():
    mesh = xs.HybridMesh((1, 4), (2, 1), ("data", "fsdp"))
    assert mesh.shape() == OrderedDict([("data", 2), ("fsdp", 4)])
    np.testing.assert_array_equal(mesh.get_logical_mesh(), [[0, 1, 2, 3], [4, 5, 6, 7]])


def _tpu_v4_8(slice_index: int, names: list[int]) -> list[dict]:
    """A v4-8 slice's device attributes as PyTorch/XLA's runtime gives them: a 2x2x1 torus."""
    coords = ([0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0])
    return [
        {"name": f"TPU:{n}", "coords": c, "core_on_chip": 0, "slice_index": slice_index}
        for n, c in zip(names, coords)
    ]


def test_hybrid_mesh_over_two_tpu_slices_follows_their_attributes(monkeypatch):
    """PyTorch/XLA's test_hybrid_mesh: two v4-8 slices whose device names are shuffled against
    their torus coordinates; the expected layout is the one PyTorch/XLA 2.9 builds."""
    attributes = _tpu_v4_8(0, [2, 1, 0, 3]) + _tpu_v4_8(1, [4, 7, 6, 5])
    monkeypatch.setattr(xr, "global_runtime_device_attributes", lambda: attributes)
    mesh = xs.HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1))
    assert mesh.get_logical_mesh().tolist() == [[2, 1], [0, 3], [4, 7], [6, 5]]


def test_hybrid_mesh_dcn_shape_must_count_the_slices(monkeypatch):
    attributes = _tpu_v4_8(0, [0, 1, 2, 3]) + _tpu_v4_8(1, [4, 5, 6, 7])
    monkeypatch.setattr(xr, "global_runtime_device_attributes", lambda: attributes)
    with pytest.raises(ValueError, match=r"dcn_mesh_shape \(1, 1\) spans 1 .* form 2"):
        xs.HybridMesh(ici_mesh_shape=(2, 4))


def test_hybrid_mesh_default_dcn_is_a_plain_mesh():
    mesh = xs.HybridMesh(ici_mesh_shape=(2, 4), axis_names=("x", "y"))
    assert mesh.dcn_mesh_shape == (1, 1)
    assert mesh == xs.Mesh(np.arange(8), (2, 4), ("x", "y"))
    assert isinstance(mesh, xs.Mesh)


@pytest.mark.parametrize("name", [None, "data"])
def test_get_1d_mesh_spans_every_device(name):
    mesh = xs.get_1d_mesh(name)
    assert mesh.mesh_shape == (jax.device_count(),)
    assert mesh.axis_names == (None if name is None else (name,))
    np.testing.assert_array_equal(mesh.device_ids, np.arange(jax.device_count()))


def test_global_mesh_set_and_get(restore_global_mesh):
    mesh = xs.get_1d_mesh("data")
    xs.set_global_mesh(mesh)
    assert xs.get_global_mesh() is mesh
    xs.set_global_mesh(None)
    assert xs.get_global_mesh() is None


MESH_42 = ((4, 2), ("x", "y"))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ((0, None), PartitionSpec("x", None)),
        (("x", None), PartitionSpec("x", None)),
        ((None, 1), PartitionSpec(None, "y")),
        ((0, 1), PartitionSpec("x", "y")),
        ((1, 0), PartitionSpec("y", "x")),
        ((None, None), PartitionSpec(None, None)),
        (((0, 1), None), PartitionSpec(("x", "y"), None)),
        ((("y", "x"),), PartitionSpec(("y", "x"))),
        (((0,), None), PartitionSpec("x", None)),
        ((), PartitionSpec()),
        ([0, None], PartitionSpec("x", None)),
        (PartitionSpec("x", None), PartitionSpec("x", None)),
    ],
    ids=str,
)
def test_spec_maps_to_named_sharding(spec, expected):
    mesh = xs.Mesh(np.arange(8), *MESH_42)
    sharding = mesh.get_named_sharding(spec)
    assert isinstance(sharding, NamedSharding)
    assert sharding.mesh is mesh.get_jax_mesh()
    assert sharding.spec == expected


def test_unnamed_mesh_spec_maps_to_index_names():
    mesh = xs.Mesh(np.arange(8), (4, 2))
    assert mesh.get_named_sharding((1, 0)).spec == PartitionSpec("1", "0")


def test_named_sharding_is_built_once_per_mesh_object_and_spec():
    """However the spec names its axes; an equal mesh built anew builds its own, equal, one."""
    mesh = xs.Mesh(np.arange(8), *MESH_42)
    first = mesh.get_named_sharding((0, None))
    assert mesh.get_named_sharding(("x", None)) is first
    assert mesh_module.named_sharding(mesh, [0, None]) is first
    again = xs.Mesh(np.arange(8), *MESH_42).get_named_sharding(("x", None))
    assert again is not first and again == first


@pytest.mark.parametrize(
    "spec, kind",
    [
        ((0, 1), xs.ShardingType.TILED),
        (((0, 1), None), xs.ShardingType.TILED),
        ((0, None), xs.ShardingType.PARTIAL),
        ((None, "y"), xs.ShardingType.PARTIAL),
        ((None, None), xs.ShardingType.REPLICATED),
        ((), xs.ShardingType.REPLICATED),
    ],
    ids=str,
)
def test_sharding_spec_type(spec, kind):
    assert xs.ShardingSpec(xs.Mesh(np.arange(8), *MESH_42), spec).sharding_type is kind


def test_sharding_spec_type_on_1d_mesh_row_sharding_is_tiled():
    assert xs.ShardingSpec(xs.get_1d_mesh(), (0, None)).sharding_type is xs.ShardingType.TILED


def test_sharding_spec_is_frozen_hashable_and_maps_to_cached_named_sharding():
    mesh = xs.Mesh(np.arange(8), *MESH_42)
    spec = xs.ShardingSpec(mesh, ["x", None])
    assert spec.partition_spec == ("x", None)
    assert spec == xs.ShardingSpec(xs.Mesh(np.arange(8), *MESH_42), ("x", None))
    assert hash(spec) == hash(xs.ShardingSpec(mesh, ("x", None)))
    assert spec != xs.ShardingSpec(mesh, ("x", None), minibatch=True)
    assert spec.sharding is mesh.get_named_sharding(("x", None))
    with pytest.raises(AttributeError):
        spec.minibatch = True


def test_sharding_spec_can_apply_and_xla_spec_check_rank():
    spec = xs.ShardingSpec(xs.get_1d_mesh(), (0, None))
    assert spec.can_apply(torch.zeros(2, 3))
    assert not spec.can_apply(torch.zeros(2))
    assert spec.xla_spec(torch.zeros(2, 3)) is spec.sharding
    assert spec.xla_spec(torch.zeros(2)) is None
