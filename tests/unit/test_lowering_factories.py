"""Factory lowerings against the same aten ops run eagerly on CPU torch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close
from tests.unit._lowering_harness import cases, check, lowered, sample

aten = torch.ops.aten
f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
i32, i64 = torch.int32, torch.int64

X = sample(2, 3, dtype=bf16)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.full.default, ([2, 3], 7), {}),
        (aten.full.default, ([2, 3], True), {}),
        (aten.full.default, ([4], 0.1), {}),
        (aten.full.default, ([4], 3), {"dtype": bf16, "device": "cpu", "pin_memory": False}),
        (aten.full.default, ([], -1.5), {"dtype": f64}),
        (aten.full_like.default, (X, 2.5), {}),
        (aten.full_like.default, (X, 3), {"dtype": i32, "memory_format": torch.preserve_format}),
        (aten.new_full.default, (X, [4, 1], 0.1), {}),
        (aten.new_full.default, (X, [2], 9), {"dtype": i64}),
        (aten.zeros.default, ([2, 3],), {}),
        (aten.zeros.default, ([0, 3],), {"dtype": i32, "layout": torch.strided}),
        (aten.ones.default, ([3],), {"dtype": torch.bool}),
        (aten.ones.default, ([2, 2],), {}),
        (aten.zeros_like.default, (X,), {}),
        (aten.ones_like.default, (X,), {"dtype": f32}),
        (aten.new_zeros.default, (X, [5]), {}),
        (aten.new_ones.default, (X, [1, 2]), {"dtype": i64}),
        (aten.scalar_tensor.default, (3,), {}),
        (aten.scalar_tensor.default, (2.5,), {"dtype": i64}),
        (aten.scalar_tensor.default, (True,), {"dtype": torch.bool}),
        (aten.eye.default, (3,), {}),
        (aten.eye.default, (4,), {"dtype": torch.bool}),
        (aten.eye.m, (2, 5), {"dtype": i32}),
        (aten.eye.m, (4, 2), {}),
    ),
)
def test_factory_matches_torch(op, args, kwargs):
    """Without a dtype, full infers it from the fill value, *_like and new_* take self's, and the
    rest use the default float; device, layout and memory format are ignored."""
    check(op, *args, **kwargs)


@pytest.mark.parametrize(
    "op, args, kwargs, expected",
    cases(
        (aten.empty.memory_format, ([2, 3],), {}, torch.zeros(2, 3)),
        (aten.empty.memory_format, ([4],), {"dtype": i64}, torch.zeros(4, dtype=i64)),
        (aten.empty_strided.default, ([2, 3], [1, 2]), {}, torch.zeros(2, 3)),
        (aten.empty_like.default, (X,), {}, torch.zeros(2, 3, dtype=bf16)),
        (aten.empty_like.default, (X,), {"dtype": i32}, torch.zeros(2, 3, dtype=i32)),
        (aten.new_empty.default, (X, [3]), {}, torch.zeros(3, dtype=bf16)),
        (aten.new_empty_strided.default, (X, [3, 1], [1, 1]), {}, torch.zeros(3, 1, dtype=bf16)),
    ),
)
def test_empty_is_zeros_of_torchs_shape_and_dtype(op, args, kwargs, expected):
    """Uninitialised memory has no values to compare; shape and dtype must still be torch's."""
    assert op(*args, **kwargs).dtype == expected.dtype
    assert_close(lowered(op, *args, **kwargs), expected)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.arange.default, (5,), {}),
        (aten.arange.default, (5.0,), {}),
        (aten.arange.default, (0,), {}),
        (aten.arange.default, (7,), {"dtype": f32}),
        (aten.arange.start, (-3, 4), {}),
        (aten.arange.start, (0.5, 4), {"dtype": bf16}),
        (aten.arange.start_step, (0, 0.3, 0.1), {}),
        (aten.arange.start_step, (1, 2.0, 0.1), {"dtype": f64}),
        (aten.arange.start_step, (10, 0, -3), {}),
        (aten.arange.start_step, (-5, 6, 4), {"dtype": i32}),
        (aten.arange.start_step, (2.5, -1.0, -0.7), {}),
        (aten.arange.start_step, (0, 1_000_001, 3), {}),
    ),
)
def test_arange_matches_torch(op, args, kwargs):
    """ceil((end - start) / step) elements; int64 for integer arguments, else the default float."""
    check(op, *args, **kwargs)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.linspace.default, (0, 1, 5), {}),
        (aten.linspace.default, (-2.5, 7.0, 10), {}),
        (aten.linspace.default, (3, 7, 1), {}),
        (aten.linspace.default, (3, 7, 0), {}),
        (aten.linspace.default, (3, 7, 2), {}),
        (aten.linspace.default, (0, 10, 4), {"dtype": i64}),
        (aten.linspace.default, (-7.5, 10, 6), {"dtype": i32}),
        (aten.linspace.default, (0.1, 0.9, 7), {"dtype": bf16}),
        (aten.linspace.default, (1e-3, 1e3, 101), {"dtype": f64}),
        (aten.linspace.Tensor_Tensor, (torch.tensor(1.0), torch.tensor(2.0), 5), {}),
        (aten.linspace.Scalar_Tensor, (-1, torch.tensor(2.0), 4), {}),
    ),
)
def test_linspace_matches_torch(op, args, kwargs):
    """Both ends exact (the second half counts back from end); a single step is start."""
    check(op, *args, **kwargs)


def test_efficientzerotensor_is_plain_zeros():
    """Autograd's ZeroTensor (an unused input's gradient, sgn's) has no storage on CPU to compare
    against; on the device it is an ordinary tensor of zeros of its size and dtype."""
    got = lowered(aten._efficientzerotensor.default, [2, 3], dtype=bf16)
    assert_close(got, torch.zeros(2, 3, dtype=bf16))
