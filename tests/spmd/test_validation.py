"""Bad meshes, specs and tensors: each error is a ValueError that names the culprit."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs

dev = spmd_torch.device()


@pytest.fixture
def mesh():
    return xs.Mesh(np.arange(8), (4, 2), ("x", "y"))


@pytest.fixture
def t():
    return torch.zeros(8, 4).to(dev)


# ---- meshes ---------------------------------------------------------------------------------

MESH_ERRORS = {
    "names_length": (
        (range(8), (4, 2), ("x",)),
        r"Mesh has 2 dimensions \(mesh_shape=\(4, 2\)\) but 1 axis names \('x',\)",
    ),
    "names_repeated": ((range(8), (4, 2), ("x", "x")), r"unique: \['x'\] repeated in \('x', 'x'\)"),
    "names_not_strings": ((range(8), (4, 2), (0, 1)), r"must be strings, got 0 in \(0, 1\)"),
    "shape_product": (
        (range(8), (4, 4), None),
        r"mesh_shape \(4, 4\) holds 16 devices but 8 device ids were given",
    ),
    "shape_not_positive": ((range(8), (8, 0), None), r"must be positive, got \(8, 0\)"),
    "shape_not_ints": ((range(8), (4.0, 2), None), r"must be ints, got 4.0 in \(4.0, 2\)"),
    "ids_repeated": (([0, 0, 1, 2, 3, 4, 5, 6], (8,), None), r"unique: \[0\] repeated"),
    "ids_out_of_range": (
        ([0, 1, 2, 3, 4, 5, 6, 8], (8,), None),
        r"device ids \[8\] are out of range: ids index the 8 devices .* \[0, 8\)",
    ),
    "ids_negative": (
        ([-1, 1, 2, 3, 4, 5, 6, 7], (8,), None),
        r"device ids \[-1\] are out of range",
    ),
    "ids_not_flat": ((np.arange(8).reshape(4, 2), (4, 2), None), r"flat list.*shape \(4, 2\)"),
    "ids_not_ints": ((np.arange(8.0), (8,), None), r"must be integers, got dtype float64"),
    "size_vs_device_count": (
        (range(4), (4,), None),
        r"Mesh of shape \(4,\) has 4 devices but the program runs on 8 \(jax.device_count\(\)\)",
    ),
}


@pytest.mark.parametrize("args, message", MESH_ERRORS.values(), ids=MESH_ERRORS.keys())
def test_bad_mesh(args, message):
    assert jax.device_count() == 8
    with pytest.raises(ValueError, match=message):
        xs.Mesh(*args)


def test_hybrid_mesh_shapes_of_different_lengths():
    with pytest.raises(ValueError, match=r"ici_mesh_shape \(1, 4\) and dcn_mesh_shape \(2,\)"):
        xs.HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(2,))


def test_hybrid_mesh_larger_than_the_devices():
    with pytest.raises(ValueError, match=r"Mesh of shape \(4, 4\) has 16 devices .* runs on 8"):
        xs.HybridMesh(ici_mesh_shape=(2, 4), dcn_mesh_shape=(2, 1))


def test_hybrid_mesh_non_positive_shape():
    with pytest.raises(ValueError, match=r"must be positive, got \(0, 8\)"):
        xs.HybridMesh(ici_mesh_shape=(0, 8), dcn_mesh_shape=(1, 1))


def test_set_global_mesh_needs_a_mesh():
    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    with pytest.raises(ValueError, match="expected a spmd_torch.distributed.spmd.Mesh, got Mesh"):
        xs.set_global_mesh(jax_mesh)
    assert xs.get_global_mesh() is None


# ---- partition specs ------------------------------------------------------------------------

SPEC_ERRORS = {
    "unknown_name": (
        ("z", None),
        r"Axis name 'z' in partition_spec \('z', None\) is not an axis of the mesh, whose axes "
        r"are \('x', 'y'\)",
    ),
    "unknown_name_in_tuple": ((("x", "w"), None), r"Axis name 'w' .* axes are \('x', 'y'\)"),
    "index_out_of_range": (
        (2, None),
        r"Axis index 2 in partition_spec \(2, None\) is out of range for a mesh of shape "
        r"\(4, 2\) \(valid: 0..1\)",
    ),
    "index_negative": ((None, -1), r"Axis index -1 .* out of range"),
    "axis_twice": ((0, 0), r"Mesh axis 'x' is used more than once in partition_spec \(0, 0\)"),
    "axis_twice_by_name_and_index": (("y", 1), r"Mesh axis 'y' is used more than once"),
    "axis_twice_in_tuple": (
        (("x", "y"), "x"),
        r"Mesh axis 'x' is used more than once in partition_spec \(\('x', 'y'\), 'x'\)",
    ),
    "nested_tuple": ((((0,),), None), r"nests tuples in entry \(\(0,\),\)"),
    "float_entry": ((1.5, None), r"entry 1.5 of type float"),
    "bool_entry": ((True, None), r"entry True of type bool"),
    "not_a_tuple": ("x", r"partition_spec must be a tuple .* got 'x' of type str"),
    "int_not_a_tuple": (0, r"got 0 of type int"),
}


@pytest.mark.parametrize("spec, message", SPEC_ERRORS.values(), ids=SPEC_ERRORS.keys())
def test_bad_spec_in_mark_sharding(mesh, t, spec, message):
    with pytest.raises(ValueError, match=message):
        xs.mark_sharding(t, mesh, spec)
    assert xs.get_xla_sharding_spec(t) == ""  # nothing was applied


@pytest.mark.parametrize("spec, message", SPEC_ERRORS.values(), ids=SPEC_ERRORS.keys())
def test_bad_spec_in_sharding_spec(mesh, spec, message):
    with pytest.raises(ValueError, match=message):
        xs.ShardingSpec(mesh, spec)


def test_axis_name_on_an_unnamed_mesh():
    with pytest.raises(ValueError, match=r"Axis name 'x' .* whose axes are unnamed"):
        xs.Mesh(np.arange(8), (8,)).get_named_sharding(("x",))


def test_axis_twice_on_an_unnamed_mesh_names_the_index():
    with pytest.raises(ValueError, match=r"Mesh axis 1 is used more than once"):
        xs.Mesh(np.arange(8), (4, 2)).get_named_sharding((1, 1))


@pytest.mark.parametrize(
    "spec, message",
    [
        ((0,), r"partition_spec \(0,\) has 1 entries but the tensor of shape \(8, 4\) has rank 2"),
        ((0, None, None), r"has 3 entries but the tensor of shape \(8, 4\) has rank 2"),
        ((), r"has 0 entries but the tensor of shape \(8, 4\) has rank 2"),
    ],
    ids=["short", "long", "empty"],
)
def test_spec_rank_must_match_tensor_rank(mesh, t, spec, message):
    with pytest.raises(ValueError, match=message):
        xs.mark_sharding(t, mesh, spec)


# ---- tensors and meshes passed to the APIs --------------------------------------------------


def test_mark_sharding_cpu_tensor_names_the_device(mesh):
    with pytest.raises(
        ValueError, match=r"xla device, got a torch.float32 tensor of shape \(8, 4\) on cpu"
    ):
        xs.mark_sharding(torch.zeros(8, 4), mesh, (0, None))


def test_mark_sharding_non_tensor_names_the_type(mesh):
    with pytest.raises(
        ValueError, match="mark_sharding needs a tensor on the xla device, got a list"
    ):
        xs.mark_sharding([1.0, 2.0], mesh, (0,))


def test_mark_sharding_needs_our_mesh(t):
    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    with pytest.raises(ValueError, match="expected a spmd_torch.distributed.spmd.Mesh, got Mesh"):
        xs.mark_sharding(t, jax_mesh, (0, None))


@pytest.mark.parametrize(
    "api",
    [xs.clear_sharding, xs.get_xla_sharding_spec, xs.visualize_tensor_sharding],
    ids=lambda f: f.__name__,
)
def test_apis_on_cpu_tensors_name_the_api_and_the_device(api):
    message = rf"{api.__name__} needs a tensor on the xla device, got a torch.float32 tensor of shape \(3,\) on cpu"
    with pytest.raises(ValueError, match=message):
        api(torch.zeros(3))


def test_local_shards_of_a_cpu_tensor_names_the_device():
    with pytest.raises(ValueError, match=r"local_shards needs a tensor on the xla device"):
        xs.XLAShardedTensor(torch.zeros(3)).local_shards
