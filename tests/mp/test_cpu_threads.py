"""Under the ``torch_xla`` face on the CPU platform a launch's replicas are PyTorch/XLA's CPU
threads: replica N on ``xla:N``, and ``pjrt.run_multiprocess`` starts as many as
``CPU_NUM_DEVICES`` says at the call. Outside the face a replica owns ``xla:0``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.runtime as xr
from spmd_torch import config
from spmd_torch._internal import pjrt


@pytest.fixture
def face():
    """The process under PyTorch/XLA's names for one test (what run_as_torch_xla turns on)."""
    with mock.patch.object(config.FACE, "on", True):
        yield


def _devices_and_values():
    ordinal = xr.global_ordinal()
    x = torch.ones(3, device="xla", requires_grad=True)
    y = (x * (ordinal + 1)).sum()
    y.backward()
    total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([float(ordinal)], device=xm.xla_device()))
    spmd_torch.sync()
    return (
        str(spmd_torch.device()),
        str(xm.xla_device()),
        str(x.device),
        str(y.device),
        str(x.grad.device),
        x.grad.tolist(),
        total.item(),
    )


def test_face_replica_n_owns_xla_n_and_computes_there(face, monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    results = pjrt.run_multiprocess(_devices_and_values)
    assert sorted(results) == [0, 1, 2, 3]
    for n, (device, xm_device, x, y, grad, grad_values, total) in results.items():
        assert (device, xm_device, x, y, grad) == (f"xla:{n}",) * 5
        assert grad_values == [n + 1.0] * 3
        assert total == 0.0 + 1 + 2 + 3  # the collective spans the four threads


def _factory_then_collective():
    ones = torch.ones(3, device=xm.xla_device()) * (xr.global_ordinal() + 1)  # made on xla:N
    total = xm.all_reduce(xm.REDUCE_SUM, ones)
    spmd_torch.sync()
    return total.tolist()


def test_face_replicas_factories_on_their_own_xla_n_trace_one_program(face, monkeypatch):
    # A factory records the device it is given; replicas on xla:0..3 must still trace one
    # program, which their collective runs as one (they parted: CollectiveMismatchError).
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    results = pjrt.run_multiprocess(_factory_then_collective)
    assert results == {n: [1.0 + 2 + 3 + 4] * 3 for n in range(4)}


def test_face_cpu_num_devices_is_read_at_each_call(face, monkeypatch):
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    assert pjrt.run_multiprocess(xm.xla_device) == {0: torch.device("xla:0")}
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    assert pjrt.run_multiprocess(xm.xla_device) == {
        0: torch.device("xla:0"),
        1: torch.device("xla:1"),
    }


def _other_device():
    return xm.xla_device(1 - xr.global_ordinal())


def test_face_replica_refuses_another_threads_device(face, monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    with pytest.raises(
        IndexError, match=r"xla:\d: this process's xla devices are xla:\d \(a replica of launch"
    ):
        pjrt.run_multiprocess(_other_device)


def test_without_face_every_replica_owns_xla0(monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")  # read only under the face
    results = pjrt.run_multiprocess(_devices_and_values)
    assert sorted(results) == list(range(len(spmd_torch.devices())))
    assert {r[:5] for r in results.values()} == {("xla:0",) * 5}


def _moves_copies_and_reduces():
    device = xm.xla_device()
    total = torch.full((2,), xr.global_ordinal() + 1.0).to(device)  # an upload
    xm.all_reduce(xm.REDUCE_SUM, [total])  # in place: the collective's result written back
    out = torch.zeros(2, device=device)
    out.copy_(total)  # a copy within the replica's one device: no cross-device copy in its graph
    out.add_(torch.tensor(1.0).to(device))
    spmd_torch.sync()
    return str(out.device), out.cpu().tolist()


def test_face_replicas_trace_one_program_whatever_their_device_names(face, monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    results = pjrt.run_multiprocess(_moves_copies_and_reduces)  # a mismatch would raise
    assert results == {n: (f"xla:{n}", [11.0, 11.0]) for n in range(4)}
