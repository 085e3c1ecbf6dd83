"""Foreach ops (what torch.optim and clip_grad_norm_ use) match eager CPU, in place and not."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch.debug import graph
from tests.helpers import assert_close, to_device

CASES = {
    "add_list_alpha": lambda a, b, c: torch._foreach_add_(a, b, alpha=-0.5),
    "add_scalarlist": lambda a, b, c: torch._foreach_add_(a, [0.5, 1.5, 2.5]),
    "div_scalarlist_of_one_value": lambda a, b, c: torch._foreach_div_(a, [0.7, 0.7, 0.7]),
    "mul_scalar": lambda a, b, c: torch._foreach_mul_(a, 0.9),
    "mul_tensor": lambda a, b, c: torch._foreach_mul_(a, c[0].sum()),
    "addcdiv_scalarlist": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [0.1, 0.2, 0.3]),
    "addcmul_scalar": lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.3),
    "lerp_scalar": lambda a, b, c: torch._foreach_lerp_(a, b, 0.25),
    "maximum_list": lambda a, b, c: torch._foreach_maximum_(a, b),
    "sqrt": lambda a, b, c: torch._foreach_sqrt([x.abs() for x in a]),
    "norm": lambda a, b, c: torch._foreach_norm(a, 2),
    "zero": lambda a, b, c: torch._foreach_zero_(a),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_foreach_matches_eager(name):
    torch.manual_seed(0)
    tensors = [[torch.randn(n, 3) for n in (2, 3, 4)] for _ in range(3)]
    for group in tensors[2]:
        group.abs_().add_(0.5)  # divisors away from zero
    device_tensors = to_device(tensors)
    expected = CASES[name](*tensors)
    actual = CASES[name](*device_tensors)
    assert_close(actual, expected)
    assert_close(device_tensors, tensors)  # in-place results


def test_a_list_of_one_value_is_lifted_as_one_scalar():
    """AdamW's bias corrections: one value per parameter, all equal. Lifted as one scalar, every
    element's computation is alike (XLA compiles one kernel for them all, not one each)."""
    tensors = [torch.ones(2, device=spmd_torch.device()) for _ in range(3)]
    spmd_torch.sync()
    torch._foreach_div_(tensors, [0.5, 0.5, 0.5])
    assert len(graph.pending_program().scalars) == 1
    assert graph.pending_program().scalar_values().tolist() == [0.5]
    assert_close(tensors, [torch.full((2,), 2.0)] * 3)


@pytest.mark.users_codegen
@pytest.mark.parametrize("weight", [0.0, 0.1, 0.49, 0.5, 0.9, 1.0, -0.3, 1.7])
def test_lerp_with_one_weight_is_aten_bit_for_bit(weight):
    """A single weight picks ATen's formula side once per op (``end + (w - 1) * d`` for the far
    side): the same bits as eager CPU's two-sided formula, on either side of 0.5."""
    torch.manual_seed(1)
    start, end = torch.randn(64) * 3, torch.randn(64) * 1e-3
    dev = spmd_torch.device()
    assert torch.equal(
        torch.lerp(start.to(dev), end.to(dev), weight).cpu(), start.lerp(end, weight)
    )
    got = torch._foreach_lerp([start.to(dev)], [end.to(dev)], weight)[0].cpu()
    assert torch.equal(got, torch._foreach_lerp([start], [end], weight)[0])
