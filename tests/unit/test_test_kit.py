"""The test kit itself: assert_matches_eager fails on a wrong forward, dtype or gradient, the
low-precision reference is the float64 result rounded once, never CPU's bf16 kernel, and
assert_close takes the table's row, its "grad" row or a named override for each dtype."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import (
    TOLERANCE_OVERRIDES,
    assert_close,
    assert_matches_eager,
    reference,
    tolerance,
)

bf16 = torch.bfloat16
_gen = torch.Generator().manual_seed(0)


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=_gen, dtype=dtype)


def _on_xla(x: torch.Tensor) -> bool:
    return x.device.type == "xla"


class _GradTimesThreeOnXla(torch.autograd.Function):
    """2 * x on both sides; the gradient is 2 on CPU but 3 on xla."""

    @staticmethod
    def forward(ctx, x):
        ctx.on_xla = _on_xla(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * (3 if ctx.on_xla else 2)


def test_matching_function_passes_forward_and_grad():
    x, w = _t(3, 4), _t(4)
    got = assert_matches_eager(lambda x, w: (x * w).sin().sum(1), x, w, grad=True)
    assert _on_xla(got)


def test_wrong_forward_is_caught():
    def off_by_a_bit_on_xla(x):
        return x.exp() * (1 + 1e-3 if _on_xla(x) else 1)

    with pytest.raises(AssertionError, match="not close"):
        assert_matches_eager(off_by_a_bit_on_xla, _t(8))


def test_wrong_dtype_is_caught():
    def float64_on_xla(x):
        return x.double() if _on_xla(x) else x

    with pytest.raises(AssertionError, match="dtype"):
        assert_matches_eager(float64_on_xla, _t(8))


def test_wrong_gradient_is_caught_with_a_correct_forward():
    x = _t(5)
    assert_matches_eager(_GradTimesThreeOnXla.apply, x)  # the forward alone passes
    with pytest.raises(AssertionError, match=r"grad\['input 0'\]"):
        assert_matches_eager(_GradTimesThreeOnXla.apply, x, grad=True)


def test_grad_without_anything_to_differentiate_fails():
    with pytest.raises(AssertionError, match="no floating output"):
        assert_matches_eager(torch.argmax, _t(6), grad=True)


def test_reference_computes_low_precision_in_float64():
    """fn sees float64 inputs; the result comes back in the dtype fn gives bf16 inputs."""

    def dtype_flag(x):
        return torch.full_like(x, float(x.dtype == torch.float64))

    got = reference(dtype_flag, _t(4, dtype=bf16))
    assert got.dtype == bf16
    assert torch.equal(got, torch.ones(4, dtype=bf16))


def test_reference_rounds_once():
    """1 + 2**-8 + 2**-30 rounds up to bf16's 1 + 2**-7; through float32 (torch's float64 to
    bf16 cast) the 2**-30 is lost first and the tie rounds down to 1."""
    one = torch.tensor([1.0], dtype=bf16)
    small = torch.tensor(2.0**-8 + 2.0**-30, dtype=torch.float64)  # 0-dim: the result stays bf16
    got = reference(torch.add, one, small)
    assert got.dtype == bf16
    assert got.item() == 1 + 2**-7


def test_bf16_convolution_backward_matches_the_rounded_float64_reference():
    """CPU's own bf16 convolution kernels round differently from one instruction set to another;
    against float64 rounded once, ours is within one bf16 ulp, forward and backward."""
    x, w, b = _t(2, 4, 6, 6, dtype=bf16), _t(3, 4, 3, 3, dtype=bf16), _t(3, dtype=bf16)
    assert tolerance(bf16, "grad")["rtol"] < 2 * 2**-7  # less than two ulps
    assert_matches_eager(F.conv2d, x, w, b, stride=(2, 1), padding=(1, 0), grad=True)


def _ulps_up(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.nextafter(x, torch.full_like(x, math.inf))
    return x


def test_assert_close_uses_the_table_row_of_each_dtype():
    x = torch.tensor([1.0, -2.0, 3.0])
    assert_close(x * (1 + 5e-5), x)  # within float32's "fwd" rtol 1e-4
    with pytest.raises(AssertionError, match="not close"):
        assert_close(x * (1 + 5e-4), x)


def test_assert_close_kind_grad_takes_the_grad_row():
    x = torch.tensor([1.0, -2.0, 3.0])
    slightly_off = x * (1 + 1.5e-4)  # past "fwd" (1e-4), within "grad" (2e-4)
    assert_close(slightly_off, x, kind="grad")
    with pytest.raises(AssertionError, match="not close"):
        assert_close(slightly_off, x)


def test_assert_close_named_override_is_looked_up_per_dtype():
    x, h = torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0], dtype=bf16)
    assert_close((x, h), (x.clone(), h.clone()), tol="exact")
    for off in ((_ulps_up(x, 1), h), (x, _ulps_up(h, 1))):  # one ulp in either dtype
        assert_close(off, (x, h))  # the table lets one ulp pass
        with pytest.raises(AssertionError, match="not equal"):
            assert_close(off, (x, h), tol="exact")


def test_assert_close_override_falls_back_to_the_table_for_dtypes_it_leaves_out():
    assert bf16 not in TOLERANCE_OVERRIDES["resharded"]
    h = torch.tensor([1.0, 3.0], dtype=bf16)
    assert_close(_ulps_up(h, 1), h, tol="resharded")  # bf16's own row: one ulp passes
    x = torch.tensor([1.0, 3.0])
    assert_close(_ulps_up(x, 8), x, tol="resharded")  # a few float32 ulps pass
    with pytest.raises(AssertionError, match="not close"):
        assert_close(x * (1 + 1e-5), x, tol="resharded")  # the table's 1e-4 would not catch it


def test_assert_close_refuses_unknown_names_kinds_and_both_forms():
    x = torch.ones(2)
    with pytest.raises(KeyError, match="no tolerance override 'nope'"):
        assert_close(x, x, tol="nope")
    with pytest.raises(ValueError, match="tolerance kind must be 'fwd' or 'grad'"):
        assert_close(x, x, kind="backward")
    with pytest.raises(TypeError, match="not both"):
        assert_close(x, x, tol="exact", rtol=0, atol=0)
