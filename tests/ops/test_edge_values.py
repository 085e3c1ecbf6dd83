"""Lowerings at the values OpInfo samples miss: bool scatter_add, complex sgn at zero, inf and NaN,
isneginf/isposinf in half precision, searchsorted over rows and with a sorter, float class targets,
polygamma and zeta at poles and negative arguments, histc's ranges, bucketize, logspace,
index_reduce and put over repeated indices, renorm, the Bessel functions, erfcx and airy_ai across
their ranges, adaptive max pools' backward, pdist at zero distances, hash_tensor's bits per dtype,
ormqr on batches of rectangular factors, segment_reduce with empty segments, ties and zeros,
arange's non-finite bounds."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from tests.helpers import assert_matches_eager, matches_eager


def test_scatter_add_on_bool_is_a_logical_or():
    index = torch.tensor([[0, 1, 2, 0, 0], [2, 0, 0, 1, 2]])
    src = torch.tensor([[True, False, True, True, False], [True, True, False, False, True]])
    assert_matches_eager(
        lambda b, i, s: b.scatter_add(0, i, s), torch.zeros(3, 5, dtype=torch.bool), index, src
    )


def test_sgn_of_complex_zero_inf_and_nan():
    inf, nan = float("inf"), float("nan")
    values = [complex(inf, -inf), complex(nan, nan), 0j, complex(inf, 0), complex(-inf, 0), 3 + 4j]
    assert_matches_eager(torch.sgn, torch.tensor(values, dtype=torch.complex64))


@pytest.mark.parametrize("op", [torch.isneginf, torch.isposinf])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int64])
def test_isneginf_isposinf(op, dtype):
    values = torch.tensor([float("-inf"), -1, 0, float("inf"), float("nan")])
    if dtype == torch.int64:
        values = torch.tensor([-(2**40), 0, 7])
    assert_matches_eager(op, values.to(dtype))


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_rows_scalar_and_sorter(right):
    rows = torch.tensor([[1, 3, 5, 7, 9], [2, 4, 6, 8, 10]])
    values = torch.tensor([[3, 6, 9], [0, 6, 11]])
    assert_matches_eager(lambda s, v: torch.searchsorted(s, v, right=right), rows, values)
    assert_matches_eager(
        lambda s, v: torch.searchsorted(s, v, right=right, out_int32=True), rows[0], values
    )
    shuffled, sorter = torch.tensor([5, 1, 9, 3, 7]), torch.tensor([1, 3, 0, 4, 2])
    assert_matches_eager(
        lambda s, v, o: torch.searchsorted(s, v, sorter=o, right=right), shuffled, values, sorter
    )
    assert_matches_eager(lambda s: torch.searchsorted(s, 5, right=right), rows[0])


@pytest.mark.parametrize("shape", [(6, 5), (2, 5, 3, 4)], ids=["nll_loss", "nll_loss2d"])
def test_cross_entropy_takes_float_class_indices_as_pytorch_xla_does(shape):
    """PyTorch/XLA accepts float class indices as targets (its SPMD tests train so); CPU PyTorch
    wants integers, so the reference is CPU with the same indices as int64: loss and gradient."""
    import spmd_torch

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=gen)
    target = torch.randint(0, 5, (shape[0], *shape[2:]), generator=gen)
    x = logits.to(spmd_torch.device()).requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(x, target.float().to(spmd_torch.device()))
    loss.backward()
    reference = logits.clone().requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(reference, target)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.cpu(), reference.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.flip(0, 3),
        lambda x: x.sum(3),
        lambda x: torch.max(x[:, :0], dim=1),
        lambda x: torch.min(x[:, :0], dim=-2),
        lambda x: torch.max(x[:, :0]),
        lambda x: torch.min(x[:, :0]),
    ],
    ids=["flip", "sum", "max_dim", "min_dim", "max", "min"],
)
def test_dimension_checks_raise_at_the_call_as_cpu_does(op):
    """An out-of-range dim, and max/min over nothing, raise when the op is called (not at the
    barrier, in JAX's words) with CPU PyTorch's message; an IndexError there is here also a
    RuntimeError, the type PyTorch/XLA raises."""
    x = torch.rand(2, 3, 4)
    with pytest.raises(Exception) as on_cpu:
        op(x)
    with pytest.raises(type(on_cpu.value)) as on_xla:
        op(x.to("xla"))
    assert str(on_cpu.value) in str(on_xla.value)
    assert isinstance(on_xla.value, RuntimeError)


@pytest.mark.parametrize(
    "bounds", [(-5, float("nan")), (float("nan"), 5), (0, float("inf")), (float("nan"),)]
)
def test_arange_of_a_non_finite_bound_raises_cpus_error(bounds):
    with pytest.raises(RuntimeError) as on_cpu:
        torch.arange(*bounds)
    with pytest.raises(RuntimeError) as on_xla:
        torch.arange(*bounds, device="xla")
    assert str(on_xla.value) == str(on_cpu.value)  # "unsupported range: -5 -> nan"


def test_digamma_polygamma_zeta_at_poles_and_negative_arguments():
    """ATen's values at +-0, at negative integers and below zero, where jax.scipy's differ."""
    x = torch.tensor([-10.3, -3.5, -2.0, -0.5, -0.0, 0.0, 1e-3, 0.5, 2.0, 9.3, float("nan")])
    for n in range(5):
        assert_matches_eager(lambda t: torch.polygamma(n, t), x)
    assert_matches_eager(lambda t: torch.special.zeta(3.0, t), x)
    assert_matches_eager(lambda t: torch.special.zeta(3.5, t), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "bins, lo, hi", [(4, 0, 0), (5, 2.5, 2.5), (3, -1, 1), (6, 0.25, 0.75)], ids=str
)
def test_histc_ranges(dtype, bins, lo, hi):
    """min == max takes the data's range; elements outside [min, max] (and NaN, where the
    range is given: CPU raises on a NaN range) are dropped; the last bin is closed."""
    values = [-2.0, -1.0, 0.0, 0.25, 0.5, 0.75, 1.0, 3.0] + ([float("nan")] if lo != hi else [])
    values = torch.tensor(values, dtype=dtype)
    assert_matches_eager(lambda t: torch.histc(t, bins, lo, hi), values)
    assert_matches_eager(lambda t: torch.histc(t, bins, lo, hi), values[:0])


def test_histc_of_one_repeated_value_widens_the_range():
    assert_matches_eager(lambda t: torch.histc(t, 4), torch.full((5,), 3.0))


@pytest.mark.parametrize("right", [False, True])
def test_bucketize_sides_and_scalar(right):
    boundaries = torch.tensor([1.0, 3.0, 3.0, 5.0])
    values = torch.tensor([[0.0, 1.0, 3.0], [4.0, 5.0, 6.0]])
    assert_matches_eager(lambda v, b: torch.bucketize(v, b, right=right), values, boundaries)
    assert_matches_eager(
        lambda v, b: torch.bucketize(v, b, right=right, out_int32=True), values, boundaries
    )
    assert_matches_eager(lambda b: torch.bucketize(3.0, b, right=right), boundaries)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_logspace_tensor_ends_base_and_one_step(dtype):
    start, end = torch.tensor(-1.5), torch.tensor(2.0)
    assert_matches_eager(lambda s, e: torch.logspace(s, e, 7, base=2, dtype=dtype), start, end)
    assert_matches_eager(lambda s, e: torch.logspace(s, e, 1, dtype=dtype), start, end)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_index_reduce_repeated_and_untouched_rows(reduce, include_self, dtype):
    x = torch.arange(12).reshape(4, 3).to(dtype) - 5
    source = torch.tensor([[3, -1, 2], [7, 4, -6], [1, 1, 9]]).to(dtype)
    index = torch.tensor([2, 0, 2])
    assert_matches_eager(
        lambda x, i, s: x.index_reduce(0, i, s, reduce, include_self=include_self),
        x,
        index,
        source,
    )


def test_cauchy_log_normal_geometric_sample_their_laws():
    """The device's PRNG stream differs from CPU's, so OpInfo can't compare values: check each
    law on many draws instead (medians, quartiles, means, the support)."""
    x = torch.empty(200_000, device="xla")
    cauchy = x.cauchy_(median=2.0, sigma=3.0).cpu()
    quartiles = cauchy.quantile(torch.tensor([0.25, 0.5, 0.75]))
    torch.testing.assert_close(quartiles, torch.tensor([-1.0, 2.0, 5.0]), rtol=0, atol=0.05)
    log_normal = x.log_normal_(mean=0.5, std=0.25).cpu().log()
    assert abs(log_normal.mean() - 0.5) < 0.005 and abs(log_normal.std() - 0.25) < 0.005
    geometric = x.geometric_(0.2).cpu()
    assert geometric.min() == 1 and geometric.eq(geometric.round()).all()
    assert abs(geometric.mean() - 5.0) < 0.05


@pytest.mark.parametrize(
    "op",
    [
        torch.special.bessel_j0,
        torch.special.bessel_j1,
        torch.special.bessel_y0,
        torch.special.bessel_y1,
        torch.special.modified_bessel_k0,
        torch.special.modified_bessel_k1,
        torch.special.scaled_modified_bessel_k0,
        torch.special.scaled_modified_bessel_k1,
        torch.special.erfcx,
        torch.special.airy_ai,
    ],
    ids=lambda op: op.__name__,
)
def test_series_and_expansions_across_their_ranges(op):
    """Series and expansions meet at 1 (K), 20 (J, Y), 25 (erfcx), -8 and 5 (Ai): values on both
    sides, the far tails, 0, negative arguments, inf and NaN."""
    special = [float("-inf"), -8.001, -8.0, -2.0, -0.0, 0.0, 1e-30, 0.999, 1.0, 5.0, 5.001, 19.999]
    special += [20.0, 25.0, 1e5]
    values = torch.cat([torch.linspace(-40, 40, 801), torch.logspace(-6, 3, 200)])
    values = torch.cat([values, torch.tensor(special + [float("inf"), float("nan")])])
    assert_matches_eager(op, values)


@pytest.mark.parametrize("accumulate", [False, True])
def test_put_negative_and_repeated_indices(accumulate):
    index = (
        torch.tensor([[-1, 0], [5, -12]]) if not accumulate else torch.tensor([[-1, 11], [0, 0]])
    )
    source = torch.tensor([[1.5, -2.0], [3.0, 4.0]])
    assert_matches_eager(
        lambda x, i, s: x.put(i, s, accumulate=accumulate), torch.rand(3, 4), index, source
    )


@pytest.mark.parametrize("p", [1, 2, 3.5, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_renorm_norms_and_slices_below_maxnorm(p, dtype):
    x = torch.tensor([[0.1, -0.2, 0.1], [3.0, -4.0, 12.0], [0.0, 0.0, 0.0]], dtype=dtype)
    assert_matches_eager(lambda t: t.renorm(p, 0, 1.0), x)
    assert_matches_eager(lambda t: t.renorm(p, -1, 2.0), x)


@pytest.mark.parametrize("nd", [2, 3])
def test_adaptive_max_pool_backward_scatters_onto_the_indices(nd):
    """Called directly with CPU's indices: adaptive_max_pool2d's forward has no lowering yet."""
    x = torch.randn(2, 3, *[7] * nd, generator=torch.Generator().manual_seed(0))
    pool = torch.ops.aten.adaptive_max_pool2d if nd == 2 else torch.ops.aten.adaptive_max_pool3d
    out, indices = pool(x, [3] * nd)
    backward = getattr(torch.ops.aten, f"adaptive_max_pool{nd}d_backward")
    assert_matches_eager(backward, torch.randn_like(out), x, indices)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_pdist_norms_with_repeated_rows(p):
    """Equal rows (distance 0) and equal coordinates (difference 0) get a zero gradient."""
    x = torch.tensor([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5], [0.0, 2.0, -1.0], [3.0, -1.0, 0.5]])
    assert_matches_eager(lambda t: torch.nn.functional.pdist(t, p), x, grad=True)


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor([[1.0, -0.0, float("inf")], [3.5, float("nan"), -2.0]]),
        torch.tensor([[1.0, -0.0, 7.0], [3.5, 0.25, -2.0]], dtype=torch.bfloat16),
        torch.tensor([[-1, 5, 2**40], [0, -(2**62), 3]]),
        torch.tensor([[-1, 5, 9], [0, -7, 3]], dtype=torch.int32),
        torch.tensor([[True, False, True], [True, True, False]]),
    ],
    ids=["float32", "bfloat16", "int64", "int32", "bool"],
)
def test_hash_tensor_dtypes_and_dims(x):
    assert_matches_eager(torch.hash_tensor, x)
    assert_matches_eager(lambda t: torch.hash_tensor(t, dim=1), x)
    assert_matches_eager(lambda t: torch.hash_tensor(t, dim=0, keepdim=True), x)


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("transpose", [False, True])
def test_ormqr_batched_rectangular(left, transpose):
    a, tau = torch.geqrf(torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0)))
    other = torch.randn(2, 5, 4) if left else torch.randn(2, 4, 5)
    assert_matches_eager(
        lambda a, t, o: torch.ormqr(a, t, o, left=left, transpose=transpose), a, tau, other
    )


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "max", "min"])
@pytest.mark.parametrize("initial", [None, 2.0])
def test_segment_reduce_with_empty_segments_ties_and_zeros(reduce, initial):
    """Forward and gradient; rows of equal values (max/min share the gradient) and zeros (prod's
    gradient), an empty segment, and a reduction along axis 1 with per-row lengths."""
    data = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0, 0.0, 0.0], [4.0, -1.0, 0.0, 2.0, 2.0, 5.0, 1.0]])
    lengths = torch.tensor([2, 0, 3, 2])
    kwargs = {"initial": initial} if initial is not None else {}
    assert_matches_eager(
        lambda d, n: torch.segment_reduce(d, reduce, lengths=n, axis=1, unsafe=True, **kwargs),
        data,
        lengths.expand(2, 4),
        grad=True,
    )
    offsets = torch.tensor([0, 2, 2, 5, 7])
    assert_matches_eager(
        lambda d, o: torch.segment_reduce(d, reduce, offsets=o, **kwargs),
        data.T,
        offsets,
        grad=True,
    )


def test_pow_reads_a_python_exponent_by_value_and_type():
    """The exponent is static in the node: ``x ** 2.0`` is not run as the int64 program ``x ** 2``
    compiled (3037000500 ** 2 overflows int64, not float32), and a floating base's exponent is
    read by value, as ATen's kernels read it (-2 and -2.0 are both 1 / (x * x))."""
    big = torch.tensor([3037000500, 7])
    for exponent in (2, 2.0, 3, 3.0, True):  # products: eager's own bits on any CPU
        matches_eager(lambda x, e=exponent: x**e, big, tol="exact", eager_bits=True)()
    assert_matches_eager(lambda x: x**2.5, big)
    y = torch.rand(64) * 10 + 0.01
    for exponent in (-2.0, -2, 3.0, 3, 1, 0.0, False, -1):
        matches_eager(lambda x, e=exponent: x**e, y, tol="exact", eager_bits=True)()


def test_pow_by_half_is_sqrt_and_rsqrt():
    """As ATen's kernels compute ``x ** 0.5`` and ``x ** -0.5``: the same values as torch.sqrt and
    torch.rsqrt here, with sqrt's edge values (-0.0 stays -0.0, -inf gives NaN)."""
    x = torch.tensor([0.25, 2.0, 9.0, 1e-30, -0.0, float("-inf"), float("inf"), -1.0])
    on_device = spmd_torch.device()
    for exponent, op in ((0.5, torch.sqrt), (-0.5, torch.rsqrt)):
        got = (x.to(on_device) ** exponent).cpu()
        assert torch.equal(got.isnan(), op(x).isnan())
        finite = ~got.isnan()
        assert torch.equal(got[finite], op(x.to(on_device)).cpu()[finite])
        assert torch.equal(got[finite].signbit(), op(x)[finite].signbit())
    assert_matches_eager(lambda t: t**0.5, x)
