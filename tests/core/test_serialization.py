"""spmd_torch.utils.serialization: PyTorch/XLA's tensors-directory format, one tensor at a time."""

from __future__ import annotations

import collections
import os
import weakref

import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.runtime as xr
from spmd_torch._lazy import counters
from spmd_torch.utils import serialization as xser

DEV = torch.device("xla:0")
Pair = collections.namedtuple("Pair", "left right")


@pytest.fixture(autouse=True)
def _no_pending_graph():
    yield
    spmd_torch.sync()


def _originals() -> dict:
    return {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "i64": torch.tensor([1, -2, 3], dtype=torch.int64),
        "bf16": torch.tensor([0.5, 1.5], dtype=torch.bfloat16),
    }


def test_round_trip_of_nested_xla_tensors(tmp_path):
    cpu = _originals()
    on_device = {k: v.to(DEV) for k, v in cpu.items()}
    data = {
        "params": on_device,
        "again": [on_device["f32"], ("step", 10)],
        "pair": Pair(on_device["i64"], None),
        "cpu": torch.ones(2),
    }
    path = tmp_path / "ckpt.pt"
    xser.save(data, str(path))
    assert sorted(os.listdir(str(path) + ".tensors")) == [
        "tensor_0.pt",
        "tensor_1.pt",
        "tensor_2.pt",
    ]
    with torch.serialization.safe_globals([Pair]):
        loaded = xser.load(str(path))
    for name, original in cpu.items():
        got = loaded["params"][name]
        assert got.device.type == "cpu" and got.dtype == original.dtype
        assert torch.equal(got, original)
    assert loaded["again"][0] is loaded["params"]["f32"]  # stored once, loaded shared
    assert loaded["again"][1] == ("step", 10)
    assert isinstance(loaded["pair"], Pair) and loaded["pair"].left is loaded["params"]["i64"]
    assert torch.equal(loaded["cpu"], torch.ones(2))


def test_main_file_holds_references_and_cpu_tensors_inline(tmp_path):
    path = str(tmp_path / "m.pt")
    xser.save({"x": torch.ones(2, device=DEV), "c": torch.zeros(3)}, path)
    with torch.serialization.safe_globals([xser.TensorReference]):
        raw = torch.load(path)
    assert isinstance(raw["x"], xser.TensorReference) and raw["x"].tid == 0
    assert torch.equal(raw["c"], torch.zeros(3))
    assert torch.equal(torch.load(os.path.join(path + ".tensors", "tensor_0.pt")), torch.ones(2))


def test_pending_tensors_are_computed_in_one_program(tmp_path):
    a = torch.ones(5, device=DEV) * 2
    b = a + 1
    c = b * b
    before = dict(counters.COUNTERS)
    xser.save([a, b, c], str(tmp_path / "p.pt"))
    ran = sum(counters.COUNTERS[k] - before.get(k, 0) for k in ("UncachedCompile", "CachedCompile"))
    assert ran == 1
    assert counters.COUNTERS["TransferFromDevice"] - before.get("TransferFromDevice", 0) == 3
    loaded = xser.load(str(tmp_path / "p.pt"))
    assert [t.tolist() for t in loaded] == [[2.0] * 5, [3.0] * 5, [9.0] * 5]


def test_save_holds_one_host_copy_at_a_time(tmp_path, monkeypatch):
    copies: list = []
    to_cpu = xm.to_cpu_tensor

    def tracked(t):
        assert all(ref() is None for ref in copies), "an earlier host copy is still alive"
        out = to_cpu(t)
        copies.append(weakref.ref(out))
        return out

    monkeypatch.setattr(xm, "to_cpu_tensor", tracked)
    xser.save({f"w{i}": torch.ones(64, device=DEV) * i for i in range(4)}, str(tmp_path / "s.pt"))
    assert len(copies) == 4


def test_save_replaces_a_stale_tensor_directory(tmp_path):
    path = str(tmp_path / "r.pt")
    os.makedirs(path + ".tensors")
    open(os.path.join(path + ".tensors", "tensor_9.pt"), "wb").close()
    xser.save([torch.ones(1, device=DEV)], path)
    assert os.listdir(path + ".tensors") == ["tensor_0.pt"]


def test_requires_grad_survives_the_round_trip(tmp_path):
    path = str(tmp_path / "g.pt")
    xser.save({"p": torch.ones(2, device=DEV, requires_grad=True)}, path)
    loaded = xser.load(path)["p"]
    assert loaded.requires_grad and loaded.is_leaf


def test_only_the_master_ordinal_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(xr, "local_ordinal", lambda: 1)
    path = str(tmp_path / "n.pt")
    xser.save([torch.ones(1, device=DEV)], path)
    assert not os.path.exists(path) and not os.path.exists(path + ".tensors")
    xser.save([torch.ones(1, device=DEV)], path, master_only=False)
    assert torch.equal(xser.load(path)[0], torch.ones(1))


def test_global_master_checks_the_global_ordinal(tmp_path, monkeypatch):
    monkeypatch.setattr(xr, "global_ordinal", lambda: 1)
    path = str(tmp_path / "gm.pt")
    xser.save([torch.ones(1, device=DEV)], path, global_master=True)
    assert not os.path.exists(path)
