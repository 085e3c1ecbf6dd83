"""The grouped matmuls of torch_xla.experimental.custom_kernel (gmm, tgmm, gmm_backward, GMM)
against per-group matmuls written out on CPU in float64: values, an empty group, rows past the
groups, the transposed right-hand side, gradients, and the errors for unsupported arguments."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch.experimental.custom_kernel import GMM, gmm, gmm_backward, tgmm
from tests.helpers import assert_close

dev = spmd_torch.device()
SIZES = [3, 0, 4, 2]  # an empty group; 11 rows of which 9 are in a group


def bounds() -> list[tuple[int, int]]:
    ends = torch.tensor(SIZES).cumsum(0).tolist()
    return [(end - size, end) for size, end in zip(SIZES, ends)]


def gmm_float64(lhs, rhs):
    out = torch.zeros(lhs.shape[0], rhs.shape[2], dtype=torch.float64)
    for g, (start, end) in enumerate(bounds()):
        out[start:end] = lhs[start:end].double() @ rhs[g].double()
    return out


def tgmm_float64(lhs, rhs):
    return torch.stack([lhs[:, s:e].double() @ rhs[s:e].double() for s, e in bounds()])


def inputs(m=11, k=5, n=6):
    torch.manual_seed(0)
    sizes = torch.tensor(SIZES, dtype=torch.int32)
    return torch.randn(m, k), torch.randn(len(SIZES), k, n), sizes


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_multiplies_each_groups_rows_by_its_matrix(transpose_rhs):
    lhs, rhs, sizes = inputs()
    given = rhs.transpose(1, 2).contiguous() if transpose_rhs else rhs
    out = gmm(lhs.to(dev), given.to(dev), sizes.to(dev), transpose_rhs=transpose_rhs)
    assert out.dtype == torch.float32 and tuple(out.shape) == (11, 6)
    assert_close(out.cpu(), gmm_float64(lhs, rhs).float())
    assert torch.count_nonzero(out.cpu()[9:]) == 0  # rows in no group


def test_tgmm_multiplies_each_groups_columns_by_its_rows():
    lhs, rhs = torch.randn(5, 11), torch.randn(11, 6)
    out = tgmm(lhs.to(dev), rhs.to(dev), torch.tensor(SIZES, dtype=torch.int32).to(dev))
    assert tuple(out.shape) == (len(SIZES), 5, 6)
    assert_close(out.cpu(), tgmm_float64(lhs, rhs).float())
    assert torch.count_nonzero(out.cpu()[1]) == 0  # the empty group


def test_gmm_through_autograd_equals_eager_gradients():
    lhs, rhs, sizes = inputs()
    weight = torch.randn(11, 6)
    ours = [t.to(dev).requires_grad_() for t in (lhs, rhs)]
    (GMM.apply(*ours, sizes.to(dev)) * weight.to(dev)).sum().backward()
    theirs = [t.double().requires_grad_() for t in (lhs, rhs)]
    (gmm_float64(*theirs) * weight.double()).sum().backward()
    for got, want in zip(ours, theirs):
        assert_close(got.grad.cpu(), want.grad.float(), kind="grad")
    grad_lhs, grad_rhs = gmm_backward(weight.to(dev), *(t.to(dev) for t in (lhs, rhs, sizes)))
    assert_close(grad_lhs.cpu(), theirs[0].grad.float(), kind="grad")
    assert_close(grad_rhs.cpu(), theirs[1].grad.float(), kind="grad")


def test_grouped_matmuls_name_what_they_do_not_take():
    lhs, rhs, sizes = (t.to(dev) for t in inputs())
    with pytest.raises(NotImplementedError, match="gmm: group_offset"):
        gmm(lhs, rhs, sizes, group_offset=torch.zeros(1, dtype=torch.int32, device=dev))
    with pytest.raises(
        ValueError, match="gmm: group_sizes must be a 1-d int32 tensor, got torch.int64"
    ):
        gmm(lhs, rhs, sizes.long())
    with pytest.raises(
        ValueError, match=r"gmm: lhs \(11, 5\), rhs \(4, 5, 6\) \(transpose_rhs=True\)"
    ):
        gmm(lhs, rhs, sizes, transpose_rhs=True)
    with pytest.raises(ValueError, match=r"tgmm: lhs must be \[k, m\] and rhs \[m, n\]"):
        tgmm(lhs, lhs, sizes)
