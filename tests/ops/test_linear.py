"""F.linear on xla tensors: one node forward, einsums and a sum backward, gradients equal to eager
CPU's in float64; the backward is differentiable again (``create_graph``) and runs under
functorch's transforms, the paths that take ``torch.einsum`` and ``Function.apply`` whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
from spmd_torch._lazy import counters
from tests.helpers import assert_close

dev = spmd_torch.device()


def _operands(bias: bool, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, 4), (5, 4)] + [(5,)] * bias
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def _on_device(cpu: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to(dev).requires_grad_() for t in cpu]


@pytest.mark.parametrize("bias", [True, False])
def test_linear_records_one_node_forward_and_einsums_backward(bias):
    cpu = _operands(bias)
    ours = _on_device(cpu)
    seed = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    upstream = seed.to(dev)
    counters.clear()
    out = F.linear(*ours)
    assert counters.op_counters() == {"xla::linear": 1}
    counters.clear()
    grads = torch.autograd.grad(out, ours, upstream)
    assert counters.op_counters() == {"xla::einsum": 2, **({"xla::sum": 1} if bias else {})}
    expected_out = F.linear(*cpu)
    expected = torch.autograd.grad(expected_out, cpu, seed)
    assert_close(out, expected_out)
    for actual, want in zip(grads, expected):
        assert_close(actual, want)


def test_linear_backward_with_create_graph_gives_eager_second_derivatives():
    cpu = _operands(bias=True, seed=1)
    ours = _on_device(cpu)
    results = []
    for x, w, b in (cpu, ours):
        (gw,) = torch.autograd.grad(F.linear(x, w, b).square().sum(), [w], create_graph=True)
        results.append(torch.autograd.grad(gw.pow(3).sum(), [x, w, b]))
    for actual, want in zip(results[1], results[0]):
        assert_close(actual, want)


def test_linear_under_functorch_grad_and_vmap_matches_eager():
    cpu = _operands(bias=True, seed=2)
    x, w, b = (t.detach() for t in cpu)

    def loss(weight, inputs, bias):
        return F.linear(inputs, weight, bias).tanh().sum()

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))
    expected = per_example(w, x, b)
    actual = per_example(w.to(dev), x.to(dev), b.to(dev))
    assert_close(actual, expected)
