"""spmd_torch.distributed.fsdp: the wrap policies pick the expected submodules of a small
transformer, FSDPv2 takes them, recursive_wrap applies them, checkpoint_module keeps the
gradients, and FSDP v1's names say where to go instead."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch import nn

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch.distributed.fsdp import checkpoint_module
from spmd_torch.distributed.fsdp.wrap import (
    always_wrap_policy,
    lambda_auto_wrap_policy,
    recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from spmd_torch.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)
from tests.helpers import assert_close


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Unit(nn.Module):
    """A stand-in wrapper that records what it wrapped."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs

    def forward(self, *args):
        return self.module(*args)


def wrapped_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Unit)]


def test_transformer_policy_wraps_the_blocks():
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model, count = recursive_wrap(TinyTransformer(), policy, Unit, set(), set(), tag=1)
    assert wrapped_names(model) == ["blocks.0", "blocks.1"]
    assert count == 2 * sum(p.numel() for p in Block().parameters())
    assert model.blocks[0].kwargs == {"tag": 1}


def test_size_based_policy_wraps_large_modules_but_not_module_lists():
    block_params = sum(p.numel() for p in Block().parameters())  # 624; embed + head: 272
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=block_params)
    model, _ = recursive_wrap(TinyTransformer(), policy, Unit, set(), set())
    assert wrapped_names(model) == ["blocks.0", "blocks.1"]  # not the ModuleList, nor the root
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=250)
    model, _ = recursive_wrap(TinyTransformer(), policy, Unit, set(), set())
    assert wrapped_names(model) == [
        "",  # the root's 416 parameters left unwrapped
        "module.blocks.0.mlp.0",  # 288 parameters
        "module.blocks.0.mlp.2",  # 264
        "module.blocks.1.mlp.0",
        "module.blocks.1.mlp.2",
    ]


def test_size_based_policy_does_not_look_inside_forced_leaves():
    mha = nn.MultiheadAttention(8, 2)
    assert size_based_auto_wrap_policy(mha, True, 10**9) is False
    assert size_based_auto_wrap_policy(mha, False, 10**9) is True
    assert size_based_auto_wrap_policy(nn.Linear(2, 2), False, 5) is False


def test_lambda_and_always_policies():
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.GELU))
    model, _ = recursive_wrap(TinyTransformer(), policy, Unit, set(), set())
    assert wrapped_names(model) == ["blocks.0.mlp.1", "blocks.1.mlp.1"]
    model, _ = recursive_wrap(Block(), always_wrap_policy, Unit, set(), set())
    assert wrapped_names(model) == [
        "",
        "module.attn",
        "module.mlp",
        "module.mlp.module.0",
        "module.mlp.module.1",
        "module.mlp.module.2",
    ]


def test_recursive_wrap_skips_ignored_modules_and_refuses_wrapped_ones():
    model = TinyTransformer()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model, _ = recursive_wrap(model, policy, Unit, {model.blocks[1]}, set())
    assert wrapped_names(model) == ["blocks.0"]
    with pytest.raises(ValueError, match="'blocks.0' is already a Unit"):
        recursive_wrap(model, policy, Unit, set(), set())


@pytest.fixture
def spmd_mode():
    xr.use_spmd()


def test_fsdpv2_takes_the_policies(spmd_mode):
    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    reference = TinyTransformer()
    model = FSDPv2(copy.deepcopy(reference).to(xm.xla_device()), mesh=mesh, auto_wrap_policy=policy)
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPv2) and name]
    assert units == ["_orig_module.blocks.0", "_orig_module.blocks.1"]
    tokens = torch.randint(0, 16, (8, 4))
    assert_close(model(tokens.to(xm.xla_device())), reference(tokens))


def test_checkpoint_module_keeps_outputs_and_gradients():
    torch.manual_seed(0)
    plain, checkpointed = Block(), Block()
    checkpointed.load_state_dict(plain.state_dict())
    checkpoint_module(checkpointed)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    plain(x).square().sum().backward()
    checkpointed(x2).square().sum().backward()
    # both on CPU, the recomputed forward the same ops as the first: bit for bit
    assert_close(x2.grad, x.grad, tol="exact")
    for a, b in zip(checkpointed.parameters(), plain.parameters()):
        assert_close(a.grad, b.grad, tol="exact")
    with torch.no_grad():  # no input needs gradients: runs the forward as is
        assert_close(checkpointed(x), plain(x), tol="exact")


def test_checkpoint_module_on_the_device_matches_eager():
    torch.manual_seed(0)
    eager = Block()
    on_device = checkpoint_module(Block()).to(xm.xla_device())
    on_device.load_state_dict(eager.state_dict())
    x = torch.randn(4, 8)
    xd = x.to(xm.xla_device()).requires_grad_()
    x.requires_grad_()
    eager(x).square().sum().backward()
    on_device(xd).square().sum().backward()
    xm.mark_step()
    assert_close(xd.grad, x.grad, kind="grad")
    assert_close(on_device.mlp[0].weight.grad, eager.mlp[0].weight.grad, kind="grad")


def test_checkpoint_module_refuses_a_non_module():
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        checkpoint_module(lambda x: x)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x, scale=1.0, shift=None):
        return self.linear(x) * scale + shift


def test_checkpoint_module_passes_keyword_arguments():
    torch.manual_seed(0)
    plain = Scaled()
    checkpointed = checkpoint_module(Scaled())
    checkpointed.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, requires_grad=True)
    shift = torch.randn(3, requires_grad=True)
    x2, shift2 = x.detach().clone().requires_grad_(), shift.detach().clone().requires_grad_()
    plain(x, scale=3.0, shift=shift).sum().backward()
    checkpointed(x2, scale=3.0, shift=shift2).sum().backward()
    assert_close(x2.grad, x.grad, tol="exact")  # both on CPU, as above
    assert_close(shift2.grad, shift.grad, tol="exact")
    assert_close(checkpointed.linear.weight.grad, plain.linear.weight.grad, tol="exact")


def test_fsdp_patch_of_nn_linear_keeps_modules_and_matches_eager():
    from spmd_torch.distributed.fsdp.utils import apply_xla_patch_to_nn_linear

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), checkpoint_module(nn.Linear(5, 3)))
    x = torch.randn(4, 6)
    eager(x).sum().backward()
    model = copy.deepcopy(eager).to(spmd_torch.device())
    model.zero_grad()
    params = list(model.parameters())
    calls = []

    def counted(linear, input):
        calls.append(linear)
        return xs.xla_patched_nn_linear_forward(linear, input)

    assert apply_xla_patch_to_nn_linear(model, counted) is model
    assert list(model.parameters()) == params  # in place: the optimizer's parameters stay
    out = model(x.to(spmd_torch.device()))
    out.sum().backward()
    # The checkpointed layer's inner forward is patched too, and runs again in the backward pass.
    assert calls == [model[0], model[2], model[2]]
    assert_close(out, eager(x))
    assert_close(
        [p.grad for p in model.parameters()], [p.grad for p in eager.parameters()], kind="grad"
    )
