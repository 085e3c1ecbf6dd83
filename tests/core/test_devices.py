"""Outside SPMD each device of the process is an xla device, ``xla:N`` JAX's N-th local device,
as in PyTorch/XLA: tensors there compute there, and a barrier runs one program per device."""

from __future__ import annotations

import jax
import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.runtime as xr
from spmd_torch._lazy.execute import global_array
from spmd_torch._lazy.record import DeviceMismatchError
from spmd_torch.debug import graph
from tests.helpers import assert_compiles


def _on(t: torch.Tensor) -> set:
    """The JAX devices holding ``t``'s value (computed if pending)."""
    return global_array(t).devices()


def test_every_local_device_is_an_xla_device():
    assert spmd_torch.devices() == [torch.device("xla", k) for k in range(8)]
    assert spmd_torch.device_count() == xr.addressable_device_count() == 8
    assert torch.xla.device_count() == 8
    assert spmd_torch.device(5) == xm.xla_device(5) == torch.device("xla:5")


def test_ops_on_a_device_run_there_and_match_eager():
    cpu = torch.arange(12.0).reshape(3, 4)
    x = cpu.to("xla:3")
    y = (x * 2).exp().sum(dim=1) + torch.ones(3, device="xla:3")
    assert x.device == y.device == torch.device("xla:3")
    assert _on(x) == _on(y) == {jax.local_devices()[3]}
    torch.testing.assert_close(y.cpu(), (cpu * 2).exp().sum(dim=1) + 1)


def test_a_factory_lands_on_the_device_it_names():
    t = torch.full((2, 3), 7.0, device="xla:6") * 0.5  # a lifted scalar: a program input
    r = torch.arange(4, device=torch.device("xla", 2)) * 3
    assert t.device == torch.device("xla:6") and r.device == torch.device("xla:2")
    assert _on(t) == {jax.local_devices()[6]} and _on(r) == {jax.local_devices()[2]}
    assert t.cpu().tolist() == [[3.5] * 3] * 2 and r.cpu().tolist() == [0, 3, 6, 9]


def test_the_graph_text_names_the_device_a_factory_was_given():
    t = torch.zeros(2, device="xla:5") + 1
    assert "device=device(type=xla, index=5)" in graph.pending_text([t])
    assert _on(t) == {jax.local_devices()[5]}


def test_one_barrier_runs_one_program_per_device():
    a = torch.ones(4).to("xla:0") * 2
    b = torch.ones(4).to("xla:1") * 3
    met.clear_all()
    spmd_torch.sync()
    assert met.metric_data("ExecuteTime")[0] == 2
    assert _on(a) == {jax.local_devices()[0]} and _on(b) == {jax.local_devices()[1]}
    assert a.cpu().tolist() == [2.0] * 4 and b.cpu().tolist() == [3.0] * 4


def test_to_another_device_copies_the_value_there():
    x = torch.arange(6.0).to("xla:0")
    pending = (x + 1).to("xla:4")
    spmd_torch.sync()
    stored = x.to("xla:7")  # data already computed
    assert pending.device == torch.device("xla:4") and stored.device == torch.device("xla:7")
    assert _on(pending) == {jax.local_devices()[4]}
    assert _on(stored + 0) == {jax.local_devices()[7]}
    assert pending.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    back = torch.empty(6, device="xla:0")
    back.copy_(pending)
    assert back.device == torch.device("xla:0") and _on(back + 0) == {jax.local_devices()[0]}
    assert back.cpu().tolist() == pending.cpu().tolist()


def test_tensors_on_two_devices_in_one_op_raise_naming_both():
    a, b = torch.ones(2, device="xla:0"), torch.ones(2, device="xla:1")
    with pytest.raises(DeviceMismatchError, match="aten.add.Tensor: .*xla:0 and xla:1"):
        a + b


def test_a_training_step_on_a_device_matches_eager_and_compiles_once():
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(eager.state_dict())
    model.to("xla:2")
    data = torch.randn(5, 4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(3):
        losses = []
        for m, opt, x in ((eager, opts[0], data), (model, opts[1], data.to("xla:2"))):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss)
        if step == 2:
            with assert_compiles(0):
                spmd_torch.sync()
        else:
            spmd_torch.sync()
        torch.testing.assert_close(losses[1].cpu(), losses[0].detach())
    assert _on(model.weight) == {jax.local_devices()[2]}
    torch.testing.assert_close(model.weight.cpu(), eager.weight.detach())


def test_a_cpu_fallback_answers_on_the_op_device():
    x = torch.tensor([3.0, 1.0, 2.0, 1.0]).to("xla:5")
    kept = x[x > 1.5]  # output shape depends on data: computed on the CPU
    assert kept.device == torch.device("xla:5") and _on(kept) == {jax.local_devices()[5]}
    assert kept.cpu().tolist() == [3.0, 2.0]


def test_a_device_the_process_lacks_raises():
    with pytest.raises(IndexError, match="xla:8: this process's xla devices are xla:0 to xla:7"):
        torch.zeros(2, device="xla:8")


def test_under_spmd_the_process_has_one_logical_device():
    xr.use_spmd()
    assert spmd_torch.devices() == [torch.device("xla:0")]
    with pytest.raises(
        IndexError, match=r"xla:2: this process's xla devices are xla:0 \(in SPMD mode xla:0 spans"
    ):
        torch.zeros(2, device="xla:2")
    xr.reset()


def _replica_devices(index: int) -> tuple:
    try:
        xm.xla_device(1)
    except IndexError as error:
        return spmd_torch.devices(), str(error)
    return spmd_torch.devices(), None


def test_a_replica_of_launch_owns_one_device():
    results = spmd_torch.launch(_replica_devices)
    assert len(results) == 8
    for devices, error in results.values():
        assert devices == [torch.device("xla:0")]
        assert (
            error
            == "xla:1: this process's xla devices are xla:0 (a replica of launch/spawn owns one device)"
        )


def test_a_compiled_module_runs_on_its_tensors_device():
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 2)
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model.to("xla:1"), backend="spmd_torch")
    x = torch.randn(3, 4)
    out = compiled(x.to("xla:1"))
    out.sum().backward()
    spmd_torch.sync()
    eager(x).sum().backward()
    assert out.device == model.weight.grad.device == torch.device("xla:1")
    assert _on(out) == _on(model.weight.grad) == {jax.local_devices()[1]}
    torch.testing.assert_close(out.cpu(), eager(x).detach())
    torch.testing.assert_close(model.weight.grad.cpu(), eager.weight.grad)


def test_a_loader_uploads_to_its_device():
    batches = [(torch.full((2, 3), float(k)), torch.tensor([k, k])) for k in range(3)]
    loader = pl.MpDeviceLoader(batches, xm.xla_device(3))
    seen = []
    for x, y in loader:
        assert x.device == y.device == torch.device("xla:3")
        assert _on(x) == _on(y * 2) == {jax.local_devices()[3]}
        seen.append((x.sum().item(), y.tolist()))
    assert seen == [(6.0 * k, [k, k]) for k in range(3)]
    with pytest.raises(
        ValueError, match="MpDeviceLoader: no device 'xla:9': xla:9: this process's xla devices are"
    ):
        pl.MpDeviceLoader(batches, "xla:9")


def test_a_pickled_tensor_comes_back_on_its_device(tmp_path):
    state = {"w": torch.arange(4.0, device="xla:2") * 2, "b": torch.ones(2, device="xla:0")}
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded["w"].device == torch.device("xla:2") and loaded["b"].device == torch.device(
        "xla:0"
    )
    assert _on(loaded["w"] + 0) == {jax.local_devices()[2]}
    assert loaded["w"].cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_device_queries_take_any_device_of_the_process():
    assert xm.xla_device_kind("xla:5") == jax.local_devices()[5].device_kind
    with pytest.raises(RuntimeError, match=r"keeps no memory statistics \(device cpu:3\)"):
        xm.get_memory_info("xla:3")  # JAX's CPU backend; names the device asked for
    xm.set_rng_state(7, device="xla:6")
    assert xm.get_rng_state("xla:6") == xm.get_rng_state() == 7
    with pytest.raises(ValueError, match=r"get_memory_info\(device='xla:8'\): .* xla:0 to xla:7"):
        xm.get_memory_info("xla:8")
