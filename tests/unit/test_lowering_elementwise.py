"""Elementwise lowerings against the same aten ops run eagerly on CPU torch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close
from tests.unit._lowering_harness import Traced, cases, check, lowered, named, op_name, sample

aten = torch.ops.aten
f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
i32, i64, u8 = torch.int32, torch.int64, torch.uint8

_NAN, _INF = float("nan"), float("inf")
_EXACT = named("exact")
_SIGNS = torch.tensor([1, -1, 1, -1, -1, 1], dtype=i32)
_SPECIALS = [_NAN, _INF, -_INF, -0.0, 0.0, 0.5, -0.5, 1.5, 2.5, -2.5]


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """x followed by NaN, +-inf, signed zeros and halves (round half to even)."""
    if not x.dtype.is_floating_point:
        return x
    return torch.cat([x, torch.tensor(_SPECIALS, dtype=x.dtype)])


# op: the (low, high) its float inputs are drawn from.
FLOAT_UNARY = {
    aten.acos.default: (-1, 1),
    aten.acosh.default: (1, 4),
    aten.asin.default: (-1, 1),
    aten.asinh.default: (-3, 3),
    aten.atan.default: (-3, 3),
    aten.atanh.default: (-0.99, 0.99),
    aten.cos.default: (-3, 3),
    aten.cosh.default: (-3, 3),
    aten.erf.default: (-3, 3),
    aten.erfinv.default: (-0.99, 0.99),
    aten.exp.default: (-3, 3),
    aten.exp2.default: (-3, 3),
    aten.expm1.default: (-3, 3),
    aten.log.default: (0.1, 5),
    aten.log10.default: (0.1, 5),
    aten.log1p.default: (-0.9, 5),
    aten.log2.default: (0.1, 5),
    aten.reciprocal.default: (0.1, 5),
    aten.rsqrt.default: (0.1, 5),
    aten.sigmoid.default: (-5, 5),
    aten.sin.default: (-3, 3),
    aten.sinh.default: (-3, 3),
    aten.sqrt.default: (0, 5),
    aten.tan.default: (-1.2, 1.2),
    aten.tanh.default: (-3, 3),
    aten.silu.default: (-5, 5),
    aten.gelu.default: (-5, 5),
    aten.logit.default: (0.01, 0.99),
    aten.frac.default: (-5, 5),
}


@pytest.mark.parametrize("op", list(FLOAT_UNARY), ids=op_name)
def test_float_unary_matches_torch(op):
    check(op, sample(64, low=FLOAT_UNARY[op][0], high=FLOAT_UNARY[op][1]))


@pytest.mark.parametrize("dtype", [bf16, i32], ids=str)
@pytest.mark.parametrize(
    "op",
    [
        aten.exp.default,
        aten.log.default,
        aten.sqrt.default,
        aten.rsqrt.default,
        aten.sigmoid.default,
        aten.tanh.default,
        aten.erf.default,
        aten.reciprocal.default,
    ],
    ids=op_name,
)
def test_float_unary_of_bf16_and_int_matches_torch(op, dtype):
    """Integer inputs compute in float32 (the default dtype); bf16 in float32, rounded once."""
    check(op, sample(64, dtype=dtype, low=1, high=5))


def test_float_unary_propagates_nan():
    check(aten.sqrt.default, torch.tensor([_NAN, -1.0, _INF, 0.0]))
    check(aten.log.default, torch.tensor([_NAN, -1.0, _INF, 0.0, -0.0]))


@pytest.mark.parametrize("dtype", [f32, i64], ids=str)
@pytest.mark.parametrize(
    "op",
    [
        aten.abs.default,
        aten.neg.default,
        aten.ceil.default,
        aten.floor.default,
        aten.round.default,
        aten.trunc.default,
        aten.sign.default,
        aten.sgn.default,
        aten.relu.default,
        aten.isnan.default,
        aten.isinf.default,
        aten.isfinite.default,
        aten.signbit.default,
        aten.clone.default,
        aten.lift_fresh_copy.default,
    ],
    ids=op_name,
)
def test_dtype_preserving_unary_matches_torch(op, dtype):
    check(op, _with_specials(sample(32, dtype=dtype, low=-9, high=9)))


def test_sign_of_bool_is_itself():
    check(aten.sign.default, torch.tensor([True, False]))


BINARY = [
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.rsub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.remainder.Tensor,
    aten.fmod.Tensor,
    aten.floor_divide.default,
    aten.pow.Tensor_Tensor,
    aten.maximum.default,
    aten.minimum.default,
    aten.max.other,
    aten.fmax.default,
    aten.fmin.default,
    aten.atan2.default,
    aten.hypot.default,
    aten.copysign.Tensor,
    aten.xlogy.Tensor,
    aten.heaviside.default,
    aten.eq.Tensor,
    aten.ne.Tensor,
    aten.lt.Tensor,
    aten.le.Tensor,
    aten.gt.Tensor,
    aten.ge.Tensor,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_xor.default,
]

# Same-dtype operands: float with NaN, inf and signed zeros; integers with both signs (nonzero
# divisors: ATen raises on integer division by zero); bfloat16.
SAME_DTYPE = {
    "f32": (
        torch.cat([sample(12), torch.tensor([_NAN, 1.0, _NAN, -0.0, _INF, -2.0])]),
        torch.cat([sample(12), torch.tensor([1.0, _NAN, _NAN, 0.0, 2.0, -_INF])]),
    ),
    "i32": (sample(4, 6, dtype=i32, low=-9, high=9), sample(6, dtype=i32, low=1, high=4) * _SIGNS),
    "bf16": (sample(4, 6, dtype=bf16), sample(4, 6, dtype=bf16)),
}
# Mixed operands: integer widths, int with float, and a 0-dim tensor of a higher dtype, which must
# not promote the dimensioned one within its category.
MIXED = {
    "u8-i32": (sample(4, 6, dtype=u8, low=0, high=9), sample(4, 6, dtype=i32, low=1, high=3)),
    "i32-f32": (sample(4, 6, dtype=i32, low=-5, high=5), sample(4, 6)),
    "bf16-f64_0dim": (sample(4, 6, dtype=bf16), torch.tensor(1.7, dtype=f64)),
    "i32-f64_0dim": (sample(4, 6, dtype=i32, low=-5, high=5), torch.tensor(2.5, dtype=f64)),
    "bool-i64": (sample(4, 6, dtype=torch.bool), sample(4, 6, dtype=i64, low=1, high=3)),
}
PROMOTING = [
    aten.add.Tensor,
    aten.div.Tensor,
    aten.remainder.Tensor,
    aten.pow.Tensor_Tensor,
    aten.maximum.default,
    aten.eq.Tensor,
]


def _pairs(ops: list, pairs: dict) -> list:
    """Every op with every operand pair ATen accepts; pairs it rejects never reach a lowering."""
    params = []
    for op in ops:
        for name, (a, b) in pairs.items():
            try:
                op(a, b)
            except RuntimeError:
                continue
            params.append(pytest.param(op, a, b, id=f"{op_name(op)}-{name}"))
    return params


@pytest.mark.parametrize("op, a, b", _pairs(BINARY, SAME_DTYPE))
def test_binary_matches_torch(op, a, b):
    check(op, a, b)


@pytest.mark.parametrize("op, a, b", _pairs(PROMOTING, MIXED))
def test_binary_promotes_like_torch(op, a, b):
    check(op, a, b)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.add.Tensor, (sample(5, dtype=i32), 2.5), {}),
        (aten.add.Tensor, (sample(5, dtype=torch.bool), 1), {}),
        (aten.add.Tensor, (sample(5, dtype=bf16), sample(5, dtype=bf16)), {"alpha": 0.1}),
        (aten.add.Scalar, (sample(5, dtype=i64), 3), {"alpha": 2}),
        (aten.sub.Tensor, (sample(5), sample(5)), {"alpha": 2}),
        (aten.rsub.Scalar, (sample(5, dtype=i32), 1), {}),
        (aten.mul.Tensor, (sample(5, dtype=bf16), 0.1), {}),
        (aten.mul.Scalar, (sample(5, dtype=i32), 0.5), {}),
        (aten.div.Scalar, (sample(5, dtype=i32), 2), {}),
        (
            aten.div.Scalar_mode,
            (sample(5, dtype=i32, low=-9, high=9), -3),
            {"rounding_mode": "floor"},
        ),
        (aten.remainder.Scalar, (sample(5, dtype=i32, low=-9, high=9), -3), {}),
        (aten.remainder.Scalar_Tensor, (7, sample(5, dtype=i64, low=1, high=4)), {}),
        (aten.fmod.Scalar, (sample(5, low=-9, high=9), -2.5), {}),
        (aten.lt.Scalar, (sample(5, dtype=i32), 0.5), {}),
        (aten.pow.Tensor_Scalar, (sample(5, dtype=i64, low=-9, high=9), 3), {}),
        (aten.pow.Tensor_Scalar, (sample(5, low=-3, high=3), 2), {}),
        (aten.pow.Tensor_Scalar, (sample(5, low=0, high=3), 0.5), {}),
        (aten.pow.Tensor_Scalar, (sample(5, low=0.5, high=3), -1), {}),
        (aten.pow.Tensor_Scalar, (sample(5, dtype=i32), 2.0), {}),
        (aten.pow.Scalar, (2, sample(5, dtype=i32, low=0, high=9)), {}),
        (aten.pow.Scalar, (2.5, sample(5)), {}),
        (aten.copysign.Scalar, (sample(5, dtype=i32), -1.0), {}),
        (aten.xlogy.Scalar_Self, (2, sample(5, low=0.1)), {}),
        (aten.xlogy.Scalar_Other, (sample(5), 3.0), {}),
        (aten.bitwise_and.Scalar, (sample(5, dtype=i32, low=0, high=64), 12), {}),
        (aten.bitwise_or.Scalar_Tensor, (5, sample(5, dtype=i64, low=0, high=64)), {}),
        (aten.bitwise_xor.Scalar, (sample(5, dtype=torch.bool), True), {}),
    ),
)
def test_scalar_operand_matches_torch(op, args, kwargs):
    """A Python scalar promotes across categories only: int tensor * 0.5 is float32."""
    check(op, *args, **kwargs)


def test_scalar_compares_in_the_tensors_dtype():
    """ATen casts the scalar to bf16 first: 0.1 becomes 0.10009765625, which equals the tensor's
    0.1 (a float64 reference would compare with 0.1 itself, so the expected value is spelled)."""
    got = lowered(aten.eq.Scalar, torch.tensor([0.1, 0.2], dtype=bf16), 0.1)
    assert_close(got, torch.tensor([True, False]))


_NUM = torch.tensor([-7, 7, -7, 7, -8, 8, 0, 0, 5, -5])
_DEN = torch.tensor([2, 2, -2, -2, 3, -3, 4, -4, 5, 5])


@pytest.mark.parametrize("mode", [None, "trunc", "floor"])
@pytest.mark.parametrize("dtype", [i32, i64, f32, bf16], ids=str)
def test_div_rounding_modes_match_torch(mode, dtype):
    check(aten.div.Tensor_mode, _NUM.to(dtype), _DEN.to(dtype), rounding_mode=mode)


@pytest.mark.parametrize("mode", [None, "trunc", "floor"])
def test_float_div_by_zero_and_signed_zero_match_torch(mode):
    """floor division by 0 is IEEE a / b; a zero quotient keeps the sign of a / b."""
    a = torch.tensor([1.0, -1.0, 0.0, _NAN, -0.5, 0.5, 5.0, -5.0])
    b = torch.tensor([0.0, 0.0, 0.0, 2.0, 3.0, -3.0, 0.3, 0.3])
    check(aten.div.Tensor_mode, a, b, rounding_mode=mode)


def test_floor_division_is_exact_and_keeps_the_sign_of_zero():
    """Huge quotients need ATen's round-half correction; a zero quotient has the sign of a / b."""
    a = torch.tensor(
        [-0.032177187502384186, -2505.257568359375, -17343974.0, -0.0, 0.0, -3.0], dtype=f64
    )
    b = torch.tensor(
        [-3.0093098558848716e-14, 1.0051058943472135e-11, -8.0374e-09, 2.0, -2.0, -7e6], dtype=f64
    )
    got = lowered(aten.div.Tensor_mode, a, b, rounding_mode="floor")
    expected = aten.div.Tensor_mode(a, b, rounding_mode="floor")
    assert_close(got, expected, **_EXACT(f64))
    assert torch.equal(got.signbit(), expected.signbit())


@pytest.mark.users_codegen
@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.mul.Tensor, (sample(64, dtype=bf16), 0.1), {}),
        (aten.div.Tensor, (sample(64, dtype=bf16), sample(64, dtype=bf16)), {}),
        (
            aten.addcmul.default,
            (sample(64, dtype=bf16), sample(64, dtype=bf16), sample(64, dtype=bf16)),
            {"value": 0.1},
        ),
        (aten.lerp.Scalar, (sample(64, dtype=bf16), sample(64, dtype=bf16), 0.3), {}),
        (aten.lerp.Scalar, (sample(64), sample(64), 1.0), {}),
        (aten.lerp.Tensor, (sample(64), sample(64), sample(64, low=0.6, high=1)), {}),
    ),
)
def test_result_is_bitwise_torchs(op, args, kwargs):
    """bf16 computes in float32 and rounds once, as ATen's opmath kernels do, and lerp's two-sided
    formula lands exactly on end at weight 1."""
    check(op, *args, tol=_EXACT, **kwargs)


@pytest.mark.parametrize("dtype", [i32, i64, f32], ids=str)
@pytest.mark.parametrize("op", [aten.remainder.Tensor, aten.fmod.Tensor], ids=op_name)
def test_remainder_sign_follows_divisor_and_fmod_dividend(op, dtype):
    check(op, _NUM.to(dtype), _DEN.to(dtype))


@pytest.mark.parametrize("dtype", [i32, i64, u8], ids=str)
def test_integer_pow_is_exact_and_wraps(dtype):
    """Exponents past 63, negative ones (0 except for bases 1 and -1), wraparound."""
    base = torch.tensor([2, 3, -1, 1, 0, -1, 2, 7, -3, 5])
    exponent = torch.tensor([64, 40, -3, -5, -1, 100, -2, 13, 5, 0])
    if dtype == u8:
        base, exponent = base.abs(), exponent.abs()
    check(aten.pow.Tensor_Tensor, base.to(dtype), exponent.to(dtype))


def test_integer_pow_broadcasts_scalar_base():
    check(aten.pow.Scalar, 3, torch.arange(45))


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.clamp.default, (sample(9), -0.5, 0.5), {}),
        (aten.clamp.default, (sample(9), None, 0.5), {}),
        (aten.clamp.default, (sample(9), 1.0, -1.0), {}),
        (aten.clamp.default, (sample(9, dtype=i32), 0.5), {}),
        (aten.clamp.default, (_with_specials(sample(3)), -1, 1), {}),
        (aten.clamp.Tensor, (sample(9), sample(9), None), {}),
        (
            aten.clamp.Tensor,
            (sample(9, dtype=bf16), sample(9, dtype=bf16), sample(9, dtype=bf16)),
            {},
        ),
        (aten.clamp_min.default, (sample(9, dtype=i64), 0), {}),
        (aten.clamp_max.default, (sample(9), 0.25), {}),
        (aten.clamp_min.Tensor, (sample(9), sample(9)), {}),
        (aten.clamp_max.Tensor, (sample(9), sample(9)), {}),
        (aten.hardtanh.default, (_with_specials(sample(9)),), {}),
        (aten.hardtanh.default, (sample(9), -0.5, 2.0), {}),
        (aten.leaky_relu.default, (_with_specials(sample(9)),), {}),
        (aten.leaky_relu.default, (sample(9, dtype=bf16), 0.2), {}),
        (aten.elu.default, (_with_specials(sample(9)),), {}),
        (aten.elu.default, (sample(9), 0.5, 2.0, 1.5), {}),
        (aten.threshold.default, (sample(9), 0.1, -2.0), {}),
        (aten.threshold_backward.default, (sample(9), sample(9), 0.0), {}),
        (aten.sigmoid_backward.default, (sample(9), sample(9, low=0, high=1)), {}),
        (
            aten.tanh_backward.default,
            (sample(9, dtype=bf16), sample(9, dtype=bf16, low=-1, high=1)),
            {},
        ),
        (aten.gelu.default, (sample(9, dtype=bf16, low=-5, high=5),), {"approximate": "tanh"}),
        (aten.gelu.default, (sample(9, low=-5, high=5),), {"approximate": "tanh"}),
        (aten.gelu_backward.default, (sample(9), sample(9, low=-5, high=5)), {}),
        (
            aten.gelu_backward.default,
            (sample(9), sample(9, low=-5, high=5)),
            {"approximate": "tanh"},
        ),
        (aten.logit.default, (sample(9, low=-0.1, high=1.1), 0.05), {}),
        (aten.round.decimals, (sample(9, low=-999, high=999),), {"decimals": 2}),
        (aten.round.decimals, (sample(9, low=-999, high=999),), {"decimals": -2}),
        (aten.lerp.Scalar, (sample(9), sample(9), 0.3), {}),
        (aten.lerp.Scalar, (sample(9), sample(9), 1.0), {}),
        (
            aten.lerp.Tensor,
            (sample(9, dtype=bf16), sample(9, dtype=bf16), sample(9, dtype=bf16)),
            {},
        ),
        (aten.addcmul.default, (sample(9), sample(9), sample(9)), {"value": 0.5}),
        (
            aten.addcmul.default,
            (sample(9, dtype=i32), sample(9, dtype=i32), sample(9, dtype=i32)),
            {},
        ),
        (aten.addcdiv.default, (sample(9), sample(9), sample(9, low=0.5)), {"value": -2}),
        (aten.nan_to_num.default, (_with_specials(sample(3)),), {}),
        (aten.nan_to_num.default, (_with_specials(sample(3)), 1.0, 2.0, -3.0), {}),
        (aten.where.self, (sample(9, dtype=torch.bool), sample(9, dtype=i32), sample(9)), {}),
        (
            aten.where.self,
            (sample(9, dtype=torch.bool), sample(9, dtype=bf16), torch.tensor(2.0)),
            {},
        ),
        (aten.where.ScalarOther, (sample(9, dtype=torch.bool), sample(9, dtype=i64), 0.5), {}),
        (aten.where.ScalarSelf, (sample(9, dtype=torch.bool), 3, sample(9, dtype=i32)), {}),
        (aten.where.Scalar, (sample(9, dtype=torch.bool), 1.0, 0), {}),
        (aten.masked_fill.Scalar, (sample(9, dtype=bf16), sample(9, dtype=torch.bool), 0.1), {}),
        (aten.masked_fill.Scalar, (sample(9, dtype=i32), sample(9, dtype=torch.bool), -4), {}),
        (
            aten.masked_fill.Tensor,
            (sample(9), sample(9, dtype=torch.bool), torch.tensor(-_INF)),
            {},
        ),
        (aten.heaviside.default, (torch.tensor([-1.0, 0.0, 2.0, _NAN]), torch.tensor(0.5)), {}),
        (
            aten.xlogy.Tensor,
            (torch.tensor([0.0, 0.0, 2.0, 1.0]), torch.tensor([0.0, _NAN, 0.0, 3.0])),
            {},
        ),
        (aten.logical_not.default, (sample(9, dtype=i32),), {}),
        (aten.logical_and.default, (sample(9), sample(9, dtype=torch.bool)), {}),
        (aten.bitwise_not.default, (sample(9, dtype=i32, low=-50, high=50),), {}),
        (aten.bitwise_not.default, (sample(9, dtype=torch.bool),), {}),
        (
            aten.bitwise_and.Tensor,
            (sample(9, dtype=i64, low=-50, high=50), sample(9, dtype=i32, low=0, high=50)),
            {},
        ),
        (aten.bitwise_xor.Tensor, (sample(9, dtype=torch.bool), sample(9, dtype=torch.bool)), {}),
    ),
)
def test_pointwise_with_arguments_matches_torch(op, args, kwargs):
    check(op, *args, **kwargs)


def test_nan_to_num_defaults_to_the_dtypes_range():
    """NaN becomes 0 and +-inf bf16's largest finite values (spelled out: a float64 reference
    would use float64's, which round to inf in bf16)."""
    x = torch.tensor([1.5, -3.0, *_SPECIALS], dtype=bf16)
    big = torch.finfo(bf16).max
    expected = [1.5, -3.0, 0.0, big, -big, -0.0, 0.0, 0.5, -0.5, 1.5, 2.5, -2.5]
    assert_close(
        lowered(aten.nan_to_num.default, x), torch.tensor(expected, dtype=bf16), **_EXACT(bf16)
    )


_SHIFTED = torch.tensor([-7, 7, -7, 7, -7, 7, 1, -1])
_SHIFTS = torch.tensor([0, 1, 3, 31, 40, 70, -1, 63])


@pytest.mark.parametrize("dtype", [i32, i64, u8], ids=str)
@pytest.mark.parametrize(
    "op", [aten.bitwise_left_shift.Tensor, aten.bitwise_right_shift.Tensor], ids=op_name
)
def test_shifts_past_the_width_match_torch(op, dtype):
    """Shifting by >= the bit width (or a negative count) gives 0, or the sign for >> of signed."""
    shifted, shifts = (_SHIFTED.abs(), _SHIFTS.abs()) if dtype == u8 else (_SHIFTED, _SHIFTS)
    check(op, shifted.to(dtype), shifts.to(dtype))


@pytest.mark.parametrize(
    "op", [aten.__lshift__.Scalar, aten.bitwise_right_shift.Tensor_Scalar], ids=op_name
)
def test_shift_by_scalar_matches_torch(op):
    check(op, _SHIFTED, 2)


@pytest.mark.parametrize("dtype", [f32, bf16, i32, i64, torch.bool, f64], ids=str)
def test_to_copy_casts_like_torch(dtype):
    """Float to integer truncates toward zero; anything to bool is != 0."""
    x = torch.tensor([-2.7, -0.5, 0.0, 0.4, 1.5, 3.9, 100.0])
    check(aten._to_copy.default, x, dtype=dtype)
    check(aten._to_copy.default, x.to(torch.int32), dtype=dtype, layout=torch.strided)


def test_to_copy_without_dtype_keeps_dtype():
    check(aten._to_copy.default, sample(3, dtype=bf16), memory_format=torch.preserve_format)


def test_copy_broadcasts_and_casts_src():
    check(aten.copy.default, sample(3, 4), sample(4, dtype=i32))


@pytest.mark.parametrize(
    "op, x, value",
    [
        (aten.fill.Scalar, sample(2, 3, dtype=i32), 7),
        (aten.fill.Scalar, sample(2, 3, dtype=bf16), 0.1),
        (aten.fill.Tensor, sample(2, 3), torch.tensor(2.5, dtype=f64)),
    ],
    ids=["scalar-int", "scalar-bf16", "tensor"],
)
def test_fill_keeps_self_dtype(op, x, value):
    check(op, x, value)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (
            aten.add.Tensor,
            (sample(6, dtype=bf16), sample(6, dtype=bf16)),
            {"alpha": Traced(-0.01)},
        ),
        (aten.addcmul.default, (sample(6), sample(6), sample(6)), {"value": Traced(0.3)}),
        (aten.addcdiv.default, (sample(6), sample(6), sample(6, low=1)), {"value": Traced(1.0)}),
        (aten.mul.Tensor, (sample(6, dtype=i32), Traced(0.5)), {}),
        (aten.lerp.Scalar, (sample(6), sample(6), Traced(1.0)), {}),
        (aten.clamp.default, (sample(6), Traced(-0.5)), {}),
        (aten.leaky_relu.default, (sample(6), Traced(0.2)), {}),
        (aten.masked_fill.Scalar, (sample(6), sample(6, dtype=torch.bool), Traced(-1.5)), {}),
        (aten.where.ScalarOther, (sample(6, dtype=torch.bool), sample(6), Traced(0.5)), {}),
        (aten.pow.Tensor_Scalar, (sample(6, low=0.1), Traced(2.0)), {}),
    ),
)
def test_traced_float_scalar_is_not_branched_on(op, args, kwargs):
    """The lowering traces with the scalar abstract (a Python branch on its value would raise) and
    gives torch's result for the value it runs with."""
    check(op, *args, **kwargs)
