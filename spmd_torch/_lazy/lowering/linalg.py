"""Lowerings: matrix products (mm, bmm, addmm, ...), pairwise distances and the SVD.

Float32 products run at ``Precision.HIGHEST`` unless ``spmd_torch.backends.set_mat_mul_precision``
says otherwise: XLA's default on TPU/GPU rounds float32 operands to bf16 (or TF32) passes, which
drifts from PyTorch CPU's true float32 GEMM by ~1e-3 relative and breaks loss-curve parity.
bf16/fp16 products accumulate in float32 (``preferred_element_type``), as PyTorch's CPU and CUDA
GEMMs do, and round once at the end.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from spmd_torch import config

from .registry import lowers

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


@lowers(aten.vdot.default)
def _vdot(a, b):
    """Conjugates the first operand (a no-op for real dtypes)."""
    return _product(jnp.conj(a), b).astype(a.dtype)


@lowers(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def _addmm(x, a, b, beta=1, alpha=1):
    return _add_product(x, a, b, beta, alpha)


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


@lowers(aten._linalg_svd.default)
def _linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    """(U, S, Vh) as PyTorch returns them; without compute_uv, U and Vh are empty, as its meta
    kernel says. ``driver`` only picks a CUDA solver, so it is ignored."""
    if not compute_uv:
        empty = jnp.zeros((0,), A.dtype)
        return empty, jnp.linalg.svd(A, compute_uv=False), empty
    return jnp.linalg.svd(A, full_matrices=full_matrices)
