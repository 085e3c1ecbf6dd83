"""SpmdFullyShardedDataParallel: parameters and outputs sharded over 'fsdp', training as eager."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

import spmd_torch
import spmd_torch.distributed.spmd as xs
from spmd_torch.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)
from tests.helpers import assert_close, assert_compiles, tolerance

dev = spmd_torch.device()
DEVICES = ",".join(map(str, range(8)))
VOCAB, DIM = 32, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, two residual blocks, a head tied to the embedding: 1-D, 2-D and shared params."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


@pytest.fixture
def mesh():
    return xs.Mesh(np.arange(8), (8,), ("fsdp",))


def _expected_spec(shape: tuple) -> str:
    """The sharding string of a tensor split 8 ways along its largest dimension."""
    tiles = [1] * len(shape)
    tiles[shape.index(max(shape))] = 8
    return f"{{devices=[{','.join(map(str, tiles))}]{DEVICES}}}"


def _batches(steps: int):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (8, 6), generator=generator)
        yield tokens, torch.roll(tokens, -1, dims=1)


def _train(model, device, steps, make_optimizer, mesh=None):
    optimizer = make_optimizer(model.parameters())
    losses = []
    for tokens, targets in _batches(steps):
        tokens, targets = tokens.to(device), targets.to(device)
        if mesh is not None:
            xs.mark_sharding(tokens, mesh, ("fsdp", None))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        if device.type == "xla":
            spmd_torch.sync()
        losses.append(loss.detach())
    return [float(loss) for loss in losses]


def test_every_parameter_sharded_along_its_largest_dimension(mesh):
    model = FSDPv2(TinyLM(), mesh=mesh)
    params = dict(model.module.named_parameters())
    assert len(params) == 15  # the tied head weight is the embedding's
    for name, param in params.items():
        shape = tuple(param.shape)
        assert xs.get_xla_sharding_spec(param) == _expected_spec(shape), name
        dim = shape.index(max(shape))
        shard_shape = shape[:dim] + (shape[dim] // 8,) + shape[dim + 1 :]
        shards = xs.wrap_as_sharded_tensor(param).local_shards
        assert [tuple(s.data.shape) for s in shards] == [shard_shape] * 8, name


def test_module_moved_to_the_xla_device(mesh):
    model = FSDPv2(TinyLM(), mesh=mesh)
    assert {p.device.type for p in model.parameters()} == {"xla"}


def test_tied_parameters_stay_tied(mesh):
    model = FSDPv2(TinyLM(), mesh=mesh)
    assert model.module.head.weight is model.module.embed.weight


def test_parameter_already_sharded_keeps_its_sharding(mesh):
    module = TinyLM().to(dev)
    xs.mark_sharding(module.blocks[0].up.weight, mesh, (None, "fsdp"))
    FSDPv2(module, mesh=mesh)
    assert xs.get_xla_sharding_spec(module.blocks[0].up.weight) == f"{{devices=[1,8]{DEVICES}}}"


def test_output_sharded_on_the_batch_dimension(mesh):
    model = FSDPv2(TinyLM(), mesh=mesh)
    logits = model(torch.randint(0, VOCAB, (8, 6)).to(dev))
    assert xs.get_xla_sharding_spec(logits) == f"{{devices=[8,1,1]{DEVICES}}}"


def test_training_with_adamw_matches_eager_step_by_step(mesh):
    torch.manual_seed(0)
    reference = TinyLM()
    model = FSDPv2(copy.deepcopy(reference), mesh=mesh)

    def adamw(params):
        # Adam moves every element by about lr * sign(grad), so a gradient that is float noise
        # around zero (~1e-9, sign differing between the two runs) would move by up to 2 * lr;
        # eps=1e-6 keeps such elements still and the comparison well conditioned.
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-6)

    expected = _train(reference, torch.device("cpu"), 4, adamw)
    # AdamW's moments, made in step 1, are filled on the host: the four steps run one program.
    with assert_compiles(1):
        actual = _train(model, dev, 4, adamw, mesh)
    assert_close(torch.tensor(actual), torch.tensor(expected))
    for (name, p_cpu), p_dev in zip(reference.named_parameters(), model.module.parameters()):
        assert_close({name: p_dev}, {name: p_cpu}, **tolerance(torch.float32, name="training"))


def test_parameters_keep_their_sharding_after_optimizer_step(mesh):
    model = FSDPv2(TinyLM(), mesh=mesh)
    _train(model, dev, 2, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), mesh)
    for name, param in model.module.named_parameters():
        assert xs.get_xla_sharding_spec(param) == _expected_spec(tuple(param.shape)), name


@pytest.mark.parametrize(
    "policy",
    [
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        ModuleWrapPolicy({Block}),
    ],
    ids=["transformer_auto_wrap_policy", "ModuleWrapPolicy"],
)
def test_auto_wrap_policy_wraps_the_named_block_classes(mesh, policy):
    model = FSDPv2(TinyLM(), mesh=mesh, auto_wrap_policy=policy)
    wrapped = [name for name, m in model.named_modules() if isinstance(m, FSDPv2)]
    assert wrapped == ["", "_orig_module.blocks.0", "_orig_module.blocks.1"]
    block = model.module.blocks[0]
    assert isinstance(block.module, Block)
    for name, param in model.named_parameters():
        assert xs.get_xla_sharding_spec(param) == _expected_spec(tuple(param.shape)), name


def test_auto_wrapped_block_shards_its_output(mesh):
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(TinyLM(), mesh=mesh, auto_wrap_policy=policy)
    hidden = model.module.blocks[0](torch.randn(8, 6, DIM).to(dev))
    assert xs.get_xla_sharding_spec(hidden) == f"{{devices=[8,1,1]{DEVICES}}}"


def test_auto_wrapper_callable_builds_the_wrapped_blocks(mesh):
    calls = []

    def wrapper(module, **kwargs):
        calls.append(type(module).__name__)
        return FSDPv2(module, **kwargs)

    FSDPv2(
        TinyLM(),
        mesh=mesh,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        auto_wrapper_callable=wrapper,
    )
    assert calls == ["Block", "Block"]


def test_custom_shard_output_receives_output_and_mesh(mesh):
    seen = []
    model = FSDPv2(TinyLM(), mesh=mesh, shard_output=lambda out, m: seen.append((out, m)))
    logits = model(torch.randint(0, VOCAB, (8, 6)).to(dev))
    assert len(seen) == 1 and seen[0][0] is logits and seen[0][1] is mesh
    assert xs.get_xla_sharding_spec(logits) == ""


class _Returns(nn.Module):
    def __init__(self, make_output):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.make_output = make_output

    def forward(self, x):
        return self.make_output(self.linear(x))


def test_tuple_output_shards_its_first_element_and_warns(mesh):
    model = FSDPv2(_Returns(lambda y: (y, y.sum())), mesh=mesh)
    with pytest.warns(UserWarning, match="only its first element is sharded"):
        first, _ = model(torch.randn(8, DIM).to(dev))
    assert xs.get_xla_sharding_spec(first) == f"{{devices=[8,1]{DEVICES}}}"


def test_unsupported_output_raises_naming_its_type(mesh):
    model = FSDPv2(_Returns(lambda y: {"logits": y}), mesh=mesh)
    with pytest.raises(RuntimeError, match="output of type dict.*shard_output="):
        model(torch.randn(8, DIM).to(dev))


def test_mesh_without_fsdp_axis_raises_naming_its_axes():
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"no axis named 'fsdp'.*'data': 2, 'model': 4"):
        FSDPv2(TinyLM(), mesh=mesh)


def test_unnamed_mesh_raises_naming_its_axes():
    with pytest.raises(ValueError, match=r"no axis named 'fsdp'.*0: 8.*axis_names=None"):
        FSDPv2(TinyLM(), mesh=xs.Mesh(np.arange(8), (8,)))


def test_no_mesh_and_no_global_mesh_raises():
    assert xs.get_global_mesh() is None
    with pytest.raises(ValueError, match="no mesh was given and no global mesh is set"):
        FSDPv2(TinyLM())


def test_global_mesh_used_when_no_mesh_given(mesh):
    xs.set_global_mesh(mesh)
    try:
        model = FSDPv2(TinyLM())
    finally:
        xs.set_global_mesh(None)
    assert model._mesh is mesh
    assert xs.get_xla_sharding_spec(model.module.embed.weight) == f"{{devices=[8,1]{DEVICES}}}"


def test_extra_data_axis_not_in_mesh_raises(mesh):
    with pytest.raises(
        ValueError,
        match=r"The provided data axis is not in the mesh\. \(extra_data_axis='data'; the mesh's axes are",
    ):
        FSDPv2(TinyLM(), mesh=mesh, extra_data_axis="data")


def test_extra_data_axis_splits_outputs_over_data_and_fsdp():
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "fsdp"))
    model = FSDPv2(TinyLM(), mesh=mesh, extra_data_axis="data")
    logits = model(torch.randint(0, VOCAB, (8, 6)).to(dev))
    assert xs.get_xla_sharding_spec(logits) == f"{{devices=[8,1,1]{DEVICES}}}"
    weight = model.module.embed.weight  # parameters: 'fsdp' only, replicated over 'data'
    assert (
        xs.get_xla_sharding_spec(weight)
        == "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
    )


def test_wrapping_a_wrapped_module_raises(mesh):
    model = FSDPv2(TinyLM(), mesh=mesh)
    with pytest.raises(RuntimeError, match="already wrapped"):
        FSDPv2(model, mesh=mesh)


def test_auto_wrap_with_a_wrapped_submodule_raises(mesh):
    module = TinyLM()
    module.blocks[0] = FSDPv2(module.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="submodule 'blocks.0' is already wrapped"):
        FSDPv2(module, mesh=mesh, auto_wrap_policy=ModuleWrapPolicy({Block}))


def test_module_without_forward_raises(mesh):
    with pytest.raises(RuntimeError, match="ModuleList defines no forward"):
        FSDPv2(nn.ModuleList([Block()]), mesh=mesh)


def test_attributes_and_indexing_forward_to_the_module(mesh):
    model = FSDPv2(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()), mesh=mesh)
    assert model[0] is model.module[0]
    inner = FSDPv2(TinyLM(), mesh=mesh)
    assert inner.head is inner.module.head
    with pytest.raises(AttributeError, match="no_such_attribute"):
        inner.no_such_attribute  # noqa: B018
