"""Hand-partitioned regions: each device computes on its own shard, then shards form a tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch._XLAC as xlac
import spmd_torch.distributed.spmd as xs
from spmd_torch._lazy.execute import global_array
from spmd_torch._lazy.manual import ManualShardingError
from tests.conftest import engine_leaks
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()


@pytest.fixture
def mesh():
    return xs.Mesh(np.arange(8), (2, 4), ("data", "model"))


def _enter(t, spec, mesh):
    return xs.enable_manual_sharding(t, spec, mesh=mesh).global_tensor


def _exit(t, spec, shape, mesh):
    return xs.disable_manual_sharding(t, spec, shape, mesh=mesh).global_tensor


def test_each_device_computes_on_its_own_shard(mesh):
    x = torch.randn(4, 8)
    local = _enter(x.to(dev), ("data", "model"), mesh)
    assert tuple(local.shape) == (2, 2)
    # A per-shard reduction: each device normalises its own 2x2 block by the block's sum.
    out = _exit(local / local.sum(), ("data", "model"), (4, 8), mesh)
    blocks = x.reshape(2, 2, 4, 2).permute(0, 2, 1, 3)
    expected = (blocks / blocks.sum((2, 3), keepdim=True)).permute(0, 2, 1, 3).reshape(4, 8)
    assert_close(out, expected)
    assert xs.get_xla_sharding_spec(out) == "{devices=[2,4]0,1,2,3,4,5,6,7}"


def test_region_reads_full_values_whole_and_has_several_exits(mesh):
    x, bias = torch.randn(8, 6), torch.randn(6)
    local = _enter(x.to(dev), ("model", None), mesh)  # [2, 6] per device, replicated over data
    shifted = local + bias.to(dev)  # the full bias, read inside the region
    doubled = _exit(shifted * 2, ("model", None), (8, 6), mesh)
    maxima = _exit(shifted.amax(0, keepdim=True), ("model", None), (4, 6), mesh)
    assert_close(doubled, (x + bias) * 2)
    assert_close(maxima, (x + bias).reshape(4, 2, 6).amax(1))


def test_the_same_region_compiles_once(mesh):
    def step(x):
        local = _enter(x.to(dev), ("data", None), mesh)
        out = _exit(local - local.mean(), ("data", None), tuple(x.shape), mesh)
        spmd_torch.sync()
        return out

    step(torch.randn(4, 3))
    with assert_compiles(0):
        x = torch.randn(4, 3)
        out = step(x)
    halves = x.reshape(2, 2, 3)
    assert_close(out, (halves - halves.mean((1, 2), keepdim=True)).reshape(4, 3))


def test_gradients_flow_through_a_manual_region(mesh):
    x = torch.randn(4, 6)
    xd = x.to(dev).requires_grad_()
    local = _enter(xd, ("data", None), mesh)
    out = _exit(local.exp() * local.sum(), ("data", None), (4, 6), mesh)
    (out * torch.arange(24.0).reshape(4, 6).to(dev)).sum().backward()
    xc = x.clone().requires_grad_()
    halves = xc.reshape(2, 2, 6)
    expected = halves.exp() * halves.sum((1, 2), keepdim=True)
    (expected.reshape(4, 6) * torch.arange(24.0).reshape(4, 6)).sum().backward()
    assert_close(out, expected.reshape(4, 6).detach())
    assert_close(xd.grad, xc.grad)


def test_a_shard_left_alive_stays_pending_and_cannot_be_read(mesh):
    local = _enter(torch.randn(4, 4).to(dev), ("data", None), mesh)
    out = _exit(local * 3, ("data", None), (4, 4), mesh)
    spmd_torch.sync()  # the live shard is not a program output
    assert global_array(out).shape == (4, 4)
    with pytest.raises(ManualShardingError, match=r"shape \(2, 4\) is a per-device shard"):
        local.cpu()


def test_bad_manual_sharding_is_refused_with_the_shapes(mesh):
    with pytest.raises(ValueError, match=r"shape \(5, 4\) does not divide evenly"):
        _enter(torch.randn(5, 4).to(dev), ("data", None), mesh)
    local = _enter(torch.randn(4, 4).to(dev), ("data", None), mesh)
    with pytest.raises(ValueError, match=r"shard of full shape \(8, 4\).*is \(4, 4\).*\(2, 4\)"):
        _exit(local, ("data", None), (8, 4), mesh)
    full = torch.randn(4, 4).to(dev)
    with pytest.raises(ManualShardingError, match=r"shape \(2, 4\) that is not a per-device"):
        _exit(full[:2], ("data", None), (4, 4), mesh)


def test_leak_guard_names_a_region_left_open(mesh):
    local = _enter(torch.randn(4, 8).to(dev), ("data", "model"), mesh) * 2
    leaks = engine_leaks(spmd_expected=True)
    assert leaks[0] == "a manual region was entered (enable_manual_sharding) and never left"
    assert "= full_to_shard(%in0, {data,model})" in leaks[1]
    del local
    assert engine_leaks(spmd_expected=True) == []


def test_xlac_full_to_shard_and_back_match_the_xs_region(mesh):
    x = torch.randn(4, 8)
    xd = x.to(dev)
    with pytest.raises(RuntimeError, match=r"shape \(4, 8\) has no sharding"):
        xlac._spmd_full_to_shard_shape(xd)
    xs.mark_sharding(xd, mesh, ("data", "model"))
    local = xlac._spmd_full_to_shard_shape(xd)
    assert tuple(local.shape) == (2, 2)
    with pytest.raises(RuntimeError, match=r"shape \(4, 8\) is not a per-device shard"):
        xs._mark_manual_sharding(xd)
    local = xs._mark_manual_sharding(local * 3).global_tensor
    sharding = mesh.get_op_sharding(("data", "model"))
    with pytest.raises(RuntimeError, match="the shard is torch.float32, not torch.int64"):
        xlac._spmd_shard_to_full_shape(local, sharding, (4, 8), torch.int64)
    out = xlac._spmd_shard_to_full_shape(local, sharding, (4, 8), torch.float32)
    assert_close(out, x * 3)
    assert xs.get_xla_sharding_spec(out) == "{devices=[2,4]0,1,2,3,4,5,6,7}"
    with pytest.raises(RuntimeError, match=r"shape \(4, 8\) that is not a per-device shard"):
        xlac._spmd_shard_to_full_shape(out, sharding, (4, 8), torch.float32)
