"""SPMD mode: every program runs over all devices; unmarked data is replicated over them."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
import torch

import spmd_torch
import spmd_torch.debug.graph
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch._lazy.execute import global_array
from tests.helpers import assert_close

dev = spmd_torch.device()


def test_uploads_are_replicated_over_every_device():
    array = global_array(torch.arange(6.0).to(dev))
    assert array.sharding.is_fully_replicated
    assert {shard.device for shard in array.addressable_shards} == set(jax.devices())


def test_data_from_before_spmd_joins_the_mesh_on_first_use():
    xr.reset()
    early = torch.arange(6.0).to(dev)
    assert global_array(early).sharding.num_devices == 1
    xr.use_spmd()
    late = torch.ones(6).to(dev)
    total = early + late
    spmd_torch.sync()
    assert global_array(total).sharding.num_devices == 8
    assert global_array(early).sharding.num_devices == 8  # moved once, kept there
    assert_close(total, torch.arange(6.0) + 1)


@pytest.mark.multiprocess  # a fresh interpreter imports spmd_torch
def test_xla_use_spmd_variable_turns_spmd_on_at_import():
    env = dict(os.environ, XLA_USE_SPMD="1", JAX_PLATFORMS="cpu")
    code = (
        "import torch, spmd_torch; from spmd_torch._lazy.execute import global_array; "
        "x = torch.ones(2).to(spmd_torch.device()); "
        "print(global_array(x).sharding.num_devices)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(jax.device_count())


def test_random_ops_draw_the_same_numbers_whatever_the_layout():
    xr.reset()
    spmd_torch.manual_seed(0)
    single_device = torch.nn.functional.dropout(torch.ones(16, 8).to(dev), 0.5).cpu()
    xr.use_spmd()
    spmd_torch.manual_seed(0)
    x = torch.ones(16, 8).to(dev)
    xs.mark_sharding(x, xs.get_1d_mesh("x"), ("x", None))
    sharded = torch.nn.functional.dropout(x, 0.5).cpu()
    assert torch.equal(single_device, sharded)
    assert 0.3 < (sharded == 0).float().mean().item() < 0.7


def test_to_then_mark_sharding_sends_each_device_only_its_shard(monkeypatch):
    placed = []
    device_put = jax.device_put

    def spy(x, sharding=None, *args, **kwargs):
        placed.append((getattr(x, "shape", None), sharding))
        return device_put(x, sharding, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    cpu = torch.randn(64, 32)
    t = cpu.to(dev)  # in SPMD mode the upload waits: a mark may come next
    xs.mark_sharding(t, xs.get_1d_mesh("x"), ("x", None))
    assert [tuple(sharding.spec) for shape, sharding in placed if shape == (64, 32)] == [("x",)]
    array = global_array(t)
    assert [s.data.shape for s in array.addressable_shards] == [(8, 32)] * 8
    assert_close(t, cpu)


def test_uploads_held_on_the_host_count_as_virtual_device_use():
    """Each upload that waits on the host (PyTorch/XLA's SPMD virtual device) counts once under
    VirtualDeviceUsage; a mark then uploads each device's shard."""
    before = met.counter_value("VirtualDeviceUsage") or 0
    t = torch.randn(8, 4).to(dev)
    u = torch.nn.Linear(4, 8).to(dev)  # weight and bias
    assert met.counter_value("VirtualDeviceUsage") - before == 3
    xs.mark_sharding(t, xs.get_1d_mesh("x"), ("x", None))
    xs.mark_sharding(u.weight, xs.get_1d_mesh("x"), ("x", None))
    assert met.counter_value("VirtualDeviceUsage") - before == 3


def test_a_sharding_is_built_once_per_mesh_object_and_spec():
    """CreateOpSharding counts the shardings built, as PyTorch/XLA's cache of each ``Mesh``
    object's: a second mark with the same mesh and spec reuses the first one's, another spec
    builds one more, and so does an equal mesh built anew."""
    mesh = xs.Mesh(list(range(8)), (8, 1), ("a", "b"))
    before = met.counter_value("CreateOpSharding") or 0
    for spec in (("a", "b"), ("a", "b"), ("a", None)):
        xs.mark_sharding(torch.zeros(8, 2).to(dev), mesh, spec)
    assert met.counter_value("CreateOpSharding") - before == 2
    again = xs.Mesh(list(range(8)), (8, 1), ("a", "b"))
    xs.mark_sharding(torch.zeros(8, 2).to(dev), again, ("a", "b"))
    assert met.counter_value("CreateOpSharding") - before == 3
    assert again.get_named_sharding(("a", "b")) == mesh.get_named_sharding(("a", "b"))


def test_unmarked_data_is_uploaded_replicated_by_its_first_program():
    cpu = torch.randn(4, 3)
    t = cpu.to(dev)
    assert_close(t * 2, cpu * 2)
    assert global_array(t).sharding.is_fully_replicated
    assert global_array(t).sharding.num_devices == jax.device_count()


def test_data_still_on_the_host_can_be_inspected():
    x = torch.ones(4).to(dev)  # not uploaded yet: no program has needed it
    assert "%in0:f32[4] = xla::device_data" in spmd_torch.debug.graph.pending_text([x * 2])
    assert xs.get_xla_sharding_spec(x) == ""


def test_xla_process_group_is_refused_in_spmd_mode():
    """The xla backend runs over launch's replicas: in SPMD mode it is refused with an error that
    is a RuntimeError and PyTorch/XLA's AssertionError, naming the alternative."""
    import torch.distributed as dist

    import spmd_torch.distributed.xla_backend  # noqa: F401  (registers 'xla' and 'xla://')

    with pytest.raises(RuntimeError, match="not supported in SPMD mode.*gloo") as refused:
        dist.init_process_group("xla", init_method="xla://")
    assert isinstance(refused.value, AssertionError) and not dist.is_initialized()
