"""Lowerings: matrix products (mm, bmm, addmm, ...), pairwise distances and the SVD.

Float32 products run at ``Precision.HIGHEST`` unless ``spmd_torch.backends.set_mat_mul_precision``
says otherwise: XLA's default on TPU/GPU rounds float32 operands to bf16 (or TF32) passes, which
drifts from PyTorch CPU's true float32 GEMM by ~1e-3 relative and breaks loss-curve parity.
bf16/fp16 products accumulate in float32 (``preferred_element_type``), as PyTorch's CPU and CUDA
GEMMs do, and round once at the end.
"""

from __future__ import annotations

import math
import string
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from spmd_torch import config

from ._helpers import traced_once
from .registry import lowers, meta_kernel

aten = torch.ops.aten

PRECISION = jax.lax.Precision.HIGHEST  # internal arithmetic written as products (pooling weights)
_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype: object) -> object:
    """float32 for bf16/fp16 (PyTorch's opmath type), else None: accumulate in the input dtype."""
    return jnp.float32 if jnp.dtype(dtype) in _LOW_PRECISION else None


def precision() -> jax.lax.Precision:
    """User matmuls' precision, read when the program is traced (it is in the compile-cache key)."""
    return jax.lax.Precision(config.MAT_MUL_PRECISION.value)


def _product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with PyTorch CPU precision, still in the accumulation dtype (see module docstring)."""
    return jnp.matmul(
        a, b, precision=precision(), preferred_element_type=accumulation_dtype(a.dtype)
    )


def _scaled(x: jax.Array, s: object) -> jax.Array:
    """s * x where s == 0 drops x entirely, NaN and inf included, as BLAS beta=0 does in PyTorch."""
    if isinstance(s, (int, float)):
        return x if s == 1 else jnp.zeros_like(x) if s == 0 else x * s
    return jnp.where(s == 0, jnp.zeros_like(x), x * s)


def _add_product(x, a, b, beta, alpha):
    """beta * x + alpha * (a @ b), summed in the accumulation dtype and rounded once."""
    prod = _product(a, b)
    return (_scaled(x.astype(prod.dtype), beta) + _scaled(prod, alpha)).astype(a.dtype)


@lowers(aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default)
def _mm(a, b):
    return _product(a, b).astype(a.dtype)


@lowers(aten.linear.default)
def _linear(x, w, bias=None):
    """x @ w.T contracting w's dim 1 directly: no transpose between a weight and its matmul."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    out = jax.lax.dot_general(
        x, w, dims, precision=precision(), preferred_element_type=accumulation_dtype(x.dtype)
    )
    if bias is not None:
        out = out + bias.astype(out.dtype)
    return out.astype(x.dtype)


@lowers(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """nn.functional.bilinear's kernel as one einsum: each operand has a subscript for every axis
    but those its ``expand`` list names (where ATen unsqueezes it); ``sumdim``'s are summed out."""
    total = i1.ndim + len(expand1)
    letters = string.ascii_letters[:total]

    def subscripts(skipped):
        skipped = {d % total for d in skipped}
        return "".join(c for d, c in enumerate(letters) if d not in skipped)

    spec = ",".join(subscripts(e) for e in (expand1, expand2, expand3)) + "->" + subscripts(sumdim)
    out = jnp.einsum(
        spec, i1, i2, i3, precision=precision(), preferred_element_type=accumulation_dtype(i1.dtype)
    )
    return out.astype(i1.dtype)


@lowers(aten.einsum.default)
@traced_once  # jnp.einsum plans its contraction in Python at every call: about 1 ms
def _einsum(equation, operands, path=None):
    """One dot_general per contraction, every operand's dimensions kept: ATen's decomposition
    flattens them into a bmm, and the reshapes hide sharded batch dimensions from the
    partitioner (the reason PyTorch/XLA's patched linear is written with einsum)."""
    out = jnp.einsum(
        equation,
        *operands,
        precision=precision(),
        preferred_element_type=accumulation_dtype(operands[0].dtype),
    )
    return out.astype(operands[0].dtype)


@lowers(aten.vdot.default)
def _vdot(a, b):
    """Conjugates the first operand (a no-op for real dtypes)."""
    return _product(jnp.conj(a), b).astype(a.dtype)


@lowers(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def _addmm(x, a, b, beta=1, alpha=1):
    return _add_product(x, a, b, beta, alpha)


@lowers(aten.addr.default)
def _addr(x, a, b, *, beta=1, alpha=1):
    """The outer product is a product with a contraction of length 1."""
    return _add_product(
        jnp.broadcast_to(x, (a.shape[0], b.shape[0])), a[:, None], b[None], beta, alpha
    )


@lowers(aten.addbmm.default)
def _addbmm(x, a, b, *, beta=1, alpha=1):
    """The batch is one more contracted dim: (n, m) by (m, p) per batch, summed over batches."""
    a = jnp.swapaxes(a, 0, 1).reshape(a.shape[1], -1)
    return _add_product(x, a, b.reshape(-1, b.shape[-1]), beta, alpha)


def _cdist_uses_mm(x1, x2, p, compute_mode):
    """PyTorch's rule for the p=2 GEMM path: mode 1, or mode None with more than 25 rows."""
    if p != 2:
        return False
    return compute_mode == 1 or (compute_mode is None and max(x1.shape[-2], x2.shape[-2]) > 25)


@lowers(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode):
    """Pairwise p-norm distances; p=2 uses the GEMM form |a|^2 - 2ab + |b|^2 where PyTorch does."""
    if _cdist_uses_mm(x1, x2, p, compute_mode):
        sq = (x1 * x1).sum(-1)[..., :, None] + (x2 * x2).sum(-1)[..., None, :]
        return jnp.sqrt(jnp.maximum(sq - 2 * _product(x1, jnp.swapaxes(x2, -1, -2)), 0))
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return (diff != 0).sum(-1).astype(x1.dtype)
    if math.isinf(p):
        return diff.max(-1)
    return (diff**p).sum(-1) ** (1 / p)


@lowers(aten._cdist_backward.default)
def _cdist_backward(grad, x1, x2, p, cdist):
    """Gradient w.r.t. x1 (autograd swaps the operands for x2); zero where a distance is zero."""
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    dist = cdist[..., None]
    if p == 0:
        return jnp.zeros_like(x1)
    if p == 1:
        coef = jnp.sign(diff)
    elif p == 2:
        coef = diff / dist
    elif math.isinf(p):
        coef = jnp.sign(diff) * (jnp.abs(diff) == dist)
    else:
        coef = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / dist ** (p - 1)
    coef = jnp.where((dist == 0) | (diff == 0), 0, coef)
    return (grad[..., None] * coef).sum(-2)


@lowers(aten._pdist_forward.default)
def _pdist_forward(x, p=2.0):
    """The rows' cdist with themselves (never by GEMM, as ATen's pdist), upper triangle."""
    i, j = np.triu_indices(x.shape[0], 1)
    return _cdist_forward(x, x, p, compute_mode=2)[i, j]


@lowers(aten._pdist_backward.default)
def _pdist_backward(grad, x, p, pdist):
    """cdist's backward with the pairs' gradients and distances as symmetric matrices: pair
    (i, j) gives x_j the opposite of what it gives x_i, the distance's gradient being odd."""
    n = x.shape[0]
    i, j = np.triu_indices(n, 1)

    def symmetric(v):
        return jnp.zeros((n, n), v.dtype).at[i, j].set(v).at[j, i].set(v)

    return _cdist_backward(symmetric(grad), x, x, p, symmetric(pdist))


@lowers(aten._linalg_svd.default)
def _linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    """(U, S, Vh) as PyTorch returns them; without compute_uv, U and Vh are empty, as its meta
    kernel says. ``driver`` only picks a CUDA solver, so it is ignored."""
    if not compute_uv:
        empty = jnp.zeros((0,), A.dtype)
        return empty, jnp.linalg.svd(A, compute_uv=False), empty
    return jnp.linalg.svd(A, full_matrices=full_matrices)


# --- factorizations and solves: LAPACK's conventions (1-based int32 pivots, ``info`` codes) ----


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x))


def _batched(a, b):
    """a and b with their batch dims broadcast together, as linalg's solves broadcast them."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _tri_solve(a, b, *, lower, left=True, unit=False):
    """op(a) x = b (or x a = b) for triangular ``a``, batch dims broadcast."""
    a, b = _batched(a, b)
    return lax.linalg.triangular_solve(
        a, b, left_side=left, lower=lower, unit_diagonal=unit, transpose_a=False
    )


def _first_zero(diagonal):
    """LAPACK's ``info``: the 1-based position of the first zero (or non-finite) pivot, else 0."""
    bad = (diagonal == 0) | ~jnp.isfinite(diagonal)
    if not diagonal.shape[-1]:
        return jnp.zeros(diagonal.shape[:-1], jnp.int32)
    return jnp.where(bad.any(-1), jnp.argmax(bad, -1) + 1, 0).astype(jnp.int32)


def _lu(a):
    """(LU, 1-based pivots, info) of a square or rectangular batch."""
    lu, pivots, _ = lax.linalg.lu(a)
    return lu, pivots + 1, _first_zero(jnp.diagonal(lu, axis1=-2, axis2=-1))


def _permutation(pivots, rows):
    """The permutation the 1-based sequential row swaps ``pivots`` apply."""
    return lax.linalg.lu_pivots_to_permutation(pivots - 1, rows)


def _lu_solve(lu, pivots, b, adjoint=False):
    """a x = b (a^H x = b with ``adjoint``) from a's LU factors."""
    lu, b = _batched(lu, b)
    perm = _permutation(pivots, lu.shape[-1])
    if adjoint:
        y = _tri_solve(_mH(lu), b, lower=True)
        z = _tri_solve(_mH(lu), y, lower=False, unit=True)
        return jnp.zeros_like(z).at[..., perm, :].set(z) if z.ndim == 2 else _unpermute(z, perm)
    rows = jnp.take_along_axis(b, jnp.broadcast_to(perm[..., :, None], b.shape), -2)
    return _tri_solve(lu, _tri_solve(lu, rows, lower=True, unit=True), lower=False)


def _unpermute(z, perm):
    """x with x[perm] = z, batched."""
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, jnp.broadcast_to(inverse[..., :, None], z.shape), -2)


@lowers(aten.linalg_lu_factor_ex.default)
def _linalg_lu_factor_ex(a, pivot=True, check_errors=False):
    return _lu(a)


@lowers(aten.linalg_lu_solve.default)
def _linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    """x a = b is a^H x^H = b^H: the right-hand form flips ``adjoint`` and conjugates."""
    if left:
        return _lu_solve(lu, pivots, b, adjoint)
    return _mH(_lu_solve(lu, pivots, _mH(b), not adjoint))


@lowers(aten.lu_unpack.default)
def _lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    """(P, L, U) with a = P L U; what is not unpacked is empty, as ATen returns it."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    empty = jnp.zeros((0,), lu.dtype)
    if unpack_data:
        lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        upper = jnp.triu(lu[..., :k, :])
    else:
        lower = upper = empty
    if not unpack_pivots:
        return empty, lower, upper
    perm = _permutation(pivots, m)
    return jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2), lower, upper


@lowers(aten.linalg_lu.default)
def _linalg_lu(a, pivot=True):
    lu, pivots, _ = _lu(a)
    return _lu_unpack(lu, pivots)


@lowers(aten.linalg_inv_ex.default)
def _linalg_inv_ex(a, check_errors=False):
    """The inverse and LAPACK's info (i > 0: the i-th pivot is zero, the matrix is singular)."""
    lu, pivots, info = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, pivots, eye), info


@lowers(aten._linalg_solve_ex.default)
def _linalg_solve_ex(a, b, *, left=True, check_errors=False):
    """(x, LU, pivots, info); a 1-D ``b`` is a vector when its size matches, as ATen decides."""
    lu, pivots, info = _lu(a)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    rhs = b[..., None] if vector else b
    x = _linalg_lu_solve(lu, pivots, rhs, left=left)
    return (x[..., 0] if vector else x), lu, pivots, info


def _parity(pivots):
    """+1 or -1: the sign of the permutation made by the row swaps ``pivots``."""
    swaps = (pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype)).sum(-1)
    return 1 - 2 * (swaps % 2)


def _lu_as_aten_keeps(a):
    """a's LU factors (LU, pivots, info) as ATen's det and slogdet keep them for their backward:
    of a's transpose for a real a, whose backward then solves with ``adjoint=False``. ATen
    factors a contiguous real matrix transposed (det(a^T) = det(a)), and an xla tensor always
    reports being contiguous."""
    return _lu(a if jnp.iscomplexobj(a) else jnp.swapaxes(a, -1, -2))


@lowers(aten._linalg_det.default)
def _linalg_det(a):
    lu, pivots, _ = _lu_as_aten_keeps(a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return _parity(pivots).astype(a.dtype) * jnp.prod(diagonal, -1), lu, pivots


@lowers(aten._linalg_slogdet.default)
def _linalg_slogdet(a):
    """(sign, log|det|, LU, pivots); a singular matrix gives sign 0 and -inf."""
    lu, pivots, _ = _lu_as_aten_keeps(a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    magnitude = jnp.abs(diagonal)
    unit = jnp.where(magnitude == 0, 0, diagonal / jnp.where(magnitude == 0, 1, magnitude))
    sign = _parity(pivots).astype(a.dtype) * jnp.prod(unit, -1)
    return sign, jnp.log(magnitude).sum(-1), lu, pivots


@lowers(aten.linalg_cholesky_ex.default)
def _linalg_cholesky_ex(a, upper=False, check_errors=False):
    """(L, info): info i > 0 says the leading minor of order i is not positive-definite."""
    lower = jnp.linalg.cholesky(a, symmetrize_input=False)
    info = _first_zero(jnp.diagonal(lower, axis1=-2, axis2=-1))
    return (_mH(lower) if upper else lower), info


@lowers(aten.cholesky.default)
def _cholesky(a, upper=False):
    lower = jnp.linalg.cholesky(a, symmetrize_input=False)
    return _mH(lower) if upper else lower


def _cholesky_solve(b, factor, upper):
    """a x = b with a = L L^H (= U^H U with ``upper``)."""
    lower = _mH(factor) if upper else factor
    return _tri_solve(_mH(lower), _tri_solve(lower, b, lower=True), lower=False)


@lowers(aten.cholesky_solve.default)
def _cholesky_solve_lowering(b, factor, upper=False):
    return _cholesky_solve(b, factor, upper)


@lowers(aten.cholesky_inverse.default)
def _cholesky_inverse(factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return _cholesky_solve(eye, factor, upper)


@lowers(aten.linalg_solve_triangular.default)
def _linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    return _tri_solve(a, b, lower=not upper, left=left, unit=unitriangular)


@lowers(aten.triangular_solve.default)
def _triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    """(x, a) with op(a) x = b; op is the transpose with ``transpose``."""
    triangle = _mT(a) if transpose else a
    x = _tri_solve(triangle, b, lower=upper == transpose, unit=unitriangular)
    return x, a


@lowers(aten.linalg_qr.default)
def _linalg_qr(a, mode="reduced"):
    """mode 'r' returns an empty Q, as ATen does."""
    if mode == "r":
        return jnp.zeros((0,), a.dtype), jnp.linalg.qr(a, mode="r")
    return jnp.linalg.qr(a, mode=mode)


@meta_kernel("geqrf")
def _geqrf_shapes(a):
    """geqrf's results: the reflectors and R packed in ``a``'s shape, and min(m, n) scales."""
    return torch.empty_like(a), a.new_empty((*a.shape[:-2], min(a.shape[-2:])))


@lowers(aten.geqrf.default)
def _geqrf(a):
    """LAPACK's geqrf (numpy's ``qr(mode='raw')``, which returns the packed matrix transposed)."""
    packed, tau = jnp.linalg.qr(a, mode="raw")
    return jnp.swapaxes(packed, -1, -2), tau


@lowers(aten.linalg_householder_product.default)
def _linalg_householder_product(a, tau):
    return lax.linalg.householder_product(a, tau)


@lowers(aten.ormqr.default)
def _ormqr(a, tau, other, left=True, transpose=False):
    """other multiplied by geqrf's Q (or Q^T), from the left or the right."""
    return lax.linalg.ormqr(a, tau, other, left=left, transpose=transpose)


@lowers(aten._linalg_eigh.default)
def _linalg_eigh(a, UPLO="L", compute_v=True):
    """Reads only the ``UPLO`` triangle; without compute_v the vectors are empty."""
    values, vectors = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    return values, (vectors if compute_v else jnp.zeros((0,), a.dtype))


@lowers(aten.linalg_eig.default)
def _linalg_eig(a):
    """Complex eigenvalues and unit eigenvectors (LAPACK's geev, as PyTorch's CPU kernel)."""
    return jnp.linalg.eig(a)


@lowers(aten.linalg_matrix_exp.default)
def _linalg_matrix_exp(a):
    return jax.scipy.linalg.expm(a)


@lowers(aten.linalg_pinv.atol_rtol_tensor)
def _linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    """Singular values at most max(atol, rtol * largest) count as zero; rtol defaults to
    eps * max(m, n), or to 0 when only a positive atol is given (ATen's rule). ``hermitian``
    reads the lower triangle only, through its eigenvalues (their magnitudes are the singular
    values), as ATen does."""
    if hermitian:
        s, u = jnp.linalg.eigh(a, UPLO="L", symmetrize_input=False)
        vh = _mH(u) * jnp.sign(s)[..., :, None]  # a = u diag(|s|) (sign(s) u^H)
        s = jnp.abs(s)
    else:
        u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    largest = jnp.max(s, axis=-1, keepdims=True, initial=0)  # magnitudes: 0 for no values
    if rtol is None:
        eps = jnp.finfo(s.dtype).eps * max(a.shape[-2:])
        rtol = eps if atol is None else jnp.where(atol > 0, 0.0, eps)
    rtol = jnp.asarray(rtol)[..., None]
    cutoff = (
        rtol * largest
        if atol is None
        else jnp.maximum(jnp.asarray(atol)[..., None], rtol * largest)
    )
    inverse = jnp.where(s > cutoff, 1 / jnp.where(s > cutoff, s, 1), 0).astype(a.dtype)
    return _mH(vh) @ (inverse[..., :, None] * _mH(u))


@meta_kernel("linalg_lstsq")
def _lstsq_shapes(a, b, rcond=None, *, driver=None):
    """lstsq's results for the drivers whose shapes data cannot change: gelsy (CPU's default) and
    gels; gelsd and gelss give residuals only for a full-rank ``a``, so they run on the CPU."""
    driver = driver or "gelsy"
    if driver not in ("gelsy", "gels"):
        raise DynamicOutputShapeException(aten.linalg_lstsq.default)
    (m, n), vector = a.shape[-2:], b.dim() == a.dim() - 1
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[: -1 if vector else -2])
    columns = () if vector else (b.shape[-1],)
    solution = a.new_empty(batch + (n,) + columns)
    residuals = a.new_empty(batch + (columns or (1,)) if driver == "gels" and m > n else (0,))
    rank = a.new_empty(batch if driver == "gelsy" else (0,), dtype=torch.int64)
    return solution, residuals, rank, a.new_empty((0,))


@lowers(aten.linalg_lstsq.default)
def _linalg_lstsq(a, b, rcond=None, *, driver=None):
    """The minimum-norm least-squares solution through the SVD, singular values at most
    rcond * largest (default eps * max(m, n)) counted as zero, as gelsy's rank decides; gels
    (full rank assumed) adds the squared residuals when there are more rows than columns."""
    driver = driver or "gelsy"
    (m, n), vector = a.shape[-2:], b.ndim == a.ndim - 1
    b = b[..., None] if vector else b
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    rcond = jnp.finfo(s.dtype).eps * max(m, n) if rcond is None or rcond < 0 else rcond
    kept = s > rcond * s[..., :1]
    inverse = jnp.where(kept, 1 / jnp.where(kept, s, 1), 0).astype(a.dtype)
    product = partial(jnp.matmul, precision=PRECISION)
    solution = product(_mH(vh), inverse[..., :, None] * product(_mH(u), b))
    residuals = jnp.zeros((0,), a.dtype)
    if driver == "gels" and m > n:
        residuals = jnp.sum(jnp.abs(product(a, solution) - b) ** 2, axis=-2).astype(a.dtype)
    rank = kept.sum(-1) if driver == "gelsy" else jnp.zeros((0,), jnp.int64)
    solution = solution[..., 0] if vector else solution
    return solution, residuals, rank.astype(jnp.int64), jnp.zeros((0,), s.dtype)


@lowers(aten.linalg_cross.default)
def _linalg_cross(a, b, *, dim=-1):
    a, b = jnp.broadcast_arrays(a, b)
    return jnp.cross(a, b, axis=dim)
