"""Lowerings: the LDL^T factorization of a symmetric matrix and its solve (``torch.linalg.ldl_*``).

LAPACK's own algorithms (``?sytf2`` and ``?sytrs``, lower triangle), step for step, so the
factors and pivots are LAPACK's: Bunch-Kaufman diagonal pivoting, a 1x1 or 2x2 pivot block per
step chosen from the column and row maxima, interchanges applied to the trailing matrix only,
pivots in LAPACK's 1-based form (negative for a 2x2 block). Each step is a ``lax.while_loop``
iteration over the whole matrix with masks, since the block size is known only from the data.
The trailing matrix is kept symmetric from its lower triangle, the only part LAPACK reads.
Real matrices only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .registry import lowers

aten = torch.ops.aten

_ALPHA = (1 + math.sqrt(17)) / 8  # Bunch-Kaufman's growth bound


def _symmetric(m):
    """``m``'s lower triangle mirrored into its upper one."""
    return jnp.tril(m) + jnp.tril(m, -1).T


def _factor(a):
    """One (n, n) matrix's (LD, pivots, info), as ?sytrf with uplo='L' gives them."""
    n = a.shape[-1]
    if n == 0:
        return a, jnp.zeros(0, jnp.int32), jnp.int32(0)
    idx = jnp.arange(n)

    def step(state):
        m, pivots, k, info = state
        column = jnp.abs(m[:, k])
        below = idx > k
        colmax = jnp.max(jnp.where(below, column, 0))
        imax = jnp.argmax(jnp.where(below, column, -1))
        absakk = column[k]
        rowmax = jnp.max(jnp.where((idx >= k) & (idx != imax), jnp.abs(m[imax]), 0))
        zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        keep_k = zero | (absakk >= _ALPHA * colmax)
        keep_k |= absakk >= _ALPHA * colmax * (colmax / rowmax)
        one_by_one = keep_k | (jnp.abs(m[imax, imax]) >= _ALPHA * rowmax)
        kp = jnp.where(keep_k, k, imax)
        kk = jnp.where(one_by_one, k, k + 1)
        # interchange rows and columns kk and kp of the trailing matrix
        perm = idx.at[kk].set(kp).at[kp].set(kk)
        trailing = (idx[:, None] >= k) & (idx[None, :] >= k)
        m = jnp.where(trailing, m[perm][:, perm], m)
        updated = jnp.where(one_by_one, _one_by_one(m, k, idx), _two_by_two(m, k, idx))
        m = jnp.where(zero, m, updated)
        pivot = jnp.where(one_by_one, kp + 1, -(kp + 1)).astype(jnp.int32)
        pivots = jnp.where((idx == k) | ((idx == k + 1) & ~one_by_one), pivot, pivots)
        info = jnp.where((info == 0) & zero, k + 1, info)
        return m, pivots, k + jnp.where(one_by_one, 1, 2), info

    state = (_symmetric(a), jnp.zeros(n, jnp.int32), jnp.int32(0), jnp.int32(0))
    m, pivots, _, info = lax.while_loop(lambda s: s[2] < n, step, state)
    return jnp.tril(m), pivots, info


def _one_by_one(m, k, idx):
    """Eliminate column k with the pivot m[k, k]: a rank-1 update (?syr) and the scaled column."""
    d11 = 1 / m[k, k]
    x = jnp.where(idx > k, m[:, k], 0)
    rest = (idx[:, None] > k) & (idx[None, :] > k)
    m = jnp.where(rest, m + x[:, None] * (-d11 * x)[None, :], m)
    m = jnp.where(rest, _symmetric(m), m)
    return m.at[:, k].set(jnp.where(idx > k, d11 * m[:, k], m[:, k]))


def _two_by_two(m, k, idx):
    """Eliminate columns k and k+1 with the 2x2 pivot block, as ?sytf2 writes the update."""
    d21 = m[k + 1, k]
    d11 = m[k + 1, k + 1] / d21
    d22 = m[k, k] / d21
    d21 = (1 / (d11 * d22 - 1)) / d21
    below = idx >= k + 2
    ck, ck1 = jnp.where(below, m[:, k], 0), jnp.where(below, m[:, k + 1], 0)
    wk = d21 * (d11 * ck - ck1)
    wkp1 = d21 * (d22 * ck1 - ck)
    rest = below[:, None] & below[None, :]
    m = jnp.where(rest, m - ck[:, None] * wk[None, :] - ck1[:, None] * wkp1[None, :], m)
    m = jnp.where(rest, _symmetric(m), m)
    m = m.at[:, k].set(jnp.where(below, wk, m[:, k]))
    return m.at[:, k + 1].set(jnp.where(below, wkp1, m[:, k + 1]))


def _swap_rows(b, i, j):
    rows = jnp.arange(b.shape[0])
    return b[rows.at[i].set(j).at[j].set(i)]


def _solve(ld, pivots, b):
    """x with A x = b for one factored matrix, as ?sytrs (lower) computes it: L D y = b forward,
    then L^T x = y backward, interchanges applied on the way."""
    n = ld.shape[-1]
    if n == 0:
        return b
    idx = jnp.arange(n)

    def forward(state):
        b, k = state
        p = pivots[k]
        one = p > 0
        b = _swap_rows(b, jnp.where(one, k, k + 1), jnp.where(one, p, -p) - 1)
        # 1x1 block
        first = b - jnp.where((idx > k)[:, None], ld[:, k][:, None] * b[k], 0)
        first = first.at[k].set(first[k] * (1 / ld[k, k]))
        # 2x2 block
        below = (idx >= k + 2)[:, None]
        second = b - jnp.where(below, ld[:, k][:, None] * b[k], 0)
        second = second - jnp.where(below, ld[:, k + 1][:, None] * b[k + 1], 0)
        akm1k = ld[k + 1, k]
        akm1, ak = ld[k, k] / akm1k, ld[k + 1, k + 1] / akm1k
        denominator = akm1 * ak - 1
        bkm1, bk = second[k] / akm1k, second[k + 1] / akm1k
        second = second.at[k].set((ak * bkm1 - bk) / denominator)
        second = second.at[k + 1].set((akm1 * bk - bkm1) / denominator)
        return jnp.where(one, first, second), k + jnp.where(one, 1, 2)

    def backward(state):
        b, k = state
        p = pivots[k]
        one = p > 0
        after = (idx > k)[:, None]
        b = b.at[k].add(-jnp.sum(jnp.where(after, ld[:, k][:, None] * b, 0), axis=0))
        two = b.at[k - 1].add(-jnp.sum(jnp.where(after, ld[:, k - 1][:, None] * b, 0), axis=0))
        b = jnp.where(one, b, two)
        b = _swap_rows(b, k, jnp.where(one, p, -p) - 1)
        return b, k - jnp.where(one, 1, 2)

    b, _ = lax.while_loop(lambda s: s[1] < n, forward, (b, jnp.int32(0)))
    b, _ = lax.while_loop(lambda s: s[1] >= 0, backward, (b, jnp.int32(n - 1)))
    return b


def _batched(fn, *arrays, core_dims: tuple):
    """``fn`` over the arrays' leading (batch) dimensions, each array with ``core_dims`` more."""
    for _ in range(arrays[0].ndim - core_dims[0]):
        fn = jax.vmap(fn)
    return fn(*arrays)


def _real(a, api: str) -> None:
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        raise NotImplementedError(f"{api} of complex matrices is not lowered ({a.dtype})")


@lowers(aten.linalg_ldl_factor_ex.default)
def _linalg_ldl_factor_ex(a, *, hermitian=False, check_errors=False):
    _real(a, "linalg.ldl_factor")
    return _batched(_factor, a, core_dims=(2,))


@lowers(aten.linalg_ldl_solve.default)
def _linalg_ldl_solve(ld, pivots, b, *, hermitian=False):
    _real(ld, "linalg.ldl_solve")
    batch = jnp.broadcast_shapes(ld.shape[:-2], b.shape[:-2])
    ld = jnp.broadcast_to(ld, batch + ld.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    return _batched(_solve, ld, pivots.astype(jnp.int32), b, core_dims=(2, 1, 2))
