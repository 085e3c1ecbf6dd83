"""Reduction, scan, sort and top-k lowerings against the same aten ops run eagerly on CPU torch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close, reference
from tests.unit._lowering_harness import cases, check, lowered, sample

aten = torch.ops.aten
f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
i32, i64 = torch.int32, torch.int64

_NAN, _INF = float("nan"), float("inf")
X = sample(3, 4, 5)
X_BF16 = sample(3, 4, 5, dtype=bf16)
X_INT = sample(3, 4, 5, dtype=i32, low=-9, high=9)
X_BOOL = sample(3, 4, 5, dtype=torch.bool)
X_NAN = torch.tensor([[1.0, _NAN, 3.0, _NAN], [2.0, 5.0, -_INF, 5.0], [0.0, -0.0, 7.0, 7.0]])
X_TIES = torch.tensor([[3, 1, 3, 0, 1], [2, 2, 2, 2, 2], [-1, 4, 0, 4, -1]])


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.sum.default, (X,), {}),
        (aten.sum.default, (X_INT,), {}),
        (aten.sum.default, (X_BOOL,), {}),
        (aten.sum.default, (X_BF16,), {}),
        (aten.sum.default, (X,), {"dtype": f64}),
        (aten.sum.dim_IntList, (X, [1]), {}),
        (aten.sum.dim_IntList, (X, [-1, 0], True), {}),
        (aten.sum.dim_IntList, (X, []), {}),
        (aten.sum.dim_IntList, (X_INT, None, True), {"dtype": i32}),
        (aten.sum.dim_IntList, (torch.tensor(2.5), [0]), {}),
        (aten.mean.default, (X_BF16,), {}),
        (aten.mean.default, (X_INT,), {"dtype": f32}),
        (aten.mean.dim, (X, [0, 2]), {}),
        (aten.mean.dim, (X, [-1], True), {"dtype": f64}),
        (aten.prod.default, (sample(6, low=0.5, high=1.5),), {}),
        (aten.prod.default, (X_INT,), {}),
        (aten.prod.dim_int, (sample(3, 4, dtype=i64, low=-3, high=3), 1), {}),
        (aten.prod.dim_int, (X_BOOL, 0, True), {}),
        (aten.amax.default, (X_NAN, [1]), {}),
        (aten.amax.default, (X, [0, -1], True), {}),
        (aten.amax.default, (X_INT,), {}),
        (aten.amin.default, (X_NAN, [0]), {}),
        (aten.amin.default, (X_BF16, [], True), {}),
        (aten.max.default, (X_NAN,), {}),
        (aten.max.default, (X_INT,), {}),
        (aten.min.default, (X_BOOL,), {}),
        (aten.min.default, (X,), {}),
        (aten.any.default, (X_INT,), {}),
        (aten.any.dim, (X_BOOL, 1), {}),
        (aten.any.dims, (X, [0, 2], True), {}),
        (aten.any.dims, (X_INT, []), {}),
        (aten.any.dims, (X_INT,), {}),
        (aten.all.default, (X,), {}),
        (aten.all.dim, (X_INT, -1, True), {}),
        (aten.all.dims, (X_BOOL, [1]), {}),
        (aten.count_nonzero.dim_IntList, (X_INT, [0, 1]), {}),
        (aten.count_nonzero.dim_IntList, (X_INT, []), {}),
        (aten.count_nonzero.default, (X_BOOL,), {}),
        (aten.count_nonzero.default, (X_NAN, 1), {}),
    ),
)
def test_reduction_matches_torch(op, args, kwargs):
    """Integer and bool sums widen to int64; bf16 accumulates in float32; NaN wins max/min."""
    check(op, *args, **kwargs)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.max.dim, (X_NAN, 1), {}),
        (aten.max.dim, (X_TIES, 1, True), {}),
        (aten.min.dim, (X_NAN, 0), {}),
        (aten.min.dim, (X_TIES, -1), {}),
        (aten.max.dim, (torch.tensor(3.0), 0), {}),
        (aten.argmax.default, (X_TIES,), {}),
        (aten.argmax.default, (X_TIES, 1), {}),
        (aten.argmax.default, (X_NAN, 1, True), {}),
        (aten.argmax.default, (X_NAN, None, True), {}),
        (aten.argmin.default, (X_TIES, 0), {}),
        (aten.argmin.default, (X_NAN, 1), {}),
        (aten.argmin.default, (torch.tensor(1.0), 0, True), {}),
    ),
)
def test_extreme_with_index_picks_first_and_nan(op, args, kwargs):
    """Index outputs are int64: the first extreme on ties, and a NaN counts as the extreme."""
    check(op, *args, **kwargs)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.var.correction, (X,), {}),
        (aten.var.correction, (X, [1]), {"correction": 0}),
        (aten.var.correction, (X, [0, 2]), {"correction": 2, "keepdim": True}),
        (aten.var.correction, (sample(3), None), {"correction": 5}),
        (aten.var.correction, (X_BF16, [-1]), {}),
        (aten.std.correction, (X, [1]), {"keepdim": True}),
        (aten.std.correction, (X_BF16,), {"correction": 0}),
        (aten.std.correction, (sample(1),), {}),
        (aten.var.dim, (X, [2]), {}),
        (aten.std.dim, (X, [0], False, True), {}),
        (aten.var_mean.correction, (X, [1]), {"correction": 0}),
        (aten.std_mean.correction, (X_BF16, [0, 1]), {"keepdim": True}),
        (aten.var_mean.dim, (X, [2], False), {}),
        (aten.std_mean.dim, (X, None), {}),
    ),
)
def test_moments_match_torch(op, args, kwargs):
    """Correction defaults to 1; a divisor N - correction <= 0 gives inf or NaN, never < 0."""
    check(op, *args, **kwargs)


@pytest.mark.parametrize(
    "args",
    [
        (X, [1]),
        (X, [0, 2], True),
        (X_BF16, [-1]),
        (X_INT, [1]),
        (torch.tensor([[-_INF, -_INF], [_INF, 1.0], [_NAN, 1.0]]), [1]),
    ],
    ids=["f32", "f32-keepdim", "bf16", "int", "inf-nan"],
)
def test_logsumexp_matches_torch(args):
    check(aten.logsumexp.default, *args)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.cumsum.default, (X, 1), {}),
        (aten.cumsum.default, (X_INT, -1), {}),
        (aten.cumsum.default, (X_BOOL, 0), {}),
        (aten.cumsum.default, (X_BF16, 2), {}),
        (aten.cumsum.default, (X_INT, 0), {"dtype": f32}),
        (aten.cumsum.default, (torch.tensor(2.0), 0), {}),
        (aten.cumprod.default, (sample(3, 6, low=0.5, high=1.5), 1), {}),
        (aten.cumprod.default, (sample(3, 6, dtype=i32, low=-3, high=3), -1), {"dtype": i64}),
        (aten.cummax.default, (X_NAN, 1), {}),
        (aten.cummax.default, (X_TIES, 1), {}),
        (aten.cummax.default, (X, 0), {}),
        (aten.cummin.default, (X_NAN, 1), {}),
        (aten.cummin.default, (X_TIES, -1), {}),
        (aten.cummin.default, (X_BOOL, 2), {}),
    ),
)
def test_scan_matches_torch(op, args, kwargs):
    """cummax/cummin index the last of equal extremes, and a NaN sticks until the next NaN."""
    check(op, *args, **kwargs)


_SORTABLE = {
    "f32-nan": torch.tensor(
        [[3.0, _NAN, -1.0, 3.0, -0.0, 0.0, _NAN, -_INF], [1, 1, 1, 2, 2, 2, 0, 0]]
    ),
    "bf16": sample(4, 9, dtype=bf16).round(),
    "i64": X_TIES.to(i64),
    "bool": X_BOOL,
}


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("x", list(_SORTABLE.values()), ids=list(_SORTABLE))
def test_stable_sort_keeps_ties_in_order(x, descending):
    """NaN sorts last ascending and first descending; equal elements keep their order both ways."""
    check(aten.sort.stable, x, stable=True, dim=-1, descending=descending)
    check(
        aten.sort.stable, x.transpose(0, -1).contiguous(), stable=True, dim=0, descending=descending
    )


@pytest.mark.parametrize("descending", [False, True])
def test_sort_without_ties_matches_torch(descending):
    """ATen's default sort promises nothing on ties, so these values are distinct."""
    x = torch.randperm(60, generator=torch.Generator().manual_seed(1)).reshape(3, 4, 5).float()
    check(aten.sort.default, x, 1, descending)
    check(aten.sort.default, torch.tensor(1.5))


@pytest.mark.parametrize(
    "args",
    [
        (X, 3),
        (X, 2, 0, False),
        (torch.tensor([[1.0, _NAN, 3.0, _NAN, 2.0]]), 3),
        (torch.tensor([[1.0, _NAN, 3.0, _NAN, 2.0]]), 4, -1, False),
        (sample(2, 9, dtype=i32, low=-50, high=50), 4, 1, True, True),
        (X_BF16, 1, 1),
    ],
    ids=["largest", "smallest-dim0", "nan-largest", "nan-smallest", "int", "bf16-k1"],
)
def test_topk_matches_torch(args):
    """Values as torch's; ATen leaves the order of equal values (NaNs too) open, so the indices
    need only be int64 and point at the values."""
    values, indices = lowered(aten.topk.default, *args)
    expected_values, expected_indices = reference(aten.topk.default, *args)
    assert_close(values, expected_values)
    assert indices.dtype == expected_indices.dtype
    dim = args[2] if len(args) > 2 else -1
    assert_close(args[0].gather(dim, indices), expected_values)


@pytest.mark.parametrize(
    "op, args, kwargs",
    cases(
        (aten.linalg_vector_norm.default, (X,), {}),
        (aten.linalg_vector_norm.default, (X, 1, [1]), {}),
        (aten.linalg_vector_norm.default, (X, _INF, [0, 2], True), {}),
        (aten.linalg_vector_norm.default, (X, -_INF, [-1]), {}),
        (aten.linalg_vector_norm.default, (X, 0, [1]), {}),
        (aten.linalg_vector_norm.default, (X, 3.5, None), {}),
        (aten.linalg_vector_norm.default, (X_BF16, 2, [1]), {}),
        (aten.linalg_vector_norm.default, (X_BF16,), {"dtype": f32}),
        (aten.norm.ScalarOpt_dim, (X, None, [1]), {}),
        (aten.norm.ScalarOpt_dim, (X, 1, [0, 1], True), {}),
        (aten.norm.Scalar, (X, 3), {}),
        (aten.norm.ScalarOpt_dtype, (X_BF16, 2), {"dtype": f32}),
        (aten.norm.ScalarOpt_dim_dtype, (X, _INF, [2], False), {"dtype": f64}),
    ),
)
def test_norm_matches_torch(op, args, kwargs):
    check(op, *args, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((7,), {}),
        ((13,), {"range": (-1.3, 2.1)}),
        ((5,), {"weight": "w", "density": True}),
        ((torch.tensor([-2.0, 0.0, 0.5, 3.0]),), {"weight": "w"}),
        ((torch.tensor([-1.0, 0.25, 1.0]),), {"density": True}),
    ],
)
def test_histogram_is_lowered_and_matches_cpu(args, kwargs):
    """histogram (which has no meta kernel in PyTorch) runs on the device: counts (or summed
    weights, or densities) equal CPU's; elements outside the edges are left out, the last bin is
    closed. The edges follow ATen's scalar linspace; CPU's vector loops round some points by
    the CPU's vector width, so they are compared to within float32 rounding."""
    import spmd_torch.debug.metrics as met

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 25, generator=g)
    w = torch.rand(40, 25, generator=g)
    kwargs = {k: (w if v == "w" else v) for k, v in kwargs.items()}
    hist, edges = torch.histogram(x, *args, **kwargs)
    before = met.counter_value("aten::histogram")
    device_args = [a.to("xla") if isinstance(a, torch.Tensor) else a for a in args]
    device_kwargs = {
        k: (v.to("xla") if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()
    }
    got_hist, got_edges = torch.histogram(x.to("xla"), *device_args, **device_kwargs)
    assert met.counter_value("aten::histogram") == before  # not run on the CPU
    assert_close(got_edges.cpu(), edges, tol="single_op")
    assert_close(got_hist.cpu(), hist, tol="single_op")


def test_histogram_of_nothing_and_of_one_value():
    """numpy's conventions, as CPU's: no data spans [0, 1]; one value, that value +- 0.5."""
    for x in (torch.empty(0), torch.full((5,), 3.0)):
        hist, edges = torch.histogram(x.to("xla"), 4)
        expected_hist, expected_edges = torch.histogram(x, 4)
        assert torch.equal(edges.cpu(), expected_edges) and torch.equal(hist.cpu(), expected_hist)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bins": [3, 4, 5]},
        {"bins": [2, 3, 2], "range": [-1.0, 1.0, -2.0, 2.0, 0.0, 1.0]},
        {"bins": 4, "weight": "w", "density": True},
        {"bins": "edges"},
    ],
)
def test_histogramdd_is_lowered_and_matches_cpu(kwargs):
    """histogramdd (no meta kernels in PyTorch) runs on the device: each point's cell from its
    coordinates' bins, weights and densities as CPU's; given edges, or equal bins over each
    column's range."""
    import spmd_torch.debug.metrics as met

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 25, 3, generator=g), torch.rand(2, 25, generator=g)
    edges = [
        torch.tensor([-2.0, 0.0, 1.0, 3.0]),
        torch.tensor([-1.0, 1.0]),
        torch.linspace(-3, 3, 5),
    ]
    kwargs = {
        k: {"w": w, "edges": edges}.get(v, v) if isinstance(v, str) else v
        for k, v in kwargs.items()
    }
    hist, bin_edges = torch.histogramdd(x, **kwargs)
    met.clear_all()
    on_device = {k: _to_xla(v) for k, v in kwargs.items()}
    got_hist, got_edges = torch.histogramdd(x.to("xla"), **on_device)
    assert met.executed_fallback_ops() == []
    for got, expected in zip(got_edges, bin_edges, strict=True):
        assert_close(got.cpu(), expected, tol="single_op")
    assert_close(got_hist.cpu(), hist, tol="single_op")


def _to_xla(value):
    """A tensor, or each tensor of a list, on the xla device; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to("xla")
    if isinstance(value, list) and isinstance(value[0], torch.Tensor):
        return [v.to("xla") for v in value]
    return value
