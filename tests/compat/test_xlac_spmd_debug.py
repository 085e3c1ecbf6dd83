"""``_XLAC`` debug views in SPMD mode: the tensor's device is PyTorch/XLA's virtual ``SPMD:0``, and
``XLA_DUMP_POST_OPTIMIZATIONS=1`` makes ``_get_xla_tensors_hlo`` the partitioned, optimized HLO."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch._XLAC as xlac
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch.debug import graph

dev = spmd_torch.device()


@pytest.fixture
def spmd_mode():
    xr.use_spmd()


def test_debug_info_device_is_the_process_device_outside_spmd_mode():
    assert "Device: xla:0\n" in xlac._get_xla_tensor_debug_info(torch.ones(5).to(dev))


def test_debug_info_device_is_the_virtual_spmd_device_in_spmd_mode(spmd_mode):
    info = xlac._get_xla_tensor_debug_info(torch.ones(5, 5).to(dev))
    assert "Device: SPMD:0\n" in info and "Tensor on host: with size [5, 5]" in info


def test_post_optimization_hlo_is_partitioned_and_runs_nothing(spmd_mode, monkeypatch):
    t1, t2 = torch.randn(1, 128).to(dev), torch.randn(128, 1).to(dev)
    xs.mark_sharding(t1, xs.Mesh(np.arange(8), (1, 8)), (0, 1))  # the contraction dim, split
    t3 = t1 @ t2
    monkeypatch.delenv("XLA_DUMP_POST_OPTIMIZATIONS", raising=False)
    unpartitioned = xlac._get_xla_tensors_hlo([t3])
    assert "sharding={devices=[1,8]0,1,2,3,4,5,6,7}" in unpartitioned
    assert "all-reduce" not in unpartitioned
    assert "f32[1,1]{1,0} dot(f32[1,128]{1,0} %" in unpartitioned
    monkeypatch.setenv("XLA_DUMP_POST_OPTIMIZATIONS", "1")
    hlo = xlac._get_xla_tensors_hlo([t3])
    assert hlo.startswith("HloModule") and "num_partitions=8" in hlo
    assert "f32[1,16]" in hlo  # each device's 128 / 8 columns
    assert "all-reduce(" in hlo  # the partial products summed across the devices
    assert graph.pending_count() == 1  # nothing ran: t3 is still pending
    torch.testing.assert_close(t3.cpu(), t1.cpu() @ t2.cpu())


@pytest.mark.parametrize("spec", [(None, "y"), ("y", "x"), ("x", None)])
def test_hlo_text_writes_a_shardings_devices_out_as_its_spec_does(spmd_mode, spec):
    # XLA prints tile assignments in iota form (``<=[2,4]T(1,0)``); PyTorch/XLA's text and
    # _get_xla_sharding_spec list the devices. The two are computed apart: from XLA's text here,
    # from the jax sharding there.
    t = torch.randn(8, 16).to(dev) * 2
    xs.mark_sharding(t, xs.Mesh(np.arange(8), (2, 4), ("x", "y")), spec)
    hlo = xlac._get_xla_tensors_hlo([t])
    assert "<=[" not in hlo
    spmd_torch.sync()
    assert f"sharding={xlac._get_xla_sharding_spec(t)}" in hlo
