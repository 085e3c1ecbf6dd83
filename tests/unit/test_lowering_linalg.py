"""Matrix-product and distance lowerings against the same aten ops run eagerly on CPU torch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
import torch

from spmd_torch._lazy.lowering import LOWERINGS
from tests.helpers import assert_close
from tests.unit._lowering_harness import Traced, assert_same, case, check, lowered, named, tight

aten = torch.ops.aten
_gen = torch.Generator().manual_seed(0)


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=_gen, dtype=dtype)
    return torch.randint(-9, 10, shape, generator=_gen, dtype=dtype)


_nan_bias = torch.full((3, 5), math.nan)

CASES = [
    case(aten.mm.default, _t(3, 4), _t(4, 5), id="mm"),
    case(
        aten.mm.default, _t(3, 4, dtype=torch.float64), _t(4, 5, dtype=torch.float64), id="mm-f64"
    ),
    case(aten.mm.default, _t(3, 4, dtype=torch.int64), _t(4, 5, dtype=torch.int64), id="mm-int64"),
    case(
        aten.mm.default,
        _t(8, 64, dtype=torch.bfloat16),
        _t(64, 4, dtype=torch.bfloat16),
        id="mm-bf16",
    ),
    case(aten.bmm.default, _t(2, 3, 4), _t(2, 4, 5), id="bmm"),
    case(aten.mv.default, _t(3, 4), _t(4), id="mv"),
    case(aten.dot.default, _t(7), _t(7), id="dot"),
    case(aten.vdot.default, _t(7), _t(7), id="vdot"),
    case(aten.linear.default, _t(3, 4), _t(5, 4), id="linear"),
    case(aten.linear.default, _t(2, 3, 4), _t(5, 4), _t(5), id="linear-3d-bias"),
    case(
        aten.linear.default,
        _t(8, 64, dtype=torch.bfloat16),
        _t(4, 64, dtype=torch.bfloat16),
        id="linear-bf16",
    ),
    case(
        aten.vdot.default,
        _t(4, dtype=torch.complex64),
        _t(4, dtype=torch.complex64),
        id="vdot-complex-conjugates-first",
    ),
    case(aten.addmm.default, _t(3, 5), _t(3, 4), _t(4, 5), id="addmm"),
    case(aten.addmm.default, _t(5), _t(3, 4), _t(4, 5), id="addmm-broadcast-bias"),
    case(
        aten.addmm.default,
        _t(3, 5),
        _t(3, 4),
        _t(4, 5),
        beta=0.5,
        alpha=-2.0,
        id="addmm-beta-alpha",
    ),
    case(aten.addmm.default, _nan_bias, _t(3, 4), _t(4, 5), beta=0, id="addmm-beta0-drops-nan"),
    case(aten.addmm.default, _t(3, 5), _t(3, 4), _t(4, 5), alpha=0, id="addmm-alpha0"),
    case(
        aten.addmm.default,
        _t(5, dtype=torch.bfloat16),
        _t(3, 32, dtype=torch.bfloat16),
        _t(32, 5, dtype=torch.bfloat16),
        id="addmm-bf16",
    ),
    case(
        aten.baddbmm.default, _t(2, 3, 5), _t(2, 3, 4), _t(2, 4, 5), beta=2, alpha=3, id="baddbmm"
    ),
    case(aten.addmv.default, _t(3), _t(3, 4), _t(4), beta=0.25, id="addmv"),
    case(aten._cdist_forward.default, _t(2, 4, 3), _t(2, 5, 3), 2.0, None, id="cdist-p2"),
    case(aten._cdist_forward.default, _t(4, 3), _t(5, 3), 1.0, None, id="cdist-p1"),
    case(aten._cdist_forward.default, _t(4, 3), _t(5, 3), 0.0, None, id="cdist-p0"),
    case(aten._cdist_forward.default, _t(4, 3), _t(5, 3), math.inf, None, id="cdist-pinf"),
    case(aten._cdist_forward.default, _t(4, 3), _t(5, 3), 3.0, None, id="cdist-p3"),
    case(aten._cdist_forward.default, _t(4, 3), _t(5, 3), 0.5, None, id="cdist-p-half"),
    case(
        aten._cdist_forward.default,
        _t(30, 3),
        _t(5, 3),
        2.0,
        None,
        tol=named("cdist_mm"),
        id="cdist-p2-mm-path-over-25-rows",
    ),
    case(aten._cdist_forward.default, _t(4, 3), _t(5, 3), 2.0, 2, id="cdist-p2-mode-never-mm"),
    case(
        aten._cdist_forward.default,
        _t(4, 3),
        _t(5, 3),
        2.0,
        1,
        tol=named("cdist_mm"),
        id="cdist-p2-mode-mm",
    ),
]


@pytest.mark.parametrize("op,args,kwargs,tol", CASES)
def test_lowering_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tol or tight, **kwargs)


def _cdist_backward_case(p: float, id: str):
    x1, x2 = _t(4, 3), _t(5, 3)
    x2[1] = x1[2]  # a zero distance: PyTorch's gradient there is 0, not NaN
    dist = aten._cdist_forward(x1, x2, p, 2)
    return case(aten._cdist_backward.default, _t(4, 5), x1, x2, p, dist, id=id)


@pytest.mark.parametrize(
    "op,args,kwargs,tol",
    [
        _cdist_backward_case(2.0, "cdist_backward-p2"),
        _cdist_backward_case(1.0, "cdist_backward-p1"),
        _cdist_backward_case(0.0, "cdist_backward-p0"),
        _cdist_backward_case(math.inf, "cdist_backward-pinf"),
        _cdist_backward_case(3.0, "cdist_backward-p3"),
        _cdist_backward_case(0.5, "cdist_backward-p-half"),
    ],
)
def test_cdist_backward_matches_eager(op, args, kwargs, tol):
    check(op, *args, cast=True, tol=tight, **kwargs)


def test_addmm_traced_scalars_keep_beta0_semantics():
    """beta/alpha may arrive as traced scalars; beta == 0 must still drop a NaN input."""
    bias, a, b = _nan_bias, _t(3, 4), _t(4, 5)
    got = lowered(aten.addmm.default, bias, a, b, beta=Traced(0.0), alpha=Traced(2.0))
    assert_same(got, aten.addmm(bias, a, b, beta=0, alpha=2), tight, cast=True)


def test_mm_float32_uses_full_precision():
    """The matmul asks XLA for HIGHEST precision, so TPU/GPU do not round operands to bf16/TF32."""
    fn = LOWERINGS[aten.mm.default].fn
    text = jax.jit(fn).lower(jnp.ones((4, 4)), jnp.ones((4, 4))).as_text()
    assert "HIGHEST" in text


def test_mm_bf16_accumulates_in_float32():
    fn = LOWERINGS[aten.mm.default].fn
    a = jnp.ones((2, 4), jnp.bfloat16)
    text = jax.jit(fn).lower(a, a.T).as_text()
    assert "bf16" in text and "-> tensor<2x2xf32>" in text.replace("\n", " ")
    assert fn(a, a.T).dtype == jnp.bfloat16


def _svd_parts(A: torch.Tensor, full_matrices: bool) -> tuple:
    """S and the products that do not depend on the SVD's free signs: U^T A Vh^T and U Vh."""
    U, S, Vh = lowered(aten._linalg_svd.default, A, full_matrices)
    k = S.shape[-1]
    return S, U[..., :k].mT @ A @ Vh[..., :k, :].mT, U[..., :k] @ Vh[..., :k, :]


@pytest.mark.parametrize("full_matrices", [False, True])
@pytest.mark.parametrize("shape", [(4, 3), (3, 5), (2, 4, 4)])
def test_linalg_svd_matches_eager(shape, full_matrices):
    A = _t(*shape)
    U, S, Vh = aten._linalg_svd.default(A, full_matrices)
    got = lowered(aten._linalg_svd.default, A, full_matrices)
    assert [t.shape for t in got] == [U.shape, S.shape, Vh.shape]
    k = S.shape[-1]
    expected = (S, torch.diag_embed(S), U[..., :k] @ Vh[..., :k, :])
    assert_same(_svd_parts(A, full_matrices), expected, tight)


@pytest.mark.parametrize("batch", [(), (2,)], ids=["one", "batched"])
def test_hermitian_pinv_reads_the_lower_triangle_as_eager(batch):
    """With ``hermitian=True`` ATen takes the eigenvalues of the lower triangle (an indefinite
    one here: negative eigenvalues too), whatever the upper one holds; a zero eigenvalue stays
    out."""
    lower = torch.tril(_t(*batch, 4, 4))
    symmetric = lower + lower.mT - torch.diag_embed(lower.diagonal(dim1=-2, dim2=-1))
    eigenvalues, vectors = torch.linalg.eigh(symmetric)
    eigenvalues[..., 1] = 0  # rank-deficient
    a = vectors @ torch.diag_embed(eigenvalues) @ vectors.mT
    a = torch.tril(a) + torch.triu(_t(*batch, 4, 4), diagonal=1)  # upper: unrelated values
    expected = torch.linalg.pinv(a, hermitian=True)
    got = lowered(aten.linalg_pinv.atol_rtol_tensor, a, hermitian=True)
    assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_linalg_svd_without_uv_returns_empty_factors():
    A = _t(2, 4, 3)
    U, S, Vh = aten._linalg_svd.default(A, compute_uv=False)
    got = lowered(aten._linalg_svd.default, A, compute_uv=False)
    assert [t.shape for t in got] == [U.shape, S.shape, Vh.shape] == [(0,), (2, 3), (0,)]
    assert_same(got[1], S, tight)


_LSTSQ_SHAPES = [((5, 3), (5, 2)), ((3, 5), (3, 2)), ((2, 6, 4), (2, 6, 3)), ((5, 3), (5,))]


@pytest.mark.parametrize(
    ("driver", "a_shape", "b_shape"),
    [(driver, a, b) for driver in (None, "gelsy") for a, b in _LSTSQ_SHAPES]
    # gels needs at least as many rows as columns (LAPACK raises on CPU otherwise)
    + [("gels", a, b) for a, b in _LSTSQ_SHAPES if a[-2] >= a[-1]],
)
def test_lstsq_is_lowered_and_matches_cpu(driver, a_shape, b_shape):
    """lstsq (no meta kernel in PyTorch) runs on the device for the drivers whose result shapes
    data cannot change: solution, gels's residuals and gelsy's rank as CPU's LAPACK gives them."""
    import spmd_torch.debug.metrics as met

    g = torch.Generator().manual_seed(len(a_shape) + len(b_shape))
    a = torch.randn(a_shape, generator=g, dtype=torch.float64)
    b = torch.randn(b_shape, generator=g, dtype=torch.float64)
    expected = torch.linalg.lstsq(a, b, driver=driver)
    met.clear_all()
    got = torch.linalg.lstsq(a.float().to("xla"), b.float().to("xla"), driver=driver)
    assert met.executed_fallback_ops() == []
    assert_close(got.solution.cpu(), expected.solution.float(), rtol=1e-5, atol=1e-5)
    assert_close(got.residuals.cpu(), expected.residuals.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.rank.cpu(), expected.rank)
    assert got.singular_values.shape == expected.singular_values.shape


def test_lstsq_of_a_rank_deficient_matrix_is_the_minimum_norm_solution():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 2, generator=g, dtype=torch.float64) @ torch.randn(
        2, 4, generator=g, dtype=torch.float64
    )
    b = torch.randn(6, 2, generator=g, dtype=torch.float64)
    expected = torch.linalg.lstsq(a, b)
    got = torch.linalg.lstsq(a.float().to("xla"), b.float().to("xla"))
    assert got.rank.item() == expected.rank.item() == 2
    assert_close(got.solution.cpu(), expected.solution.float(), rtol=1e-4, atol=1e-4)
