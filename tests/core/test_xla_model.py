"""spmd_torch.core.xla_model and spmd_torch.runtime: PyTorch/XLA's names on the 8-device CPU mesh."""

from __future__ import annotations

import collections
import io
import os

import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.graph as graph
import spmd_torch.runtime as xr
from spmd_torch._lazy import counters

DEV = torch.device("xla:0")


def _delta(before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in counters.COUNTERS.items() if v != before.get(k, 0)}


# runtime -------------------------------------------------------------------------------------


def test_runtime_counts_on_the_8_device_cpu_mesh():
    assert xr.device_type() == "CPU"
    assert xr.global_runtime_device_count() == 8
    assert xr.addressable_runtime_device_count() == 8
    # outside SPMD one xla device per device, as in PyTorch/XLA
    assert xr.addressable_device_count() == xr.global_device_count() == 8
    assert xr.local_device_count() == 8
    xr.use_spmd()  # one logical device per process
    assert xr.addressable_device_count() == xr.global_device_count() == 1
    assert xr.local_device_count() == 1
    xr.reset()


def test_runtime_ordinals_single_process():
    assert xr.world_size() == 1
    assert xr.global_ordinal() == 0
    assert xr.local_ordinal() == 0
    assert xr.process_index() == 0
    assert xr.process_count() == 1
    assert xr.host_index() == 0
    assert xr.local_process_count() == 1


def test_xla_real_devices_and_hw_name_the_platform():
    assert xr.xla_real_devices() == [f"CPU:{k}" for k in range(8)]
    assert xm.xla_real_devices([DEV, "xla:5"]) == ["CPU:0", "CPU:5"]
    assert xm.xla_device_hw(DEV) == "CPU"
    assert xm.xla_device_hw("xla:0") == "CPU"


def test_xla_device_hw_rejects_a_device_the_process_lacks():
    assert xm.xla_device_hw("xla:7") == "CPU"
    with pytest.raises(RuntimeError, match="'xla:8': this process has 8 xla devices"):
        xm.xla_device_hw("xla:8")
    xr.use_spmd()
    with pytest.raises(RuntimeError, match="'xla:1': this process has 1 xla devices"):
        xm.xla_device_hw("xla:1")
    xr.reset()
    with pytest.raises(RuntimeError, match="'cpu'"):
        xm.xla_device_hw(torch.device("cpu"))


def test_use_spmd_is_reported_by_is_spmd(monkeypatch):
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    assert xr.is_spmd() is False
    xr.use_spmd()
    assert xr.is_spmd() is True
    xr.reset()
    assert xr.is_spmd() is False


def test_is_spmd_reads_the_environment_variable(monkeypatch):
    monkeypatch.setenv("XLA_USE_SPMD", "1")
    assert xr.is_spmd() is True
    xr.reset()


def test_use_spmd_auto_is_refused(monkeypatch):
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    with pytest.raises(NotImplementedError, match="auto=True"):
        xr.use_spmd(auto=True)
    assert xr.is_spmd() is False


def _compile_new_program(columns: int) -> None:
    """A program no earlier test compiled (its shape is unique), computed now."""
    (torch.ones(3, columns, device=DEV) * 5 + 1).cpu()


def test_initialize_cache_writes_compiled_programs(tmp_path, restore_jax_cache_config):
    xr.initialize_cache(str(tmp_path / "cache"))
    before = counters.COUNTERS["UncachedCompile"]
    _compile_new_program(1031)
    assert counters.COUNTERS["UncachedCompile"] == before + 1
    assert len(os.listdir(tmp_path / "cache")) >= 1


def test_initialize_cache_readonly_writes_nothing(tmp_path, restore_jax_cache_config):
    xr.initialize_cache(str(tmp_path / "cache"), readonly=True)
    before = counters.COUNTERS["UncachedCompile"]
    _compile_new_program(1033)
    assert counters.COUNTERS["UncachedCompile"] == before + 1
    assert os.listdir(tmp_path / "cache") == []


# devices and ordinals -------------------------------------------------------------------------


def test_xla_device_is_the_one_logical_device():
    assert xm.xla_device() == torch.device("xla:0")
    assert xm.xla_device(0) == torch.device("xla:0")
    assert xm.xla_device(devkind="CPU") == torch.device("xla:0")


def test_xla_device_rejects_other_ordinals_and_kinds():
    assert xm.xla_device(7) == spmd_torch.device(7) == torch.device("xla:7")
    with pytest.raises(IndexError, match="xla:10: this process's xla devices are xla:0 to xla:7"):
        spmd_torch.device(10)
    xr.use_spmd()
    with pytest.raises(
        IndexError, match=r"xla:1: this process's xla devices are xla:0 \(in SPMD mode"
    ):
        xm.xla_device(1)
    xr.reset()
    with pytest.raises(RuntimeError, match="'TPU'"):
        xm.xla_device(devkind="TPU")


def test_get_xla_supported_devices():
    every = [f"xla:{k}" for k in range(8)]
    assert xm.get_xla_supported_devices() == every
    assert xm.get_xla_supported_devices(max_devices=1) == ["xla:0"]
    assert xm.get_xla_supported_devices(devkind="CPU") == every
    assert xm.get_xla_supported_devices(devkind="TPU") is None


def test_ordinals_and_world_size_single_process():
    assert xm.xrt_world_size() == 1
    assert xm.world_size() == 1
    assert xm.get_ordinal() == 0
    assert xm.get_local_ordinal() == 0
    assert xm.is_master_ordinal() is True
    assert xm.is_master_ordinal(local=False) is True


def test_master_print_only_on_master(monkeypatch, capsys):
    xm.master_print("step", 3)
    monkeypatch.setattr(xr, "global_ordinal", lambda: 1)
    xm.master_print("hidden")
    assert capsys.readouterr().out == "step 3\n"


def test_is_xla_tensor():
    assert xm.is_xla_tensor(torch.zeros(2, device=DEV)) is True
    assert xm.is_xla_tensor(torch.zeros(2)) is False


# barrier and optimizer ------------------------------------------------------------------------


def test_mark_step_computes_every_pending_tensor():
    x = torch.ones(4, device=DEV) + 2
    assert graph.pending_count() >= 1
    before = dict(counters.COUNTERS)
    xm.mark_step(wait=True)
    assert graph.pending_count() == 0
    assert _delta(before)["MarkStep"] == 1
    assert torch.equal(x.cpu(), torch.full((4,), 3.0))


def test_wait_device_ops_after_mark_step():
    x = torch.zeros(3, device=DEV) + 1
    xm.mark_step()
    xm.wait_device_ops()
    assert torch.equal(x.cpu(), torch.ones(3))


def test_unlazy_computes_only_the_given_tensors():
    x = torch.ones(2, device=DEV) * 4
    y = torch.ones(2, device=DEV) * 5
    xm.unlazy([x])
    assert graph.pending_count() == 1  # y's
    assert "aten.mul.Tensor(%0, %s0)" in graph.pending_text()  # y = ones * 5, 5 lifted
    assert torch.equal(x.cpu(), torch.full((2,), 4.0))
    assert torch.equal(y.cpu(), torch.full((2,), 5.0))


def _sgd_step_setup():
    p = torch.ones(3, device=DEV, requires_grad=True)
    p.grad = torch.full((3,), 2.0, device=DEV)
    return p, torch.optim.SGD([p], lr=0.5)


def test_optimizer_step_with_barrier_leaves_no_pending_graph():
    p, opt = _sgd_step_setup()
    xm.optimizer_step(opt, barrier=True)
    assert graph.pending_count() == 0
    assert torch.equal(p.detach().cpu(), torch.zeros(3))


def test_optimizer_step_without_barrier_leaves_the_update_pending():
    p, opt = _sgd_step_setup()
    xm.optimizer_step(opt)
    assert graph.pending_count() >= 1
    assert "aten._foreach_add.List" in graph.pending_text([p])  # SGD's foreach path
    assert torch.equal(p.detach().cpu(), torch.zeros(3))


def test_optimizer_step_returns_what_step_returns():
    _, opt = _sgd_step_setup()
    assert xm.optimizer_step(opt, optimizer_args={"closure": lambda: 7.0}) == 7.0


# save -----------------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "left right")


def test_save_moves_nested_xla_tensors_to_cpu(tmp_path):
    shared = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(DEV)
    data = {
        "w": shared,
        "nested": [shared, (torch.ones(2, dtype=torch.int64, device=DEV) * 7, "tag")],
        "pair": Pair(torch.zeros(1, device=DEV), 3),
        "cpu": torch.full((2,), 9.0),
    }
    xm.save(data, tmp_path / "x.pt")
    with torch.serialization.safe_globals([Pair]):
        loaded = torch.load(tmp_path / "x.pt")
    expected_w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], expected_w)
    assert loaded["nested"][0] is loaded["w"]  # one tensor saved once stays shared
    assert loaded["nested"][1][0].dtype == torch.int64
    assert torch.equal(loaded["nested"][1][0], torch.full((2,), 7))
    assert loaded["nested"][1][1] == "tag" and isinstance(loaded["nested"][1], tuple)
    assert isinstance(loaded["pair"], Pair) and torch.equal(loaded["pair"].left, torch.zeros(1))
    assert torch.equal(loaded["cpu"], torch.full((2,), 9.0))
    assert data["w"] is shared and data["w"].device.type == "xla"  # the input is not modified


def test_save_keeps_requires_grad(tmp_path):
    p = torch.ones(2, device=DEV, requires_grad=True)
    xm.save([p], tmp_path / "p.pt")
    (loaded,) = torch.load(tmp_path / "p.pt")
    assert loaded.requires_grad and loaded.is_leaf


def test_save_to_a_file_object():
    buffer = io.BytesIO()
    xm.save({"a": torch.ones(2, device=DEV) * 2}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)["a"], torch.full((2,), 2.0))


def test_save_only_on_the_master_ordinal(tmp_path, monkeypatch):
    monkeypatch.setattr(xr, "local_ordinal", lambda: 1)
    xm.save({"a": torch.ones(2, device=DEV)}, tmp_path / "a.pt")
    assert not (tmp_path / "a.pt").exists()
    xm.save({"a": torch.ones(2, device=DEV)}, tmp_path / "b.pt", master_only=False)
    assert (tmp_path / "b.pt").exists()


def test_save_global_master_checks_the_global_ordinal(tmp_path, monkeypatch):
    monkeypatch.setattr(xr, "global_ordinal", lambda: 1)
    xm.save([torch.ones(1, device=DEV)], tmp_path / "g.pt", global_master=True)
    assert not (tmp_path / "g.pt").exists()
    xm.save([torch.ones(1, device=DEV)], tmp_path / "l.pt")  # host master still writes
    assert (tmp_path / "l.pt").exists()


# RNG ------------------------------------------------------------------------------------------


def test_rng_state_round_trip_replays_the_same_numbers():
    spmd_torch.manual_seed(7)
    torch.rand(4, device=DEV)  # leaves the key pending: get_rng_state must compute it
    state = xm.get_rng_state()
    first = torch.rand(5, device=DEV).cpu()
    second = torch.rand(5, device=DEV).cpu()
    xm.set_rng_state(state)
    assert torch.equal(torch.rand(5, device=DEV).cpu(), first)
    assert torch.equal(torch.rand(5, device=DEV).cpu(), second)
    assert not torch.equal(first, second)


def test_rng_state_below_2_32_equals_manual_seed():
    spmd_torch.manual_seed(1234)
    assert xm.get_rng_state() == 1234
    seeded = torch.rand(6, device=DEV).cpu()
    xm.set_rng_state(1234)
    assert torch.equal(torch.rand(6, device=DEV).cpu(), seeded)


def test_rng_state_holds_64_bits_and_wraps_negative_seeds():
    xm.set_rng_state(2**40 + 5)
    assert xm.get_rng_state() == 2**40 + 5
    xm.set_rng_state(-1)
    assert xm.get_rng_state() == 2**64 - 1


def test_set_rng_state_reuses_the_compiled_program():
    spmd_torch.manual_seed(3)
    torch.rand(9, device=DEV).cpu()
    before = dict(counters.COUNTERS)
    xm.set_rng_state(3 + 2**33)
    torch.rand(9, device=DEV).cpu()
    delta = _delta(before)
    assert delta.get("UncachedCompile", 0) == 0
    assert delta["CachedCompile"] == 1


def test_fork_rng_restores_the_state():
    xm.set_rng_state(11)
    with xm.fork_rng():
        inside = torch.rand(3, device=DEV).cpu()
    assert xm.get_rng_state() == 11
    assert torch.equal(torch.rand(3, device=DEV).cpu(), inside)


def test_rng_state_rejects_a_device_the_process_lacks():
    with pytest.raises(ValueError, match="'xla:8'"):
        xm.get_rng_state("xla:8")
    with pytest.raises(ValueError, match="'cpu'"):
        xm.set_rng_state(1, device="cpu")
