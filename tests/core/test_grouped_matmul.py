"""The grouped matmuls of torch_xla.experimental.custom_kernel (gmm, tgmm, gmm_backward, GMM)
against per-group matmuls written out on CPU in float64: values, an empty group, rows past the
groups, the transposed right-hand side, gradients, a window of groups (``group_offset``, experts
sharded over devices), and the errors for arguments that do not fit."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch.experimental.custom_kernel import GMM, gmm, gmm_backward, tgmm
from tests.helpers import assert_close, assert_compiles

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


@pytest.mark.parametrize("offset", [2, 3])
def test_gmm_from_a_group_offset_computes_the_rows_of_its_groups_only(offset):
    """``rhs`` holds two groups' matrices from ``group_offset`` on (group 4 does not exist: it
    counts as empty); every other row is zero, an infinite one before the window too."""
    lhs, rhs, sizes = inputs()
    lhs[0] = float("inf")
    window = torch.randn(2, 5, 6)
    full = torch.zeros(len(SIZES), 5, 6)
    present = min(2, len(SIZES) - offset)
    full[offset : offset + present] = window[:present]
    want = gmm_float64(lhs, full).float()
    start, end = bounds()[offset][0], bounds()[offset + present - 1][1]
    want[:start], want[end:] = 0, 0
    group_offset = torch.tensor(offset, dtype=torch.int32).to(dev)
    out = gmm(lhs.to(dev), window.to(dev), sizes.to(dev), group_offset=group_offset)
    assert tuple(out.shape) == (11, 6)
    assert_close(out.cpu(), want)


def test_gmm_reads_its_group_offset_from_the_device_without_recompiling():
    lhs, rhs, sizes = (t.to(dev) for t in inputs())
    first = gmm(lhs, rhs[:2], sizes, group_offset=0).cpu()
    with assert_compiles(1):  # the offset is a value of the program, not part of it
        second = gmm(lhs, rhs[:2], sizes, group_offset=torch.tensor(2, dtype=torch.int32).to(dev))
        third = gmm(lhs, rhs[:2], sizes, group_offset=torch.tensor(1, dtype=torch.int32).to(dev))
        second, third = second.cpu(), third.cpu()
    want = gmm_float64(lhs.cpu(), torch.cat([rhs.cpu()[:2], torch.zeros(2, 5, 6)])).float()
    assert_close(first, want)
    assert torch.count_nonzero(second[:3]) == 0 and torch.count_nonzero(second[3:9]) > 0
    assert torch.count_nonzero(third[:3]) == 0 and torch.count_nonzero(third[7:]) == 0


def test_tgmm_computes_num_actual_groups_from_the_group_offset():
    lhs, rhs = torch.randn(5, 11), torch.randn(11, 6)
    sizes = torch.tensor(SIZES, dtype=torch.int32).to(dev)
    every = tgmm_float64(lhs, rhs).float()
    offset = torch.tensor(2, dtype=torch.int32).to(dev)
    out = tgmm(lhs.to(dev), rhs.to(dev), sizes, group_offset=offset, num_actual_groups=2)
    assert tuple(out.shape) == (2, 5, 6)
    assert_close(out.cpu(), every[2:])
    first_two = tgmm(lhs.to(dev), rhs.to(dev), sizes, num_actual_groups=2)
    assert_close(first_two.cpu(), every[:2])
    past_the_end = tgmm(lhs.to(dev), rhs.to(dev), sizes, group_offset=3, num_actual_groups=2)
    assert_close(past_the_end.cpu(), torch.stack([every[3], torch.zeros(5, 6)]))


def test_grouped_matmuls_name_the_argument_that_does_not_fit():
    lhs, rhs, sizes = (t.to(dev) for t in inputs())
    with pytest.raises(
        ValueError, match=r"gmm: group_offset must be one int32 value, got torch.int64"
    ):
        gmm(lhs, rhs[:2], sizes, group_offset=torch.zeros((), dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match=r"gmm: lhs \(11, 5\), rhs \(8, 5, 6\)"):
        gmm(lhs, torch.cat([rhs, rhs]), sizes, group_offset=0)
    with pytest.raises(ValueError, match="tgmm: num_actual_groups must be an int >= 0, got -1"):
        tgmm(lhs.t(), lhs, sizes, num_actual_groups=-1)
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
