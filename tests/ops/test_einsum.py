"""einsum on xla tensors: one op, lowered whole (no bmm and reshapes from ATen's decomposition)
where autograd does not record it, equal to eager CPU einsum in float64; with gradients the
decomposition runs and its gradients equal eager's."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
import spmd_torch._XLAC as _XLAC
from spmd_torch._lazy import counters
from tests.helpers import assert_close

dev = spmd_torch.device()

EQUATIONS = [
    ("...n,mn->...m", [(4, 3, 2), (5, 2)]),  # PyTorch/XLA's patched linear
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ii->i", [(3, 3)]),  # a diagonal
    ("ii", [(3, 3)]),  # implicit output: the trace
    ("ij,jkl", [(3, 4), (4, 2, 5)]),  # implicit output, alphabetical
    ("i,j->ij", [(3,), (4,)]),
    ("b...d,b...d->b...", [(2, 3, 4, 6), (2, 1, 4, 6)]),  # broadcast ellipsis
    ("ij->", [(3, 4)]),
]


@pytest.mark.parametrize("equation, shapes", EQUATIONS)
def test_einsum_is_one_op_equal_to_eager(equation, shapes):
    g = torch.Generator().manual_seed(len(equation))
    operands = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    uploaded = [t.to(dev) for t in operands]
    counters.clear()
    actual = torch.einsum(equation, *uploaded)
    assert counters.op_counters() == {"xla::einsum": 1}
    if not any(1 in s for s in shapes):  # a broadcast size-1 dimension is squeezed away
        assert "reshape" not in _XLAC._get_xla_tensors_hlo([actual])
    assert_close(actual, torch.einsum(equation, *operands))


def test_einsum_in_bfloat16_is_the_exact_sum_rounded_once():
    # Small integers: every product and partial sum is exact in float32 whatever the summation
    # order, so no CPU's vector width matters; a sum rounded to bf16 along the way would differ
    # from the exact one rounded once in 32 of the 64 results.
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-8, 9, (8, 128), generator=g).bfloat16() for _ in range(2))
    actual = torch.einsum("ik,jk->ij", a.to(dev), b.to(dev))
    assert actual.dtype == torch.bfloat16
    expected = torch.einsum("ik,jk->ij", a.double(), b.double()).bfloat16()
    assert_close(actual, expected, rtol=0, atol=0)


def test_einsum_with_gradients_takes_the_decomposition_and_matches_eager():
    g = torch.Generator().manual_seed(1)
    cpu = [torch.randn(2, 3, 4, generator=g, requires_grad=True), torch.randn(4, 5, generator=g)]
    ours = [cpu[0].detach().to(dev).requires_grad_(), cpu[1].to(dev)]
    expected = torch.einsum("bij,jk->bik", *cpu)
    counters.clear()
    actual = torch.einsum("bij,jk->bik", *ours)
    assert "xla::einsum" not in counters.op_counters()
    assert counters.op_counters()["xla::bmm"] == 1
    cotangent = torch.randn(2, 3, 5, generator=g)
    expected.backward(cotangent)
    actual.backward(cotangent.to(dev))
    assert_close(actual, expected)
    assert_close(ours[0].grad, cpu[0].grad)
