"""Lowerings: elementwise ops, with PyTorch's type promotion, rounding, sign and NaN rules.

Most ops are table rows behind an adapter from ``_helpers``: ``floating`` (integer inputs compute
in the default float), ``arithmetic`` (integer stays integer) or ``promoted`` (exact ops). Both of
the first two compute bfloat16/float16 in float32 and round once, as ATen's opmath kernels do.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ._helpers import arithmetic, category, float_dtype, floating, opmath, promoted
from .dtypes import to_jax_dtype
from .registry import lowers, register_table

aten = torch.ops.aten


def _sign(x):
    """ATen's (0 < x) - (x < 0): NaN and -0.0 give 0 (jnp.sign keeps NaN); bool is itself."""
    if x.dtype == jnp.bool_:
        return x
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def _sgn(x):
    """Complex: x / |x| (0 at 0; NaN where an infinite part makes |x| infinite), as ATen's."""
    if not jnp.iscomplexobj(x):
        return _sign(x)
    magnitude = jnp.abs(x)
    return jnp.where(magnitude == 0, 0, x / jnp.where(magnitude == 0, 1, magnitude))


def _nan_to_num(x, nan=None, posinf=None, neginf=None):
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


def _to_copy(x, *, dtype=None, **_):
    """Only the dtype matters on the device: layout, device and memory format are no-ops here."""
    return x if dtype is None else x.astype(to_jax_dtype(dtype))


def _masked_fill(x, mask, value):
    """The value takes x's dtype (ATen casts it; a float fill of an int tensor truncates)."""
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)


def _copy(x, src, non_blocking=False):
    """aten.copy(x, src) is x's shape and dtype filled from src (broadcast, cast)."""
    return jnp.broadcast_to(src.astype(x.dtype), x.shape)


def _angle(x):
    """Real inputs: pi below zero, else 0, NaN kept (ATen's formula, not atan2(0, x))."""
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    x = x.astype(opmath(float_dtype(x.dtype)))
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0).astype(x.dtype))


# Same dtype in and out, exact in every dtype, or no arithmetic at all.
register_table(
    {
        aten.abs.default: jnp.abs,
        aten.neg.default: jnp.negative,
        aten.ceil.default: jnp.ceil,
        aten.floor.default: jnp.floor,
        aten.round.default: jnp.round,
        aten.trunc.default: jnp.trunc,
        aten.sign.default: _sign,
        aten.sgn.default: _sgn,
        aten.relu.default: lambda x: jnp.maximum(x, 0),
        aten.isnan.default: jnp.isnan,
        aten.isinf.default: jnp.isinf,
        aten.isposinf.default: jnp.isposinf,
        aten.isneginf.default: jnp.isneginf,
        aten.isfinite.default: jnp.isfinite,
        aten.signbit.default: jnp.signbit,
        aten.logical_not.default: jnp.logical_not,
        aten.logical_and.default: jnp.logical_and,
        aten.logical_or.default: jnp.logical_or,
        aten.logical_xor.default: jnp.logical_xor,
        aten.bitwise_not.default: jnp.invert,
        aten.nan_to_num.default: _nan_to_num,
        (aten.masked_fill.Scalar, aten.masked_fill.Tensor): _masked_fill,
        aten._to_copy.default: _to_copy,
        aten.copy.default: _copy,
        (aten.fill.Scalar, aten.fill.Tensor): jnp.full_like,
        aten.zero.default: jnp.zeros_like,
        (aten.clone.default, aten.lift_fresh_copy.default): lambda x, **_: x,
        # Our values carry no conjugate bit: _conj materialises, as conj_physical does.
        (aten._conj.default, aten._conj_physical.default, aten.conj_physical.default): jnp.conj,
        aten.complex.default: lambda re, im: lax.complex(*jnp.broadcast_arrays(re, im)),
        aten.polar.default: lambda r, t: lax.complex(
            *jnp.broadcast_arrays(r * jnp.cos(t), r * jnp.sin(t))
        ),
        aten.angle.default: _angle,
    }
)


def _gelu(x, *, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


def _gelu_backward(grad_output, x, *, approximate="none"):
    """JAX's derivative of the same formula ATen differentiates by hand."""
    return jax.vjp(partial(_gelu, approximate=approximate), x)[1](grad_output)[0]


def _elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * (alpha * scale))


def _logit(x, eps=None):
    x = x if eps is None else jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


def _xlogy(x, y):
    """0 * log(y) is 0 even for y = 0, but a NaN y stays NaN (jax.scipy's xlogy returns 0)."""
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, 0, x * jnp.log(y)))


# Integer and bool inputs compute in the default float dtype.
register_table(
    {
        aten.acos.default: jnp.arccos,
        aten.acosh.default: jnp.arccosh,
        aten.asin.default: jnp.arcsin,
        aten.asinh.default: jnp.arcsinh,
        aten.atan.default: jnp.arctan,
        aten.atanh.default: jnp.arctanh,
        aten.cos.default: jnp.cos,
        aten.cosh.default: jnp.cosh,
        aten.erf.default: lax.erf,
        aten.erfinv.default: lax.erf_inv,
        aten.exp.default: jnp.exp,
        aten.exp2.default: jnp.exp2,
        aten.expm1.default: jnp.expm1,
        aten.log.default: jnp.log,
        aten.log10.default: jnp.log10,
        aten.log1p.default: jnp.log1p,
        aten.log2.default: jnp.log2,
        aten.reciprocal.default: jnp.reciprocal,
        aten.rsqrt.default: lax.rsqrt,
        aten.sigmoid.default: jax.nn.sigmoid,
        aten.sin.default: jnp.sin,
        aten.sinh.default: jnp.sinh,
        aten.sqrt.default: jnp.sqrt,
        aten.tan.default: jnp.tan,
        aten.tanh.default: jnp.tanh,
        aten.frac.default: lambda x: x - jnp.trunc(x),
        aten.gelu.default: _gelu,
        aten.gelu_backward.default: _gelu_backward,
        aten.silu.default: jax.nn.silu,
        aten.elu.default: _elu,
        aten.logit.default: _logit,
        aten.atan2.default: jnp.arctan2,
        aten.logaddexp.default: jnp.logaddexp,
        aten.logaddexp2.default: jnp.logaddexp2,
        aten.deg2rad.default: jnp.deg2rad,
        aten.rad2deg.default: jnp.rad2deg,
        aten.igamma.default: jax.scipy.special.gammainc,
        aten.igammac.default: jax.scipy.special.gammaincc,
        aten.hypot.default: jnp.hypot,
        (aten.copysign.Tensor, aten.copysign.Scalar): jnp.copysign,
        (aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other): _xlogy,
        (
            aten.div.Tensor,
            aten.div.Scalar,
            aten.true_divide.Tensor,
            aten.true_divide.Scalar,
        ): jnp.true_divide,
    },
    adapt=floating,
)


def _div_trunc(a, b):
    """C division: integers exactly (lax.div truncates), floats as trunc(a / b) like ATen."""
    if category(a.dtype) < 2:
        return lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.trunc(a / b)


def _div_floor(a, b):
    """Python's floor division; floats follow ATen's div_floor_floating step by step."""
    if category(a.dtype) < 2:
        return jnp.floor_divide(a, b)
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    return jnp.where(b == 0, a / b, jnp.where(div == 0, jnp.copysign(0.0, a / b), floor))


# Made once: each adapted lowering keeps the traces JAX made of it (traced_once).
_ROUNDED_DIV = {
    None: floating(jnp.true_divide),
    "trunc": arithmetic(_div_trunc),
    "floor": arithmetic(_div_floor),
}


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(a, b, *, rounding_mode=None):
    return _ROUNDED_DIV[rounding_mode](a, b)


def _int_pow(base, exponent):
    """ATen's powi: exact binary exponentiation that wraps on overflow (jnp.power only reads the
    low 6 exponent bits); a negative exponent gives 0, except for bases 1 and -1."""
    base, exponent = jnp.broadcast_arrays(base, exponent)
    acc, power, bits = jnp.ones_like(base), base, jnp.maximum(exponent, 0)
    for _ in range(jnp.iinfo(base.dtype).bits):
        acc = jnp.where(bits & 1, acc * power, acc)
        power, bits = power * power, bits >> 1
    unit = (base == 1) | (base == -1)
    return jnp.where(exponent < 0, jnp.where(unit, jnp.where(exponent & 1, base, 1), 0), acc)


def _pow(base, exponent):
    return _int_pow(base, exponent) if category(base.dtype) == 1 else jnp.power(base, exponent)


_POW = arithmetic(_pow)
_STATIC_POW = arithmetic(lambda x, *, exponent: jnp.power(x, exponent))
# Exponents of a floating base that ATen's pow kernels (CPU and CUDA) compute by another op.
_POWERS_BY_OP = {0.5: floating(jnp.sqrt), -0.5: floating(lax.rsqrt), -1.0: floating(jnp.reciprocal)}


@lowers(aten.pow.Tensor_Scalar, static_scalars=True)
def _pow_tensor_scalar(x, exponent):
    """A Python exponent stays static, as in ATen: a floating base's exponent is read by value
    (2 and 2.0 alike), the integral ones up to 3 in magnitude as products (x**2 is x*x, not
    exp(2 log x)), 0.5, -0.5 and -1 as sqrt, rsqrt and reciprocal, the others as pow."""
    if jnp.issubdtype(x.dtype, jnp.floating) and type(exponent) in (int, float, bool):
        exponent = float(exponent)
        if exponent in _POWERS_BY_OP:
            return _POWERS_BY_OP[exponent](x)
        if exponent.is_integer() and abs(exponent) <= 3:
            return _STATIC_POW(x, exponent=int(exponent))
    if type(exponent) is not int:
        return _POW(x, exponent)
    return _STATIC_POW(x, exponent=exponent)


def _round_decimals(x, *, decimals=0):
    """ATen scales by 10**|decimals| in whichever direction keeps that factor an exact integer."""
    if decimals >= 0:
        return jnp.round(x * 10.0**decimals) / 10.0**decimals
    return jnp.round(x / 10.0**-decimals) * 10.0**-decimals


def _leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


def _lerp(start, end, weight):
    """ATen's two-sided formula: exact at weight 0 and at weight 1. A single weight (AdamW's
    ``1 - beta1``) picks its side once: ``end + (w - 1) * d`` is ``end - d * (1 - w)`` bit for
    bit, so one select of the base, not two whole formulas, per element."""
    small = jnp.abs(weight) < 0.5
    if jnp.ndim(weight) == 0 and jnp.shape(start) == jnp.shape(end):
        base = lax.select(small, start, end)
        return base + lax.select(small, weight, weight - 1) * (end - start)
    return jnp.where(small, start + weight * (end - start), end - (end - start) * (1 - weight))


def _softplus(x, beta=1, threshold=20):
    """Linear once beta * x exceeds ``threshold``, as ATen switches to avoid overflow."""
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


def _softplus_backward(grad_output, x, beta, threshold):
    return jnp.where(x * beta > threshold, grad_output, grad_output * jax.nn.sigmoid(x * beta))


def _mish_backward(grad_output, x):
    """d/dx x tanh(softplus(x)) = tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)."""
    t = jnp.tanh(jax.nn.softplus(x))
    return grad_output * (t + x * jax.nn.sigmoid(x) * (1 - t * t))


def _softshrink(x, lambd=0.5):
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, 0))


def _shrink_backward(grad_output, x, lambd):
    """hardshrink and softshrink pass the gradient where |x| > lambd."""
    return jnp.where((x >= -lambd) & (x <= lambd), 0, grad_output)


def _clamp(x, min=None, max=None):
    """maximum then minimum: NaN in x propagates, and min > max gives max, as in ATen."""
    x = x if min is None else jnp.maximum(x, min)
    return x if max is None else jnp.minimum(x, max)


# The promoted dtype, bf16/f16 computed in float32; integers keep integer semantics.
register_table(
    {
        (aten.add.Tensor, aten.add.Scalar): lambda a, b, *, alpha=1: a + alpha * b,
        (aten.sub.Tensor, aten.sub.Scalar): lambda a, b, *, alpha=1: a - alpha * b,
        (aten.rsub.Tensor, aten.rsub.Scalar): lambda a, b, *, alpha=1: b - alpha * a,
        (aten.mul.Tensor, aten.mul.Scalar): jnp.multiply,
        (aten.floor_divide.default, aten.floor_divide.Scalar): _div_floor,
        (aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor): jnp.remainder,
        (aten.fmod.Tensor, aten.fmod.Scalar): jnp.fmod,
        (aten.pow.Tensor_Tensor, aten.pow.Scalar): _pow,
        aten.round.decimals: _round_decimals,
        (aten.lerp.Scalar, aten.lerp.Tensor): _lerp,
        aten.addcmul.default: lambda x, t1, t2, *, value=1: x + value * t1 * t2,
        aten.addcdiv.default: lambda x, t1, t2, *, value=1: x + value * t1 / t2,
        (aten.clamp.default, aten.clamp.Tensor): _clamp,
        aten.hardtanh.default: lambda x, min_val=-1, max_val=1: _clamp(x, min_val, max_val),
        aten.leaky_relu.default: _leaky_relu,
        aten.threshold.default: lambda x, threshold, value: jnp.where(x <= threshold, value, x),
        aten.threshold_backward.default: lambda g, x, threshold: jnp.where(x <= threshold, 0, g),
        aten.sigmoid_backward.default: lambda g, y: g * (1 - y) * y,
        aten.tanh_backward.default: lambda g, y: g * (1 - y * y),
        aten.heaviside.default: lambda x, values: jnp.where(x == 0, values, x > 0),
        aten.softplus.default: _softplus,
        aten.softplus_backward.default: _softplus_backward,
        aten.mish.default: lambda x: x * jnp.tanh(jax.nn.softplus(x)),
        aten.mish_backward.default: _mish_backward,
        aten.celu.default: lambda x, alpha=1.0: jnp.where(x > 0, x, alpha * jnp.expm1(x / alpha)),
        aten.hardshrink.default: lambda x, lambd=0.5: jnp.where(jnp.abs(x) > lambd, x, 0),
        aten.softshrink.default: _softshrink,
        (aten.hardshrink_backward.default, aten.softshrink_backward.default): _shrink_backward,
    },
    adapt=arithmetic,
)


# Exact in the promoted dtype: no opmath, and comparisons return bool.
register_table(
    {
        (aten.eq.Tensor, aten.eq.Scalar): jnp.equal,
        (aten.ne.Tensor, aten.ne.Scalar): jnp.not_equal,
        (aten.lt.Tensor, aten.lt.Scalar): jnp.less,
        (aten.le.Tensor, aten.le.Scalar): jnp.less_equal,
        (aten.gt.Tensor, aten.gt.Scalar): jnp.greater,
        (aten.ge.Tensor, aten.ge.Scalar): jnp.greater_equal,
        (aten.maximum.default, aten.max.other, aten.clamp_min.default, aten.clamp_min.Tensor): (
            jnp.maximum
        ),
        (aten.minimum.default, aten.min.other, aten.clamp_max.default, aten.clamp_max.Tensor): (
            jnp.minimum
        ),
        aten.nextafter.default: jnp.nextafter,
        aten.fmax.default: jnp.fmax,
        aten.fmin.default: jnp.fmin,
        (aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_and.Scalar_Tensor): (
            jnp.bitwise_and
        ),
        (aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.bitwise_or.Scalar_Tensor): (
            jnp.bitwise_or
        ),
        (aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_xor.Scalar_Tensor): (
            jnp.bitwise_xor
        ),
        # XLA shifts by >= the bit width (or a negative count) give 0 / the sign, as ATen's do.
        (
            aten.bitwise_left_shift.Tensor,
            aten.bitwise_left_shift.Tensor_Scalar,
            aten.bitwise_left_shift.Scalar_Tensor,
            aten.__lshift__.Tensor,
            aten.__lshift__.Scalar,
        ): jnp.left_shift,
        (
            aten.bitwise_right_shift.Tensor,
            aten.bitwise_right_shift.Tensor_Scalar,
            aten.bitwise_right_shift.Scalar_Tensor,
            aten.__rshift__.Tensor,
            aten.__rshift__.Scalar,
        ): jnp.right_shift,
    },
    adapt=promoted,
)


_PROMOTED_WHERE = promoted(lambda x, other, *, condition: jnp.where(condition, x, other))


@lowers(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(condition, x, other):
    """Only x and other promote together; the condition is a mask, not an operand."""
    return _PROMOTED_WHERE(x, other, condition=condition)


@lowers(aten.frexp.Tensor)
def _frexp(x):
    """(mantissa in [0.5, 1), int32 exponent), as std::frexp gives them."""
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent.astype(jnp.int32)
