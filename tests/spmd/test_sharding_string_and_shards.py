"""mark_sharding on xla tensors: sharding strings, local shards, the XLAShardedTensor wrapper, and
the picture of a sharding."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import rich.align
import rich.box
import rich.console
import rich.padding
import rich.style
import rich.table
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
from spmd_torch._lazy.execute import global_array
from spmd_torch.distributed.spmd._tiling import tiling_of
from tests.helpers import assert_close

dev = spmd_torch.device()
ALL = ",".join(map(str, range(8)))


def _mesh(shape=(8,), names=None, ids=None):
    return xs.Mesh(np.arange(8) if ids is None else ids, shape, names)


# (mesh shape, axis names, device ids, tensor shape, spec, expected string)
STRINGS = {
    "rows": ((8,), None, None, (8, 4), (0, None), f"{{devices=[8,1]{ALL}}}"),
    "columns": ((8,), None, None, (4, 8), (None, 0), f"{{devices=[1,8]{ALL}}}"),
    "vector": ((8,), None, None, (16,), (0,), f"{{devices=[8]{ALL}}}"),
    "both": ((4, 2), ("x", "y"), None, (8, 4), ("x", "y"), f"{{devices=[4,2]{ALL}}}"),
    "both_transposed": ((4, 2), None, None, (4, 8), (1, 0), "{devices=[2,4]0,2,4,6,1,3,5,7}"),
    "replicated": ((4, 2), None, None, (8, 4), (None, None), "{replicated}"),
    "scalar": ((8,), None, None, (), (), "{replicated}"),
    "partial_rows": (
        (4, 2),
        ("x", "y"),
        None,
        (8, 4),
        ("x", None),
        f"{{devices=[4,1,2]{ALL} last_tile_dim_replicate}}",
    ),
    "partial_columns": (
        (4, 2),
        None,
        None,
        (8, 4),
        (None, 1),
        "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}",
    ),
    "partial_3d_mesh": (
        (2, 2, 2),
        None,
        None,
        (4, 4),
        (0, 2),
        "{devices=[2,2,2]0,2,1,3,4,6,5,7 last_tile_dim_replicate}",
    ),
    "merged_axes": (
        (4, 2),
        ("x", "y"),
        None,
        (8, 4),
        (("x", "y"), None),
        f"{{devices=[8,1]{ALL}}}",
    ),
    "merged_axes_minor_first": (
        (4, 2),
        ("x", "y"),
        None,
        (16,),
        (("y", "x"),),
        "{devices=[8]0,2,4,6,1,3,5,7}",
    ),
    "size_1_axis_unused": ((8, 1), None, None, (8, 4), (0, None), f"{{devices=[8,1]{ALL}}}"),
    "custom_device_order": (
        (2, 4),
        None,
        [7, 6, 5, 4, 3, 2, 1, 0],
        (4, 8),
        (0, 1),
        "{devices=[2,4]7,6,5,4,3,2,1,0}",
    ),
}


@pytest.mark.parametrize("case", STRINGS.values(), ids=STRINGS.keys())
def test_sharding_string(case):
    shape, names, ids, tensor_shape, spec, expected = case
    t = torch.zeros(tensor_shape).to(dev)
    xt = xs.mark_sharding(t, _mesh(shape, names, ids), spec)
    assert xs.get_xla_sharding_spec(t) == expected
    assert xt.sharding_spec == expected


@pytest.mark.parametrize("case", STRINGS.values(), ids=STRINGS.keys())
def test_tiling_agrees_with_xla_hlo_sharding(case):
    """Our tile grid and device order are XLA's own (its HloSharding of the same NamedSharding)."""
    shape, names, ids, tensor_shape, spec, _ = case
    sharding = _mesh(shape, names, ids).get_named_sharding(spec)
    hlo = sharding._to_xla_hlo_sharding(len(tensor_shape))
    tiling = tiling_of(sharding, len(tensor_shape))
    if hlo.is_replicated():
        assert tiling.type is xs.ShardingType.REPLICATED
        return
    position = {d.id: k for k, d in enumerate(jax.devices())}
    flat = [position[sharding._device_assignment[k].id] for k in hlo.tile_assignment_devices()]
    dims = list(hlo.tile_assignment_dimensions())
    if hlo.replicate_on_last_tile_dim():
        assert (tiling.tiles, tiling.replicas) == (tuple(dims[:-1]), dims[-1])
    else:
        assert (tiling.tiles, tiling.replicas) == (tuple(dims), 1)
    assert list(tiling.devices) == flat


def test_unsharded_tensor_has_empty_string_and_no_type():
    t = torch.ones(4, 4).to(dev)
    assert xs.get_xla_sharding_spec(t) == ""
    assert xs.XLAShardedTensor(t).sharding_type is None
    assert xs.get_xla_sharding_spec(t * 2) == ""  # pending and unmarked


def test_sharding_type_of_marked_tensors():
    mesh = _mesh((4, 2))
    cases = {(0, 1): "TILED", (0, None): "PARTIAL", (None, None): "REPLICATED"}
    for spec, kind in cases.items():
        xt = xs.mark_sharding(torch.zeros(8, 4).to(dev), mesh, spec)
        assert xt.sharding_type is xs.ShardingType[kind]


def test_pending_value_gets_the_sharding_and_keeps_it_after_sync():
    x = torch.arange(32.0).reshape(8, 4)
    y = x.to(dev) * 2
    xs.mark_sharding(y, _mesh((4, 2), ("x", "y")), ("x", "y"))
    assert xs.get_xla_sharding_spec(y) == f"{{devices=[4,2]{ALL}}}"
    spmd_torch.sync()
    assert xs.get_xla_sharding_spec(y) == f"{{devices=[4,2]{ALL}}}"
    assert_close(y, x * 2)


def test_sharding_survives_in_place_updates():
    x = torch.arange(32.0).reshape(8, 4)
    t = x.to(dev)
    xs.mark_sharding(t, _mesh(), (0, None))
    t.add_(1)
    t.mul_(2)
    spmd_torch.sync()
    assert xs.get_xla_sharding_spec(t) == f"{{devices=[8,1]{ALL}}}"
    assert_close(t, (x + 1) * 2)


def test_mark_sharding_return_value_may_be_ignored():
    x = torch.randn(8, 6)
    w = torch.randn(6, 3)
    t = x.to(dev)
    xs.mark_sharding(t, _mesh(), (0, None))
    assert_close(t @ w.to(dev), x @ w)
    assert_close(t.cpu(), x)


def test_clear_sharding_returns_the_tensor_and_keeps_its_values():
    x = torch.arange(32.0).reshape(8, 4)
    t = x.to(dev)
    xt = xs.mark_sharding(t, _mesh(), (0, None))
    assert xs.clear_sharding(xt) is t
    assert_close(t + 1, x + 1)


# ---- local shards ---------------------------------------------------------------------------


def _check_shards(xt, cpu):
    """Every device holds exactly the block its indices name, with the global tensor's values."""
    shards = xt.local_shards
    assert len(shards) == jax.device_count()
    array = global_array(xt.global_tensor)
    held_by = {d.id: k for k, d in enumerate(jax.devices())}
    for k, (shard, jax_shard) in enumerate(
        zip(shards, sorted(array.addressable_shards, key=lambda s: held_by[s.device.id]))
    ):
        assert shard.shard_device == f"{spmd_torch.runtime.device_type()}:{k}"
        assert held_by[jax_shard.device.id] == k
        assert shard.data.device.type == "cpu"
        assert shard.data.dtype == cpu.dtype
        index = shard.indices if shard.indices is Ellipsis else tuple(shard.indices)
        assert torch.equal(shard.unpadded_data, cpu[index])
        # data is the block as the device holds it: an uneven sharding's zero padding included
        assert tuple(shard.data.shape) == tuple(jax_shard.data.shape)
        padding = shard.data.clone()
        padding[tuple(slice(0, n) for n in shard.unpadded_data.shape)] = 0
        assert not padding.any()
    return shards


@pytest.mark.parametrize(
    "tensor_shape, mesh_shape, spec, shard_shapes",
    [
        ((8, 4), (8,), (0, None), [(1, 4)] * 8),
        ((4, 16), (8,), (None, 0), [(4, 2)] * 8),
        ((8, 4), (4, 2), (0, 1), [(2, 2)] * 8),
        ((10, 4), (8,), (0, None), [(2, 4)] * 5 + [(0, 4)] * 3),
        ((4, 10), (8,), (None, 0), [(4, 2)] * 5 + [(4, 0)] * 3),
        ((5, 3), (4, 2), (0, 1), [(2, 2), (2, 1), (2, 2), (2, 1), (1, 2), (1, 1), (0, 2), (0, 1)]),
        ((7,), (8,), (0,), [(1,)] * 7 + [(0,)]),
    ],
    ids=["rows", "columns", "2d_mesh", "uneven_rows", "uneven_columns", "uneven_both", "vector"],
)
def test_local_shards_tiled(tensor_shape, mesh_shape, spec, shard_shapes):
    cpu = torch.arange(float(np.prod(tensor_shape))).reshape(tensor_shape)
    xt = xs.mark_sharding(cpu.to(dev), _mesh(mesh_shape), spec)
    shards = _check_shards(xt, cpu)
    assert [tuple(s.unpadded_data.shape) for s in shards] == shard_shapes
    padded = tuple(max(shape[d] for shape in shard_shapes) for d in range(len(tensor_shape)))
    assert all(tuple(s.data.shape) == padded for s in shards)  # PyTorch/XLA's: one shape for all
    assert all(s.replica_id == 0 for s in shards)
    assert all(isinstance(s.indices, list) and len(s.indices) == cpu.dim() for s in shards)


def test_local_shards_uneven_rows_indices_are_clipped_to_the_tensor():
    cpu = torch.arange(40.0).reshape(10, 4)
    shards = xs.mark_sharding(cpu.to(dev), _mesh(), (0, None)).local_shards
    assert [s.indices[0] for s in shards] == [
        slice(0, 2, 1),
        slice(2, 4, 1),
        slice(4, 6, 1),
        slice(6, 8, 1),
        slice(8, 10, 1),
        slice(10, 10, 1),
        slice(10, 10, 1),
        slice(10, 10, 1),
    ]
    assert all(s.indices[1] == slice(0, 4, 1) for s in shards)


def test_local_shards_partial_replication_replica_ids():
    cpu = torch.arange(32.0).reshape(8, 4)
    xt = xs.mark_sharding(cpu.to(dev), _mesh((4, 2), ("x", "y")), ("x", None))
    shards = _check_shards(xt, cpu)
    assert [s.replica_id for s in shards] == [0, 1] * 4
    assert [s.indices[0] for s in shards] == [slice(r, r + 2, 1) for r in (0, 0, 2, 2, 4, 4, 6, 6)]


def test_local_shards_partial_replication_along_the_major_axis():
    cpu = torch.arange(32.0).reshape(8, 4)
    xt = xs.mark_sharding(cpu.to(dev), _mesh((4, 2)), (None, 1))
    shards = _check_shards(xt, cpu)
    assert [s.replica_id for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.indices[1] for s in shards] == [slice(0, 2, 1), slice(2, 4, 1)] * 4


def test_local_shards_replicated_use_ellipsis_and_device_ordinals():
    cpu = torch.arange(12.0).reshape(3, 4)
    xt = xs.mark_sharding(cpu.to(dev), _mesh((4, 2)), (None, None))
    shards = _check_shards(xt, cpu)
    assert all(s.indices is Ellipsis for s in shards)
    assert [s.replica_id for s in shards] == list(range(8))
    assert all(torch.equal(s.data, cpu) for s in shards)


def test_local_shards_of_a_pending_value_are_computed():
    cpu = torch.arange(40.0).reshape(10, 4)
    y = cpu.to(dev) + 1
    xt = xs.mark_sharding(y, _mesh(), (0, None))
    _check_shards(xt, cpu + 1)


def test_local_shards_custom_device_order_place_blocks_by_mesh_position():
    cpu = torch.arange(16.0).reshape(8, 2)
    xt = xs.mark_sharding(cpu.to(dev), _mesh(ids=[7, 6, 5, 4, 3, 2, 1, 0]), (0, None))
    shards = _check_shards(xt, cpu)
    assert [s.indices[0].start for s in shards] == [7, 6, 5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.bool], ids=str)
def test_local_shards_keep_the_dtype(dtype):
    cpu = (torch.arange(24).reshape(6, 4) % 3).to(dtype)
    xt = xs.mark_sharding(cpu.to(dev), _mesh(), (0, None))
    _check_shards(xt, cpu)


# ---- the XLAShardedTensor wrapper -----------------------------------------------------------


def test_sharded_tensor_wrapper_forwards_to_the_global_tensor():
    x = torch.arange(32.0).reshape(8, 4)
    t = x.to(dev)
    xt = xs.mark_sharding(t, _mesh(), (0, None))
    assert xt.global_tensor is t
    assert xs.mark_sharding(xt, _mesh(), (0, None)) is xt
    assert xt.shape == (8, 4) and xt.dtype == torch.float32 and xt.device == dev
    results = {
        "xt + 1": (xt + 1, x + 1),
        "1 - xt": (1 - xt, 1 - x),
        "torch.add": (torch.add(xt, xt), x + x),
        "t * xt": (x.to(dev) * xt, x * x),
        "sum": (xt.sum(dim=0), x.sum(dim=0)),
        "slice": (xt[2:4], x[2:4]),
        "relu": (torch.nn.functional.relu(xt - 10), torch.relu(x - 10)),
    }
    for name, (result, expected) in results.items():
        assert type(result) is xs.XLAShardedTensor, name  # an op on one gives one back
        assert_close(result.full_tensor(), expected)
    assert len(xt) == 8
    assert repr(xt).startswith("XLAShardedTensor(")
    assert isinstance(xt, torch.Tensor)


def test_sharded_tensor_in_place_ops_keep_the_wrapper_and_reach_the_tensor():
    x = torch.arange(8.0)
    t = x.to(dev)
    xt = xs.mark_sharding(t, _mesh(), (0,))
    alias = xt
    xt += 1
    xt[0] = 100.0
    assert xt is alias and xt.add_(0) is alias
    expected = x + 1
    expected[0] = 100.0
    assert_close(t, expected)


def test_gradients_through_the_wrapper_reach_the_tensor():
    w = torch.randn(8, 4).to(dev).requires_grad_()
    xt = xs.mark_sharding(w, _mesh(), (0, None))
    (xt * 3).sum().backward()
    assert_close(w.grad, torch.full((8, 4), 3.0))


def test_wrap_if_sharded():
    marked = torch.zeros(8, 2).to(dev)
    xs.mark_sharding(marked, _mesh(), (0, None))
    assert isinstance(xs.wrap_if_sharded(marked), xs.XLAShardedTensor)
    plain = torch.zeros(8, 2).to(dev)
    assert xs.wrap_if_sharded(plain) is plain
    assert xs.wrap_if_sharded(3) == 3


# ---- visualize ------------------------------------------------------------------------------


def _rendered(table) -> str:
    console = rich.console.Console()
    with console.capture() as capture:
        console.print(table)
    return capture.get()


def _expected(rows: list[list[str]]) -> str:
    """The table PyTorch/XLA 2.9's visualize_sharding builds for these cells, rendered (the
    recipe its test_spmd_debugging.py checks it against)."""
    plain = rich.console.Console().color_system is None
    table = rich.table.Table(
        show_header=False,
        show_lines=plain,
        padding=0,
        highlight=plain,
        pad_edge=False,
        box=rich.box.SQUARE if plain else None,
    )
    for row in rows:
        table.add_row(
            *(
                rich.padding.Padding(
                    rich.align.Align(text, "center", vertical="middle"),
                    (1, 1, 1, 1),
                    style=rich.style.Style(bgcolor=None, color=None),
                )
                for text in row
            )
        )
    return _rendered(table)


def test_visualize_1d_tensor_one_row_of_blocks(capsys):
    t = torch.zeros(16).to(dev)
    xs.mark_sharding(t, _mesh(), (0,))
    table = xs.visualize_tensor_sharding(t)
    assert _rendered(table) == _expected([[f"CPU {k}" for k in range(8)]])
    printed = capsys.readouterr().out
    assert printed.startswith(f"Visualizing {{devices=[8]{ALL}}}") and "CPU 7" in printed


def test_visualize_2d_tensor_grid_of_blocks():
    t = torch.zeros(8, 8).to(dev)
    xt = xs.mark_sharding(t, _mesh((4, 2)), (0, 1))
    table = xs.visualize_tensor_sharding(xt)
    assert _rendered(table) == _expected([[f"CPU {r}", f"CPU {r + 1}"] for r in range(0, 8, 2)])


def test_visualize_partial_replication_lists_replica_groups():
    t = torch.zeros(8, 8).to(dev)
    xs.mark_sharding(t, _mesh((4, 2)), (0, None))
    table = xs.visualize_tensor_sharding(t)
    assert _rendered(table) == _expected([[f"CPU [{r}, {r + 1}]"] for r in range(0, 8, 2)])


def test_visualize_replicated_one_block_on_every_device():
    t = torch.zeros(8, 8).to(dev)
    xs.mark_sharding(t, _mesh((4, 2)), (None, None))
    table = xs.visualize_tensor_sharding(t, use_color=False)
    assert _rendered(table) == _expected([[f"CPU {list(range(8))}"]])


def test_visualize_sharding_from_string_as_pytorch_xla_draws_it():
    """PyTorch/XLA's test_debugging_spmd_multi_host_tiled_cpu's string and cells."""
    sharding = "{devices=[2,8]0,4,8,12,2,6,10,14,1,5,9,13,3,7,11,15}"
    order = [int(d) for d in sharding[sharding.index("]") + 1 : -1].split(",")]
    expected = _expected([[f"CPU {d}" for d in order[:8]], [f"CPU {d}" for d in order[8:]]])
    assert _rendered(xs.visualize_sharding(sharding)) == expected


def test_visualize_rejects_unsharded_and_3d_tensors():
    with pytest.raises(ValueError, match=r"shape \(4, 4\) has no sharding"):
        xs.visualize_tensor_sharding(torch.zeros(4, 4).to(dev))
    t = torch.zeros(8, 2, 2).to(dev)
    xs.mark_sharding(t, _mesh(), (0, None, None))
    with pytest.raises(ValueError, match=r"1-D and 2-D tensors, got shape \(8, 2, 2\)"):
        xs.visualize_tensor_sharding(t)
    with pytest.raises(ValueError, match="cannot draw sharding 'bogus'"):
        xs.visualize_sharding("bogus")


@pytest.mark.parametrize("case", STRINGS.values(), ids=STRINGS.keys())
def test_tiling_of_other_shardings_is_read_from_their_hlo_sharding(case):
    """Shardings that are not NamedSharding (jax's internal GSPMDSharding) tile the same way."""
    from jax._src import sharding_impls

    gspmd = getattr(sharding_impls, "GSPMDSharding", None)
    if gspmd is None:
        pytest.skip("this jax has no GSPMDSharding")
    shape, names, ids, tensor_shape, spec, expected = case
    named = _mesh(shape, names, ids).get_named_sharding(spec)
    ndim = len(tensor_shape)
    other = gspmd(named._device_assignment, named._to_xla_hlo_sharding(ndim))
    assert tiling_of(other, ndim).text() == expected


def test_deepcopy_of_the_wrapper_is_a_wrapper():
    import copy

    x = torch.arange(8.0)
    xt = xs.mark_sharding(x.to(dev), _mesh(), (0,))
    clone = copy.deepcopy(xt)
    assert isinstance(clone, xs.XLAShardedTensor)
    assert clone.global_tensor is not xt.global_tensor
    assert_close(clone.global_tensor, x)
