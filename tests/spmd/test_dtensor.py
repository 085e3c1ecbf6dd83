"""PyTorch's DTensor API on an ``xla`` DeviceMesh: distribute_tensor/distribute_module reach
xs.xla_distribute_tensor/xla_distribute_module, shard as mark_sharding does, and the result answers
DTensor's questions (placements, device_mesh, redistribute, to_local)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_module, distribute_tensor

import spmd_torch
import spmd_torch.distributed.spmd as xs
from spmd_torch.distributed.spmd import api
from tests.helpers import assert_close

dev = spmd_torch.device()
ROUTE = "torch_xla.distributed.spmd"


@pytest.fixture(autouse=True)
def dtensor_route():
    """The route registered for the test, sys.modules as it was afterwards."""
    before = sys.modules.get(ROUTE)
    assert api.register_dtensor_route()
    yield
    if before is None:
        sys.modules.pop(ROUTE, None)
    else:
        sys.modules[ROUTE] = before


def _device_mesh(shape, names=None, ids=None) -> DeviceMesh:
    ids = np.arange(8) if ids is None else np.asarray(ids)
    return DeviceMesh("xla", torch.tensor(ids).reshape(shape), mesh_dim_names=names)


def _shards(xt):
    return [(s.indices, s.data, s.shard_device, s.replica_id) for s in xt.local_shards]


def _assert_same_shards(a, b):
    for (ia, da, dev_a, ra), (ib, db, dev_b, rb) in zip(_shards(a), _shards(b), strict=True):
        assert (ia, dev_a, ra) == (ib, dev_b, rb)
        assert torch.equal(da, db)


# ---- the route from torch.distributed.tensor ------------------------------------------------


def test_route_leaves_torch_xla_unimportable():
    from torch_xla.distributed.spmd import xla_distribute_tensor  # what torch imports

    assert xla_distribute_tensor is xs.xla_distribute_tensor
    assert importlib.util.find_spec("torch_xla") is None
    with pytest.raises(ModuleNotFoundError, match="torch_xla"):
        importlib.import_module("torch_xla")
    assert "torch_xla" not in sys.modules


def test_route_is_not_registered_over_a_real_torch_xla(monkeypatch):
    sys.modules.pop(ROUTE)
    real = importlib.util.spec_from_loader("torch_xla", loader=None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: real)
    assert not api.register_dtensor_route()
    assert ROUTE not in sys.modules


def test_route_registration_is_idempotent_and_replaces_a_stand_in():
    assert api.register_dtensor_route()
    assert sys.modules[ROUTE] is xs
    sys.modules[ROUTE] = types.ModuleType(ROUTE)  # e.g. a lazy route set at `import spmd_torch`
    assert api.register_dtensor_route()
    assert sys.modules[ROUTE] is xs


# ---- distribute_tensor == mark_sharding -----------------------------------------------------

CASES = [
    # (mesh shape, dim names, placements, equivalent partition spec, tensor shape)
    ((8,), ("x",), [Shard(0)], ("x", None), (8, 4)),
    ((8,), ("x",), [Shard(1)], (None, "x"), (4, 16)),
    ((8,), ("x",), [Replicate()], (None, None), (3, 4)),
    ((8,), ("x",), [Shard(-1)], (None, "x"), (4, 16)),
    ((8,), ("x",), [Shard(0)], ("x", None), (10, 3)),  # uneven: the last shards are empty
    ((4, 2), ("data", "model"), [Shard(0), Replicate()], ("data", None), (8, 6)),
    ((4, 2), ("data", "model"), [Replicate(), Shard(0)], ("model", None), (8, 6)),
    ((4, 2), ("data", "model"), [Shard(0), Shard(1)], ("data", "model"), (8, 6)),
    ((4, 2), ("data", "model"), [Shard(1), Shard(0)], ("model", "data"), (8, 8)),
    ((4, 2), ("data", "model"), [Shard(0), Shard(0)], (("data", "model"), None), (16, 3)),
    ((2, 4), ("data", "model"), [Replicate(), Replicate()], (None, None), (5, 7)),
    ((2, 4), None, [Replicate(), Shard(2)], (None, None, 1), (2, 3, 8)),
]


@pytest.mark.parametrize(
    "mesh_shape, names, placements, spec, shape",
    CASES,
    ids=[f"{m}-{'_'.join(map(str, p))}-{s}" for m, _, p, _, s in CASES],
)
def test_distribute_tensor_shards_as_mark_sharding(mesh_shape, names, placements, spec, shape):
    cpu = torch.arange(float(np.prod(shape))).reshape(shape)
    xt = distribute_tensor(cpu, _device_mesh(mesh_shape, names), placements)
    expected = xs.mark_sharding(cpu.to(dev), xs.Mesh(np.arange(8), mesh_shape, names), spec)
    assert isinstance(xt, xs.XLAShardedTensor)
    assert xt.sharding_spec == expected.sharding_spec
    _assert_same_shards(xt, expected)
    assert_close(xt.global_tensor * 2, cpu * 2)


def test_distribute_tensor_keeps_the_mesh_device_order():
    ids = [7, 6, 5, 4, 3, 2, 1, 0]
    xt = distribute_tensor(
        torch.arange(16.0).reshape(8, 2), _device_mesh((8,), ids=ids), [Shard(0)]
    )
    assert xt.sharding_spec == "{devices=[8,1]7,6,5,4,3,2,1,0}"
    assert [s.indices[0].start for s in xt.local_shards] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert torch.equal(xt.device_mesh.mesh, torch.tensor(ids, dtype=torch.int32))


def test_distribute_tensor_marks_a_tensor_already_on_the_device_in_place():
    t = torch.randn(8, 4).to(dev)
    xt = distribute_tensor(t, _device_mesh((8,)), [Shard(0)])
    assert xt.global_tensor is t
    assert xs.get_xla_sharding_spec(t) == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def test_distribute_tensor_defaults_to_replicated():
    xt = distribute_tensor(torch.ones(4, 4), _device_mesh((4, 2)))
    assert xt.placements == (Replicate(), Replicate())
    assert xt.sharding_spec == "{replicated}"


def test_distribute_tensor_refuses_a_sharded_tensor():
    xt = distribute_tensor(torch.ones(8, 4), _device_mesh((8,)), [Shard(0)])
    with pytest.raises(AssertionError, match="already sharded"):
        xs.xla_distribute_tensor(xt, _device_mesh((8,)), [Shard(1)])


def test_distribute_tensor_errors_name_the_placements():
    mesh = _device_mesh((4, 2))
    with pytest.raises(AssertionError, match=r"1 placements .* 2 dimensions \(4, 2\)"):
        distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="unsupported placement type Partial"):
        distribute_tensor(torch.ones(8, 4), mesh, [Partial(), Replicate()])
    with pytest.raises(IndexError, match=r"Shard\(dim=2\) is out of range .* 2 dimensions"):
        distribute_tensor(torch.ones(8, 4), mesh, [Shard(2), Replicate()])


# ---- DeviceMesh <-> Mesh ---------------------------------------------------------------------


def test_convert_to_xla_mesh_keeps_ids_shape_and_names():
    mesh = xs.api.convert_to_xla_mesh(
        _device_mesh((2, 4), ("dp", "tp"), ids=[1, 0, 3, 2, 5, 4, 7, 6])
    )
    assert mesh == xs.Mesh([1, 0, 3, 2, 5, 4, 7, 6], (2, 4), ("dp", "tp"))


def test_convert_to_xla_mesh_needs_an_xla_mesh_over_every_device():
    with pytest.raises(AssertionError, match="device type 'cpu'"):
        xs.api.convert_to_xla_mesh(DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0))
    with pytest.raises(AssertionError, match="holds 4 devices but the program runs on 8"):
        xs.api.convert_to_xla_mesh(DeviceMesh("xla", [0, 1, 2, 3]))


def test_convert_to_xla_partition_spec_reads_placements_per_mesh_dimension():
    convert = xs.api.convert_to_xla_partition_spec
    assert convert(torch.empty(4, 8, 8), [Replicate(), Shard(0)]) == (1, None, None)
    assert convert(torch.empty(4, 8), [Shard(1), Shard(1)]) == (None, (0, 1))
    assert convert(torch.empty(4, 8), [Replicate()]) == (None, None)


# ---- XLAShardedTensor as a DTensor -----------------------------------------------------------


@pytest.mark.parametrize(
    "spec, placements",
    [
        (("x", None), (Shard(0), Replicate())),
        ((None, "y"), (Replicate(), Shard(1))),
        (("y", "x"), (Shard(1), Shard(0))),
        ((("x", "y"), None), (Shard(0), Shard(0))),
        ((None, None), (Replicate(), Replicate())),
    ],
    ids=str,
)
def test_placements_of_mark_sharding(spec, placements):
    mesh = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    xt = xs.mark_sharding(torch.ones(8, 8).to(dev), mesh, spec)
    assert xt.placements == placements
    assert xt.device_mesh.mesh_dim_names == ("x", "y")
    assert torch.equal(xt.device_mesh.mesh, torch.arange(8, dtype=torch.int32).reshape(4, 2))


def test_device_mesh_of_an_unnamed_mesh_has_no_dim_names():
    xt = xs.mark_sharding(torch.ones(8, 8).to(dev), xs.Mesh(np.arange(8), (2, 4)), (1, 0))
    assert xt.device_mesh.mesh_dim_names is None
    assert xt.placements == (Shard(1), Shard(0))


def test_placements_need_a_sharding():
    # PyTorch/XLA's sentence, and the reason naming the tensor as its cause.
    with pytest.raises(ValueError, match=r"^Placements not available: XLAShardedTensor") as caught:
        xs.XLAShardedTensor(torch.ones(3).to(dev)).placements
    assert "placements: the tensor of shape (3,) has no sharding" in str(caught.value.__cause__)


def test_placements_refuse_a_dimension_split_against_mesh_order():
    mesh = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    xt = xs.mark_sharding(torch.ones(16).to(dev), mesh, (("y", "x"),))
    with pytest.raises(ValueError, match=r"split over mesh axes \('y', 'x'\) against the mesh"):
        xt.placements


def test_redistribute_changes_the_layout_not_the_values():
    cpu = torch.arange(48.0).reshape(8, 6)
    mesh = _device_mesh((4, 2), ("data", "model"))
    xt = distribute_tensor(cpu, mesh, [Shard(0), Replicate()])
    moved = xt.redistribute(mesh, [Replicate(), Shard(1)])
    reference = xs.mark_sharding(cpu.to(dev), xs.Mesh(np.arange(8), (4, 2)), (None, 1))
    assert moved.sharding_spec == reference.sharding_spec
    assert moved.sharding_spec != "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert moved.placements == (Replicate(), Shard(1))
    _assert_same_shards(moved, reference)
    assert_close((moved.global_tensor + 1).sum(0), (cpu + 1).sum(0))


def test_redistribute_takes_an_xs_mesh():
    xt = distribute_tensor(torch.arange(8.0), _device_mesh((8,)), [Replicate()])
    moved = xt.redistribute(xs.Mesh(np.arange(8), (8,)), [Shard(0)])
    assert moved.sharding_spec == "{devices=[8]0,1,2,3,4,5,6,7}"


def test_redistribute_async_op_moves_a_copy():
    mesh = _device_mesh((8,))
    xt = distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)])
    moved = xt.redistribute(mesh, [Shard(1)], async_op=True)
    assert moved.global_tensor is not xt.global_tensor
    assert xt.placements == (Shard(0),)
    assert moved.placements == (Shard(1),)
    assert_close(moved.global_tensor, torch.arange(16.0).reshape(8, 2))


def test_redistribute_errors_are_pytorch_xlas():
    mesh = _device_mesh((4, 2))
    xt = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0), Replicate()])
    with pytest.raises(NotImplementedError, match="Partial"):
        xt.redistribute(mesh, [Partial(), Replicate()])
    with pytest.raises(ValueError, match="3 placements"):
        xt.redistribute(mesh, [Replicate()] * 3)
    with pytest.raises(IndexError, match="out of range"):
        xt.redistribute(mesh, [Shard(3), Replicate()])


def test_to_local_is_the_global_tensor_and_carries_gradients():
    weight = torch.full((8, 4), 3.0).to(dev).requires_grad_()
    xt = distribute_tensor(weight, _device_mesh((8,)), [Shard(0)])
    assert xt.to_local() is weight
    (xt.to_local() * torch.arange(4.0).to(dev)).sum().backward()
    assert_close(weight.grad, torch.arange(4.0).expand(8, 4))


# ---- distribute_module ----------------------------------------------------------------------


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _shard_linear_rows(name, module, mesh):
    if isinstance(module, nn.Linear):
        distribute_tensor(module.weight, mesh, [Shard(0)])


def test_distribute_module_shards_as_partition_fn_says():
    torch.manual_seed(0)
    cpu_model = _TwoLayers()
    model = _TwoLayers()
    model.load_state_dict(cpu_model.state_dict())
    model = distribute_module(model.to(dev), _device_mesh((8,)), _shard_linear_rows)
    assert xs.get_xla_sharding_spec(model.fc1.weight) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert xs.get_xla_sharding_spec(model.fc2.weight) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert xs.get_xla_sharding_spec(model.fc1.bias) == ""  # left alone: replicated
    x = torch.randn(5, 6)
    assert_close(model(x.to(dev)), cpu_model(x))


def test_distribute_module_installs_input_and_output_fns():
    seen = []

    def input_fn(module, inputs, mesh):
        sharded = distribute_tensor(inputs[0], mesh, [Shard(0)])
        seen.append(("in", type(module).__name__, sharded.sharding_spec))
        return (sharded.global_tensor,)

    def output_fn(module, outputs, mesh):
        seen.append(("out", type(module).__name__, mesh.ndim))
        return outputs * 10

    torch.manual_seed(0)
    cpu_model = _TwoLayers()
    model = _TwoLayers()
    model.load_state_dict(cpu_model.state_dict())
    mesh = _device_mesh((8,))
    model = distribute_module(model.to(dev), mesh, input_fn=input_fn, output_fn=output_fn)
    x = torch.randn(8, 6)
    assert_close(model(x.to(dev)), cpu_model(x) * 10)
    assert seen == [
        ("in", "_TwoLayers", "{devices=[8,1]0,1,2,3,4,5,6,7}"),
        ("out", "_TwoLayers", 1),
    ]


def test_distribute_module_refuses_a_three_argument_fn_of_another_arity():
    with pytest.raises(ValueError, match="input_fn should take in 3 arguments, but got 1"):
        distribute_module(_TwoLayers().to(dev), _device_mesh((8,)), input_fn=lambda inputs: inputs)


def test_distribute_module_auto_policy_is_not_supported():
    with pytest.raises(NotImplementedError, match="automatic sharding"):
        distribute_module(_TwoLayers().to(dev), _device_mesh((8,)), xs.auto_policy)
