"""assume_pure and PureModule against eager PyTorch on CPU (values and gradients): recorded once
per structure of the arguments, one op each way, seeded random numbers, named errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_torch
from spmd_torch._lazy import loop
from spmd_torch.debug import graph
from spmd_torch.experimental.assume_pure import PureModule, assume_pure
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()
_SCANS = (*loop.SCAN, *loop.SCAN_BACKWARD)


def _block(x, w, *, bias=None, scale=1.0):
    y = torch.sin(x @ w) * scale
    return {"y": y if bias is None else y + bias, "norm": y.norm()}


def _inputs(requires_grad: bool = True):
    torch.manual_seed(0)
    x, w, bias = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    return [t.requires_grad_(requires_grad) for t in (x, w, bias)]


def test_values_and_gradients_equal_eager_with_kwargs_statics_and_partial_grads():
    x, w, bias = _inputs()
    w.requires_grad_(False)
    want = _block(x, w, bias=bias, scale=0.5)
    (want["y"].sum() + want["norm"]).backward()
    xd, wd, bd = (t.detach().to(dev).requires_grad_(t.requires_grad) for t in (x, w, bias))
    got = assume_pure(_block)(xd, wd, bias=bd, scale=0.5)
    (got["y"].sum() + got["norm"]).backward()
    assert_close((got["y"], got["norm"]), (want["y"].detach(), want["norm"].detach()))
    assert_close((xd.grad, bd.grad), (x.grad, bias.grad), kind="grad")
    assert wd.grad is None


def test_traced_once_per_structure_and_one_program_per_step():
    traces = []

    @assume_pure
    def traced(x, w, scale):
        traces.append(scale)
        return torch.sin(x @ w) * scale

    def step(scale: float):
        x = torch.ones(3, 3, device=dev, requires_grad=True)
        traced(x, x, scale).sum().backward()
        spmd_torch.sync()
        return x.grad

    step(2.0)
    with assert_compiles(0):
        for _ in range(3):
            grad = step(2.0)
    assert traces == [2.0]  # a new value of a non-tensor argument is a recording of its own
    step(3.0)
    assert traces == [2.0, 3.0]
    x = torch.ones(3, 3, requires_grad=True)
    (torch.sin(x @ x) * 2.0).sum().backward()
    assert_close(grad, x.grad, kind="grad")


def test_a_call_is_one_node_each_way():
    @assume_pure
    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    x, w1, w2 = (torch.randn(2, 2, device=dev, requires_grad=True) for _ in range(3))
    spmd_torch.sync()
    out = mlp(x, w1, w2)
    forward = len(graph.pending_program().nodes)
    out.sum().backward()
    assert forward <= 5  # the inputs' views, the call, its output's read
    calls = [node.op for node in graph.pending_program().nodes if node.op in _SCANS]
    assert calls == [loop.SCAN[0], loop.SCAN_BACKWARD[0]]


def test_rng_seed_gives_its_numbers_and_leaves_the_device_stream_alone():
    noisy = assume_pure(lambda a: a + torch.rand_like(a), add_rng_seed_argument=True)
    a = torch.zeros(2, 2, device=dev)
    spmd_torch.manual_seed(7)
    first = noisy(a, rng_seed=0).cpu()
    after = torch.rand(3, device=dev).cpu()
    again = noisy(a, rng_seed=0).cpu()
    other = noisy(a, rng_seed=torch.tensor(1, device=dev)).cpu()
    spmd_torch.manual_seed(7)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(after, torch.rand(3, device=dev).cpu())  # as if no call had drawn
    with pytest.raises(AssertionError, match="pass the keyword argument rng_seed"):
        noisy(a)


def test_without_a_seed_random_ops_draw_new_numbers_at_each_call():
    noisy = assume_pure(lambda a: a + torch.rand_like(a))
    a = torch.zeros(2, 2, device=dev)
    assert not torch.equal(noisy(a).cpu(), noisy(a).cpu())


def test_pure_module_equals_the_module_and_trains_its_parameters():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    module(x).square().sum().backward()
    pure = PureModule(_copy(module)).to(dev)
    pure(x.to(dev)).square().sum().backward()
    assert_close(
        [q.grad for q in pure._module.parameters()],
        [p.grad for p in module.parameters()],
        kind="grad",
    )


def _copy(module: nn.Module) -> nn.Module:
    copied = copy.deepcopy(module)
    copied.zero_grad(set_to_none=True)
    return copied


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"assume_pure: argument 0 \(flattened\) must be an xla"):
        assume_pure(torch.sin)(torch.ones(2))
    with pytest.raises(TypeError, match="unhashable \\(set\\)"):
        assume_pure(lambda x, k: x * len(k))(torch.ones(2, device=dev), {1, 2})
    with pytest.raises(TypeError, match="rng_seed must be an int or an xla tensor"):
        assume_pure(torch.sin, add_rng_seed_argument=True)(torch.ones(2, device=dev), rng_seed=0.5)
