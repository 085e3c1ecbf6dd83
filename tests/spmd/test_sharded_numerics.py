"""Sharded programs compute what unsharded ones do, for 1-D and 2-D meshes and every spec shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_torch
import spmd_torch.debug.graph
import spmd_torch.distributed.spmd as xs
from spmd_torch._lazy import compile as compiler
from spmd_torch._lazy import engine
from spmd_torch._lazy.execute import global_array
from tests.helpers import assert_close, assert_compiles, assert_counter_delta

dev = spmd_torch.device()

MESHES = {
    "1d": lambda: xs.Mesh(np.arange(8), (8,), ("x",)),
    "2x4": lambda: xs.Mesh(np.arange(8), (2, 4), ("data", "model")),
    "4x2": lambda: xs.Mesh(np.arange(8), (4, 2), ("data", "model")),
}

# For a [rows, cols] matrix: which spec each named layout takes on a 1-D / 2-D mesh.
SPECS_1D = {"row": ("x", None), "column": (None, "x"), "replicated": (None, None)}
SPECS_2D = {
    "row": ("data", None),
    "column": (None, "model"),
    "both": ("data", "model"),
    "both_transposed": ("model", "data"),
    "replicated": (None, None),
    "partial": (("data", "model"), None),  # dim 0 over both axes
}
LAYOUTS = [("1d", name, spec) for name, spec in SPECS_1D.items()] + [
    (mesh, name, spec) for mesh in ("2x4", "4x2") for name, spec in SPECS_2D.items()
]


def _sharded(cpu: torch.Tensor, mesh: xs.Mesh, spec) -> torch.Tensor:
    t = cpu.to(dev)
    xs.mark_sharding(t, mesh, spec)
    return t


@pytest.mark.parametrize(("mesh_name", "layout", "spec"), LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [16, 10], ids=["even", "uneven"])
def test_matmul_matches_unsharded(mesh_name, layout, spec, rows):
    mesh = MESHES[mesh_name]()
    a, b = torch.randn(rows, 12), torch.randn(12, 24)
    out = _sharded(a, mesh, spec) @ _sharded(b, mesh, spec[::-1])
    assert_close(out, a @ b)


@pytest.mark.parametrize("mesh_name", ["1d", "2x4"])
def test_mlp_forward_and_grads_match_unsharded(mesh_name):
    mesh = MESHES[mesh_name]()
    batch_axis, model_axis = ("x", None) if mesh_name == "1d" else ("data", "model")
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 6))
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 6))
    model.load_state_dict(ref.state_dict())
    model.to(dev)
    xs.mark_sharding(model[0].weight, mesh, (model_axis, None))  # column parallel
    xs.mark_sharding(model[2].weight, mesh, (None, model_axis))  # row parallel
    x = torch.randn(10, 12)  # 10 rows: uneven over every batch axis
    loss = model(_sharded(x, mesh, (batch_axis, None))).square().mean()
    loss.backward()
    ref(x).square().mean().backward()
    assert_close(loss, ref(x).square().mean())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)


ATTENTION_LAYOUTS = [
    ("1d", ("x", None, None, None), 8),  # batch
    ("1d", (None, "x", None, None), 8),  # heads
    ("1d", ("x", None, None, None), 6),  # batch, uneven
    ("2x4", ("data", "model", None, None), 8),  # batch x heads
    ("4x2", ("data", "model", None, None), 5),  # batch x heads, uneven batch
]


@pytest.mark.parametrize(("mesh_name", "spec", "batch"), ATTENTION_LAYOUTS, ids=str)
def test_attention_matches_unsharded(mesh_name, spec, batch):
    mesh = MESHES[mesh_name]()
    q, k, v = (torch.randn(batch, 8, 16, 4) for _ in range(3))
    out = F.scaled_dot_product_attention(
        *(_sharded(t, mesh, spec) for t in (q, k, v)), is_causal=True
    )
    assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_constraint_on_a_pending_value_lays_out_the_result():
    mesh = MESHES["1d"]()
    y = torch.arange(96.0).reshape(24, 4).to(dev) * 3
    xs.mark_sharding(y, mesh, ("x", None))
    spmd_torch.sync()
    array = global_array(y)
    assert [s.data.shape for s in array.addressable_shards] == [(3, 4)] * 8
    assert_close(y, torch.arange(96.0).reshape(24, 4) * 3)


def test_a_replicated_input_read_first_does_not_stop_an_output_split_over_a_2d_mesh():
    """JAX names the outputs' layouts on the first input's mesh; a replicated upload's 1-D mesh
    has no name for a split over one axis of a (2, 4) mesh (IndivisibleError at compile)."""
    mesh = MESHES["2x4"]()
    offset = torch.ones(2).to(dev)  # replicated, and the program's first input
    x = torch.arange(32.0).reshape(4, 8).to(dev)
    xs.mark_sharding(x, mesh, (None, "data"))
    spmd_torch.sync()
    y = offset.sum() + x * 2
    spmd_torch.sync()
    assert_close(y.cpu(), torch.arange(32.0).reshape(4, 8) * 2 + 2)
    assert xs.get_xla_sharding_spec(y) == xs.get_xla_sharding_spec(x)


def test_uneven_data_is_stored_padded_and_read_back_logically():
    mesh = MESHES["1d"]()
    cpu = torch.arange(30.0).reshape(10, 3)
    t = _sharded(cpu, mesh, ("x", None))
    array = global_array(t)
    assert array.shape == (16, 3) and tuple(t.shape) == (10, 3)
    assert_close(t, cpu)
    assert_close(t.sum(0), cpu.sum(0))  # the padding never leaks into a reduction
    t.mul_(2)
    spmd_torch.sync()
    assert global_array(t).shape == (16, 3)  # the in-place result stays padded
    assert_close(t, cpu * 2)


def _train(model, opt, batches, to_input):
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(to_input(x)), to_input(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        spmd_torch.sync()
        losses.append(loss)
    return losses


@pytest.mark.parametrize("make_opt", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_training_matches_unsharded_keeps_shardings_and_compiles_once(make_opt):
    mesh = MESHES["2x4"]()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 6))
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 6))
    model.load_state_dict(ref.state_dict())
    model.to(dev)
    specs = {"0.weight": ("model", None), "0.bias": ("model",), "2.weight": (None, "model")}
    params = dict(model.named_parameters())
    for name, spec in specs.items():
        xs.mark_sharding(params[name], mesh, spec)
    marked = {name: xs.get_xla_sharding_spec(params[name]) for name in specs}
    batches = [(torch.randn(8, 12), torch.randint(0, 6, (8,))) for _ in range(4)]

    def shard_batch(t):
        return _sharded(t, mesh, ("data",) + (None,) * (t.dim() - 1))

    opt = make_opt(model.parameters(), lr=0.1)
    with assert_compiles(1):  # Adam's moments are filled on the host
        losses = _train(model, opt, batches, shard_batch)
    expected = _train(ref, make_opt(ref.parameters(), lr=0.1), batches, lambda t: t)
    for got, want in zip(losses, expected):
        assert_close(got, want)
    for name, text in marked.items():
        assert xs.get_xla_sharding_spec(params[name]) == text, name
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)


def test_steady_steps_transfer_nothing_to_the_host_and_reuse_the_program():
    mesh = MESHES["1d"]()
    model = nn.Linear(16, 16).to(dev)
    xs.mark_sharding(model.weight, mesh, ("x", None))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = _sharded(torch.randn(8, 16), mesh, ("x", None))

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        spmd_torch.sync()

    step()
    step()
    with assert_compiles(0), assert_counter_delta("TransferFromDevice", 0):
        for _ in range(3):
            step()


def test_compiled_step_contains_the_collectives_gspmd_inserts():
    mesh = MESHES["1d"]()
    a, b = torch.randn(4, 32), torch.randn(32, 8)
    # Contracting over a sharded dimension leaves partial sums on each device: GSPMD all-reduces.
    z = _sharded(a, mesh, (None, "x")) @ _sharded(b, mesh, ("x", None))
    compiler.clear_cache()
    spmd_torch.sync()
    (executable,) = engine.current().cache.executables.values()
    assert "all-reduce" in executable.compiled.as_text()
    assert_close(z, a @ b)


def test_marking_a_pending_view_constrains_that_value_only():
    mesh = MESHES["1d"]()
    base = torch.arange(64.0).reshape(16, 4).to(dev)
    flat = (base * 2).view(-1)  # a model output flattened, as a forward may return it
    xs.mark_sharding(flat, mesh, ("x",))
    doubled = flat + 0
    spmd_torch.sync()
    assert [s.data.shape for s in global_array(doubled).addressable_shards] == [(8,)] * 8
    assert_close(doubled, torch.arange(64.0) * 2)
    assert xs.get_xla_sharding_spec(base) == ""  # the base was not marked


def test_sharded_uneven_state_dict_saves_and_loads_logical_values(tmp_path):
    mesh = MESHES["1d"]()
    torch.manual_seed(0)
    cpu = nn.Linear(5, 10)
    model = nn.Linear(5, 10)
    model.load_state_dict(cpu.state_dict())
    model.to(dev)
    xs.mark_sharding(model.weight, mesh, ("x", None))  # 10 rows over 8 devices: stored padded
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path)  # weights_only, the default
    assert loaded["weight"].device == dev
    assert_close(loaded["weight"], cpu.weight.detach())
    assert_close(loaded["bias"], cpu.bias.detach())


def test_pending_graph_text_shows_layouts():
    mesh = MESHES["2x4"]()
    w = _sharded(torch.randn(8, 4), mesh, ("data", "model"))
    y = w * 2
    xs.mark_sharding(y, mesh, (("data", "model"), None))
    text = spmd_torch.debug.graph.pending_text([y])
    assert "%in0:f32[8,4]{data,model} = xla::device_data" in text
    assert "%1:f32[8,4] = sharding_constraint(%0, {data+model,_})" in text


def test_reading_a_loss_mid_step_changes_no_layout_and_compiles_nothing_new():
    mesh = MESHES["1d"]()
    model = nn.Linear(16, 10).to(dev)  # 10 rows: an uneven, padded layout
    xs.mark_sharding(model.weight, mesh, ("x", None))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = _sharded(torch.randn(8, 16), mesh, ("x", None))
    marked = xs.get_xla_sharding_spec(model.weight)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        model.weight.cpu()  # a partial run computes the updated weight before the barrier
        spmd_torch.sync()

    for _ in range(3):
        step()
    with assert_compiles(0):
        step()
    assert xs.get_xla_sharding_spec(model.weight) == marked
    assert global_array(model.weight).shape == (16, 16)
