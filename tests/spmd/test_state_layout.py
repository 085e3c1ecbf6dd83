"""State made from a sharded tensor is laid out like it: the *_like factories, a marked parameter's
gradient and what optimizers build from them (AdamW's moments, SGD's momentum), so FSDP shards the
optimizer state without the user marking it; values and losses as eager CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.experimental.distributed_checkpoint as xc
import spmd_torch.runtime as xr
from spmd_torch._lazy import placement
from spmd_torch._lazy.execute import global_array
from spmd_torch.amp import syncfree
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()
ROWS = "{devices=[8,1]0,1,2,3,4,5,6,7}"

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
    "syncfree_adamw": lambda ps: syncfree.AdamW(ps, lr=1e-2),
}


@pytest.fixture
def mesh():
    return xs.Mesh(np.arange(8), (8,), ("fsdp",))


def new_mlp() -> nn.Module:
    """Two even layers and an uneven 10-row head (10 rows over 8 devices)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)
    )


def shard_fsdp(model: nn.Module, mesh) -> None:
    for p in model.parameters():
        if p.dim() == 2:
            xs.mark_sharding(p, mesh, ("fsdp", None))


def train(model, optimizer, device, steps: int = 3, mesh=None) -> list[float]:
    losses = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 16, generator=generator).to(device)
        y = torch.randint(0, 10, (16,), generator=generator).to(device)
        if mesh is not None:
            xs.mark_sharding(x, mesh, ("fsdp", None))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if device.type == "xla":
            spmd_torch.sync()
        losses.append(loss.detach())
    return [float(loss) for loss in losses]


def weight_states(model, optimizer) -> dict:
    """Each 2-D parameter's name -> {state key: the state tensor of its shape}."""
    out = {}
    for name, p in model.named_parameters():
        if p.dim() == 2:
            state = optimizer.state[p]
            out[name] = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 2}
    return out


@pytest.mark.parametrize("which", list(OPTIMIZERS))
def test_optimizer_state_sharded_like_its_parameter(mesh, which):
    model = new_mlp().to(dev)
    shard_fsdp(model, mesh)
    optimizer = OPTIMIZERS[which](model.parameters())
    losses = train(model, optimizer, dev, mesh=mesh)
    states = weight_states(model, optimizer)
    assert all(states.values()), states
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        assert xs.get_xla_sharding_spec(p) == ROWS, name
        for key, value in states[name].items():
            assert xs.get_xla_sharding_spec(value) == ROWS, f"{name}.{key}"
    cpu_model = new_mlp()
    expected = train(cpu_model, OPTIMIZERS[which](cpu_model.parameters()), torch.device("cpu"))
    assert_close(torch.tensor(losses), torch.tensor(expected), tol="training")


@pytest.mark.parametrize("which", ["adamw", "sgd_momentum"])
def test_a_2d_mesh_with_an_unmarked_first_parameter_trains(which):
    """The first layer left unmarked (replicated over the flat mesh uploads land on), the
    second split over a 2-D mesh both ways: the programs computing their state and their steps
    compile (JAX named the layouts it chose on the first replicated mesh it met, where a 2-D
    split has no name), the split state keeps its parameter's layout, and the losses are eager
    CPU's."""
    grid = xs.Mesh(np.arange(8), (4, 2), ("fsdp", "tensor"))
    model = new_mlp().to(dev)
    xs.mark_sharding(model[2].weight, grid, ("fsdp", "tensor"))
    optimizer = OPTIMIZERS[which](model.parameters())
    losses = train(model, optimizer, dev)
    split = xs.get_xla_sharding_spec(model[2].weight)
    assert split.startswith("{devices=[4,2]")
    assert all(
        xs.get_xla_sharding_spec(v) == split
        for v in weight_states(model, optimizer)["2.weight"].values()
    )
    cpu_model = new_mlp()
    expected = train(cpu_model, OPTIMIZERS[which](cpu_model.parameters()), torch.device("cpu"))
    assert_close(torch.tensor(losses), torch.tensor(expected), tol="training")


def test_one_model_laid_out_over_two_meshes_of_the_same_devices_trains(mesh):
    """One layer split over the 1-D mesh, another over a 2-D one of the same 8 devices. The
    programs computing the moments and the steps write tensors laid out over both (jit is given
    their layouts, so that JAX names none of them on the other mesh), and the gradients, left
    unmarked and live at each barrier, come back too (replicated where JAX could not name the
    partitioner's split); each state keeps its parameter's layout, and the losses and gradients
    are eager CPU's."""
    grid = xs.Mesh(np.arange(8), (4, 2), ("fsdp", "tensor"))
    model = new_mlp().to(dev)
    xs.mark_sharding(model[0].weight, mesh, ("fsdp", None))
    xs.mark_sharding(model[2].weight, grid, ("fsdp", "tensor"))
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    losses = train(model, optimizer, dev)
    states = weight_states(model, optimizer)
    split = xs.get_xla_sharding_spec(model[2].weight)
    assert split.startswith("{devices=[4,2]")
    for name, spec in (("0.weight", ROWS), ("2.weight", split)):
        assert all(xs.get_xla_sharding_spec(v) == spec for v in states[name].values()), name
    cpu_model = new_mlp()
    expected = train(cpu_model, OPTIMIZERS["adamw"](cpu_model.parameters()), torch.device("cpu"))
    assert_close(torch.tensor(losses), torch.tensor(expected), tol="training")
    grads = [p.grad.cpu() for p in model.parameters()]
    assert_close(grads, [p.grad for p in cpu_model.parameters()], tol="training")


def test_uneven_head_moments_hold_an_eighth_per_device(mesh):
    model = new_mlp().to(dev)
    shard_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, dev, steps=1, mesh=mesh)
    head = model[4].weight
    moments = weight_states(model, optimizer)["4.weight"]
    for array in [global_array(head)] + [global_array(v) for v in moments.values()]:
        assert {tuple(s.data.shape) for s in array.addressable_shards} == {(2, 32)}  # padded to 16
    assert placement.sharding_of(head.grad) == placement.sharding_of(head)


@pytest.mark.parametrize("rows", [16, 10], ids=["even", "uneven"])
@pytest.mark.parametrize(
    "make, value",
    [
        (torch.zeros_like, 0.0),
        (torch.ones_like, 1.0),
        (lambda t: torch.full_like(t, 3.5), 3.5),
        (torch.empty_like, None),
    ],
    ids=["zeros_like", "ones_like", "full_like", "empty_like"],
)
def test_like_factory_sharded_like_its_source(mesh, rows, make, value):
    source = torch.randn(rows, 8).to(dev)
    xs.mark_sharding(source, mesh, ("fsdp", None))
    made = make(source)
    spmd_torch.sync()
    assert xs.get_xla_sharding_spec(made) == xs.get_xla_sharding_spec(source) == ROWS
    assert made.shape == source.shape and made.dtype == source.dtype
    if value is not None:
        assert torch.equal(made.cpu(), torch.full((rows, 8), value))


def test_the_first_program_drawing_random_numbers_is_the_one_after_it(mesh):
    """The device key lands replicated over the mesh, and is given that layout at once: the
    program of a step that draws numbers compiles once, not again at its second run because the
    key's layout became known (a model initialised one layer at a time compiled each layer's
    program twice)."""
    weight = torch.empty(16, 8, device=dev)
    xs.mark_sharding(weight, mesh, ("fsdp", None))
    spmd_torch.sync()
    torch.manual_seed(5)  # a fresh key, read by the first program below
    draws = []
    for compiles in (1, 0, 0):
        with assert_compiles(compiles):
            nn.init.normal_(weight)
            spmd_torch.sync()
        draws.append(weight.cpu())
    assert xs.get_xla_sharding_spec(weight) == ROWS
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    torch.manual_seed(5)
    nn.init.normal_(weight)
    assert torch.equal(weight.cpu(), draws[0])  # the same seed, the same numbers


def test_like_factory_of_a_replicated_source_is_left_to_the_partitioner():
    source = torch.randn(16, 8).to(dev)
    spmd_torch.sync()
    made = torch.zeros_like(source)
    assert placement.sharding_of(made) is None
    spmd_torch.sync()
    assert torch.equal(made.cpu(), torch.zeros(16, 8))


def test_like_factory_on_one_device_has_no_layout():
    xr.reset()  # SPMD off
    try:
        made = torch.ones_like(torch.randn(10, 8).to(dev))
        assert placement.sharding_of(made) is None
        assert torch.equal(made.cpu(), torch.ones(10, 8))
    finally:
        xr.use_spmd()


def test_clone_of_a_view_is_left_to_the_partitioner(mesh):
    source = torch.randn(16, 8).to(dev)
    xs.mark_sharding(source, mesh, ("fsdp", None))
    made = source[:8].clone()
    assert placement.sharding_of(made) is None
    assert torch.equal(made.cpu(), source.cpu()[:8])


def test_restore_onto_a_4x2_mesh_keeps_the_moments_sharded(mesh, tmp_path):
    model = new_mlp().to(dev)
    shard_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, dev, steps=2, mesh=mesh)
    xc.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp_path / "ckpt")

    grid = xs.Mesh(np.arange(8), (4, 2), ("a", "b"))
    restored = new_mlp().to(dev)
    for p in restored.parameters():
        if p.dim() == 2:
            xs.mark_sharding(p, grid, (("a", "b"), None))
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    train(restored, restored_optimizer, dev, steps=1)  # the target's own moments exist
    state = {"model": restored.state_dict(), "optim": restored_optimizer.state_dict()}
    xc.load(state, tmp_path / "ckpt")
    restored_optimizer.load_state_dict(state["optim"])
    train(restored, restored_optimizer, dev, steps=1)
    for name, p in restored.named_parameters():
        if p.dim() != 2:
            continue
        expected = xs.get_xla_sharding_spec(p)
        assert placement.sharding_of(p).mesh.shape == {"a": 4, "b": 2} and expected == ROWS, name
        for key, value in weight_states(restored, restored_optimizer)[name].items():
            assert xs.get_xla_sharding_spec(value) == expected, f"{name}.{key}"


def test_sharded_parameters_and_moments_keep_their_buffers_across_steps(mesh):
    """Each device's shard of a parameter or moment is written back into its own buffer
    (donation pairs each output with the input it replaces)."""
    model = new_mlp().to(dev)
    shard_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def buffers() -> list[int]:
        state = [v for p in model.parameters() for v in optimizer.state[p].values() if v.dim()]
        tensors = [*model.parameters(), *state]
        return [
            s.data.unsafe_buffer_pointer()
            for t in tensors
            for s in global_array(t).addressable_shards
        ]

    train(model, optimizer, dev, steps=2, mesh=mesh)
    first = buffers()
    train(model, optimizer, dev, steps=2, mesh=mesh)
    assert buffers() == first
