"""XLAShardedTensor is a torch.Tensor (a DTensor subclass, as PyTorch/XLA 2.9's): torch APIs take
it, ops on one give one back, and gradients still reach the tensor it wraps."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.spmd as xs
from tests.helpers import assert_close

dev = spmd_torch.device()


def _rows(cpu: torch.Tensor) -> xs.XLAShardedTensor:
    """``cpu`` on the device, split by rows over the 8 devices."""
    return xs.mark_sharding(
        cpu.to(dev), xs.Mesh(np.arange(8), (8,)), (0,) + (None,) * (cpu.dim() - 1)
    )


def test_a_sharded_tensor_is_a_tensor_and_a_dtensor():
    xt = _rows(torch.ones(8, 4))
    assert isinstance(xt, torch.Tensor) and isinstance(xt, DTensor)
    assert isinstance(xt.shape, torch.Size) and xt.shape == (8, 4)
    assert (xt.dtype, xt.device) == (torch.float32, dev)
    assert torch.is_tensor(xt)


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t * 2 + 1,
        lambda t: torch.matmul(t, t.T),
        lambda t: torch.nn.functional.softmax(t, dim=-1),
        lambda t: t.sum(dim=0),
        lambda t: t[1:5, ::2],
        lambda t: torch.where(t > 0, t, -t),
    ],
    ids=["arith", "matmul", "softmax", "sum", "slice", "where"],
)
def test_an_op_on_one_gives_one_back_with_the_values_of_cpu_torch(op):
    cpu = torch.randn(8, 4)
    result = op(_rows(cpu))
    assert type(result) is xs.XLAShardedTensor
    assert result.global_tensor.device == dev
    assert repr(result).startswith("XLAShardedTensor(tensor(")
    assert_close(result.full_tensor(), op(cpu))


def test_an_op_result_has_no_spec_until_a_program_computes_it():
    xt = _rows(torch.ones(8, 4))
    with pytest.raises(ValueError, match="no sharding of its own"):
        _ = (xt + xt)._spec
    assert xt._spec.placements == xt.placements


def test_a_tuple_result_is_wrapped_element_by_element():
    cpu = torch.randn(8, 4)
    values, indices = torch.max(_rows(cpu), dim=1)
    assert type(values) is type(indices) is xs.XLAShardedTensor
    assert_close(values.full_tensor(), cpu.max(dim=1).values)
    assert torch.equal(indices.full_tensor().cpu(), cpu.max(dim=1).indices)


def test_cpu_gives_a_wrapper_of_the_host_tensor():
    cpu = torch.randn(8, 4)
    host = _rows(cpu).cpu()
    assert type(host) is xs.XLAShardedTensor and host.global_tensor.device.type == "cpu"
    assert torch.equal(host.global_tensor, cpu)
    np.testing.assert_array_equal(host.numpy(), cpu.numpy())


def test_in_place_ops_give_back_the_same_wrapper():
    t = torch.zeros(8, 4).to(dev)
    xt = xs.mark_sharding(t, xs.Mesh(np.arange(8), (8,)), (0, None))
    assert xt.add_(2) is xt and xt.mul_(3) is xt and xt.to(dev) is xt
    assert_close(t, torch.full((8, 4), 6.0))


def test_an_aten_op_reaching_the_wrapper_directly_is_run_on_the_tensor():
    xt = _rows(torch.ones(8, 4))
    with torch._C.DisableTorchFunctionSubclass():
        result = torch.add(xt, 1)
    assert type(result) is xs.XLAShardedTensor
    assert_close(result.full_tensor(), torch.full((8, 4), 2.0))


def test_a_parameter_of_one_trains_like_cpu_torch():
    cpu_model = torch.nn.Linear(4, 3)
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    model = copy.deepcopy(cpu_model).to(dev)
    weight = torch.nn.Parameter(
        xs.mark_sharding(model.weight.detach(), xs.get_1d_mesh(), (0, None))
    )
    assert isinstance(weight, torch.nn.Parameter) and type(weight) is xs.XLAShardedTensor
    assert weight.requires_grad and weight.is_leaf
    model.weight = weight
    assert model.weight is weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for net, optimizer, data in ((cpu_model, cpu_opt, x), (model, opt, x.to(dev))):
        net(data).pow(2).sum().backward()
        optimizer.step()
    xm.mark_step()
    assert type(model.weight.grad) is xs.XLAShardedTensor
    assert_close(model.weight.grad.full_tensor(), cpu_model.weight.grad)
    assert_close(model.weight.full_tensor(), cpu_model.weight.detach())
    assert model.weight.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def test_gradients_flow_through_an_op_on_the_wrapper_to_the_tensor():
    cpu = torch.randn(8, 4, requires_grad=True)
    w = cpu.detach().to(dev).requires_grad_()
    xt = xs.mark_sharding(w, xs.get_1d_mesh(), (0, None))
    out = (xt.sin() * 2).sum()
    assert type(out) is xs.XLAShardedTensor and out.requires_grad
    out.backward()
    (cpu.sin() * 2).sum().backward()
    assert_close(w.grad, cpu.grad)


def test_deepcopy_and_pickle_keep_the_type_and_values():
    cpu = torch.randn(8, 4)
    xt = _rows(cpu)
    copied = copy.deepcopy(xt)
    assert type(copied) is xs.XLAShardedTensor and copied.global_tensor is not xt.global_tensor
    assert_close(copied.full_tensor(), cpu)
    buffer = io.BytesIO()
    torch.save(xt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only, torch's default
    assert type(loaded) is xs.XLAShardedTensor
    assert_close(loaded.full_tensor(), cpu)


def test_a_module_holding_one_moves_and_loads_a_state_dict():
    model = torch.nn.Linear(4, 8).to(dev)
    sharded = xs.mark_sharding(model.weight.detach(), xs.get_1d_mesh(), (0, None))
    model.weight = torch.nn.Parameter(sharded)
    model.to(dev)
    assert type(model.weight) is xs.XLAShardedTensor
    new_weight = torch.randn(8, 4)
    model.load_state_dict({"weight": new_weight, "bias": torch.zeros(8)})
    assert_close(model.weight.full_tensor(), new_weight)
    assert model.weight.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    x = torch.randn(2, 4)
    out = model(x.to(dev))
    assert type(out) is xs.XLAShardedTensor
    assert_close(out.full_tensor(), x @ new_weight.T)


def test_setting_data_makes_the_wrapped_tensor_an_alias():
    xt = _rows(torch.zeros(8, 4))
    other = torch.ones(8, 4).to(dev)
    xt.data = other
    other.add_(1)
    assert_close(xt.full_tensor(), torch.full((8, 4), 2.0))


def test_an_aten_op_with_a_plain_tensor_first_reaches_the_wrapper():
    plain = torch.ones(8, 4).to(dev)
    with torch._C.DisableTorchFunctionSubclass():
        result = torch.add(plain, _rows(torch.ones(8, 4)))
    assert type(result) is xs.XLAShardedTensor
    assert_close(result.full_tensor(), torch.full((8, 4), 2.0))
