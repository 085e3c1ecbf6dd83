"""LDL^T factorization and solve against CPU's LAPACK (?sytrf/?sytrs): the same pivots (Bunch-
Kaufman's 1x1 and 2x2 blocks, LAPACK's 1-based form), factors and solutions, for symmetric,
indefinite and lower-triangle-only inputs, a zero pivot's info, batches; no CPU fallback."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
import spmd_torch.debug.metrics as met
from tests.helpers import assert_close

dev = spmd_torch.device()


def _matrices(seed: int, n: int, batch=()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, n, n, generator=g)
    return a + a.mT if seed % 2 else a  # odd seeds symmetric; even: only the lower triangle is read


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_ldl_factor_and_solve_match_lapack(seed, n):
    a = _matrices(seed, n)
    if seed % 4 == 0:
        a[0, 0] = 0.0  # forces a pivot search from the first column
    expected = torch.linalg.ldl_factor_ex(a)
    met.clear_all()
    got = torch.linalg.ldl_factor_ex(a.to(dev))
    assert torch.equal(got.pivots.cpu(), expected.pivots)
    assert torch.equal(got.info.cpu(), expected.info)
    assert_close(got.LD, expected.LD, rtol=1e-4, atol=1e-5)
    b = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
    x = torch.linalg.ldl_solve(expected.LD, expected.pivots, b)
    got_x = torch.linalg.ldl_solve(expected.LD.to(dev), expected.pivots.to(dev), b.to(dev))
    assert_close(got_x, x, rtol=1e-3, atol=1e-4)
    assert met.executed_fallback_ops() == []


def test_a_zero_column_sets_info_and_a_batch_factors_each_matrix():
    a = torch.zeros(3, 3)
    a[2, 2] = 1.0
    got = torch.linalg.ldl_factor_ex(a.to(dev))
    expected = torch.linalg.ldl_factor_ex(a)
    assert got.info.item() == expected.info.item() == 1
    assert torch.equal(got.pivots.cpu(), expected.pivots)
    batch = _matrices(1, 4, batch=(3,))
    got = torch.linalg.ldl_factor_ex(batch.to(dev))
    expected = torch.linalg.ldl_factor_ex(batch)
    assert torch.equal(got.pivots.cpu(), expected.pivots)
    assert_close(got.LD, expected.LD, rtol=1e-4, atol=1e-5)
