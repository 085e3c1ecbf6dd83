"""Lowerings: reductions, scans, sort and top-k.

Integer sums widen to int64 and bfloat16/float16 accumulate in float32, as ATen's accumulate types
do. Index outputs are int64 and follow ATen's tie and NaN rules: max/argmax pick the first
extreme, a NaN counts as the extreme, cummax/cummin pick the last, sort is stable with NaN last.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ._helpers import category, float_dtype, opmath
from .dtypes import to_jax_dtype, to_torch_dtype
from .factories import _linspace
from .registry import lowers, meta_kernel, register_table

aten = torch.ops.aten


def _axes(x, dim, empty=None):
    """The axes an ATen dim (int, list or None) names. None is every axis, and so is [] except
    where the op says (any/all.dims reduce nothing); a 0-dim tensor accepts dim 0 and -1."""
    if dim is None:
        return None
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    if not dims:
        return empty
    return () if x.ndim == 0 else dims


def _on_vector_if_scalar(fn):
    """Ops along one dim treat a 0-dim tensor as a one-element vector, and return 0-dim results."""

    def lowering(x, *args, **kwargs):
        if x.ndim:
            return fn(x, *args, **kwargs)
        return jax.tree.map(lambda r: r.reshape(()), fn(x.reshape(1), *args, **kwargs))

    return lowering


def _sum_dtype(x, dtype):
    """The dtype sum/prod/cumsum return: the requested one, else int64 for integer and bool."""
    if dtype is not None:
        return to_jax_dtype(dtype)
    return jnp.dtype(jnp.int64) if category(x.dtype) < 2 else x.dtype


def _accumulating(fn):
    """sum/prod/mean: cast to the result dtype, accumulate in its opmath, round once at the end."""

    def lowering(x, dim=None, keepdim=False, *, dtype=None):
        out = _sum_dtype(x, dtype)
        acc = fn(x.astype(out), _axes(x, dim), dtype=opmath(out), keepdims=keepdim)
        return acc.astype(out)

    return lowering


register_table(
    {
        (aten.sum.default, aten.sum.dim_IntList): jnp.sum,
        (aten.prod.default, aten.prod.dim_int): jnp.prod,
        (aten.mean.default, aten.mean.dim): jnp.mean,
    },
    adapt=_accumulating,
)


def _extreme(fn):
    return lambda x, dim=None, keepdim=False: fn(x, _axes(x, dim), keepdims=keepdim)


def _all_or_any(fn):
    """any/all.dims with an empty list reduce nothing (they only convert to bool)."""
    return lambda x, dim=None, keepdim=False: fn(x, _axes(x, dim, empty=()), keepdims=keepdim)


register_table(
    {
        (aten.amax.default, aten.max.default): jnp.max,
        (aten.amin.default, aten.min.default): jnp.min,
        aten.count_nonzero.dim_IntList: jnp.count_nonzero,
        aten.count_nonzero.default: jnp.count_nonzero,
    },
    adapt=_extreme,
)
register_table(
    {
        (aten.any.default, aten.any.dim, aten.any.dims): jnp.any,
        (aten.all.default, aten.all.dim, aten.all.dims): jnp.all,
    },
    adapt=_all_or_any,
)


def _along(fn):
    return lambda x, dim=None, keepdim=False: fn(x, dim, keepdims=keepdim)


def _with_index(fn, arg_fn):
    """max/min.dim: the extreme value and the index of its first occurrence (NaN wins)."""
    return lambda x, dim, keepdim=False: (
        _along(fn)(x, dim, keepdim),
        _along(arg_fn)(x, dim, keepdim),
    )


register_table(
    {
        aten.max.dim: _with_index(jnp.max, jnp.argmax),
        aten.min.dim: _with_index(jnp.min, jnp.argmin),
        aten.argmax.default: _along(jnp.argmax),
        aten.argmin.default: _along(jnp.argmin),
    },
    adapt=_on_vector_if_scalar,
)


def _variance(x, dim, correction, keepdim):
    """In opmath, not yet rounded. ATen's divisor is max(0, N - correction): too large a correction
    gives inf, not a negative variance."""
    y = x.astype(opmath(x.dtype))
    axes = _axes(x, dim)
    n = math.prod(y.shape[a] for a in (range(y.ndim) if axes is None else axes))
    centered = y - jnp.mean(y, axes, keepdims=True)
    sum_sq = jnp.sum(centered * centered, axes, keepdims=keepdim)
    return sum_sq / max(0, n - correction)


def _var(x, dim, correction, keepdim):
    return _variance(x, dim, correction, keepdim).astype(x.dtype)


def _std(x, dim, correction, keepdim):
    return jnp.sqrt(_variance(x, dim, correction, keepdim)).astype(x.dtype)


def _mean(x, dim, keepdim):
    return jnp.mean(x, _axes(x, dim), dtype=opmath(x.dtype), keepdims=keepdim).astype(x.dtype)


def _var_mean(x, dim, correction, keepdim):
    return _var(x, dim, correction, keepdim), _mean(x, dim, keepdim)


def _std_mean(x, dim, correction, keepdim):
    return _std(x, dim, correction, keepdim), _mean(x, dim, keepdim)


def _with_correction(stat):
    def lowering(x, dim=None, *, correction=None, keepdim=False):
        return stat(x, dim, 1 if correction is None else correction, keepdim)

    return lowering


def _with_unbiased(stat):
    def lowering(x, dim=None, unbiased=True, keepdim=False):
        return stat(x, dim, int(unbiased), keepdim)

    return lowering


_MOMENTS = {"var": _var, "std": _std, "var_mean": _var_mean, "std_mean": _std_mean}
register_table(
    {getattr(aten, name).correction: stat for name, stat in _MOMENTS.items()},
    adapt=_with_correction,
)
register_table(
    {getattr(aten, name).dim: stat for name, stat in _MOMENTS.items()}, adapt=_with_unbiased
)


@lowers(aten.logsumexp.default)
def _logsumexp(x, dim, keepdim=False):
    out = float_dtype(x.dtype)
    return jax.nn.logsumexp(x.astype(opmath(out)), _axes(x, dim), keepdims=keepdim).astype(out)


def _scan(fn):
    """cumsum/cumprod: like sum, integers widen to int64 and bf16/f16 accumulate in float32."""

    def lowering(x, dim, *, dtype=None):
        out = _sum_dtype(x, dtype)
        return fn(x.astype(out), dim, dtype=opmath(out)).astype(out)

    return lowering


register_table(
    {aten.cumsum.default: _scan(jnp.cumsum), aten.cumprod.default: _scan(jnp.cumprod)},
    adapt=_on_vector_if_scalar,
)


def _cumulative_extreme(later_wins):
    """cummax/cummin as a scan over (value, index): a later element replaces the running one on a
    tie, and a NaN, once seen, is only replaced by a later NaN (ATen's loop, made associative)."""

    def combine(a, b):
        take = jnp.isnan(b[0]) | (~jnp.isnan(a[0]) & later_wins(b[0], a[0]))
        return jnp.where(take, b[0], a[0]), jnp.where(take, b[1], a[1])

    def lowering(x, dim):
        dim %= x.ndim
        index = lax.broadcasted_iota(jnp.int64, x.shape, dim)
        return lax.associative_scan(combine, (x, index), axis=dim)

    return lowering


register_table(
    {
        aten.cummax.default: _cumulative_extreme(jnp.greater_equal),
        aten.cummin.default: _cumulative_extreme(jnp.less_equal),
    },
    adapt=_on_vector_if_scalar,
)


def _sort(x, dim=-1, descending=False):
    """Stable, NaN last. Descending sorts the reversed axis ascending and reverses back, which puts
    NaN first and keeps equal elements in their original order, as ATen's stable sort does."""
    dim %= x.ndim
    index = lax.broadcasted_iota(jnp.int64, x.shape, dim)
    if descending:
        x, index = jnp.flip(x, dim), jnp.flip(index, dim)
    values, index = lax.sort((x, index), dimension=dim, is_stable=True, num_keys=1)
    if descending:
        values, index = jnp.flip(values, dim), jnp.flip(index, dim)
    return values, index


def _topk(x, k, dim=-1, largest=True, sorted=True):
    """The first k of a full sort: NaN counts as the largest, ties keep the lower index."""
    dim %= x.ndim
    return tuple(lax.slice_in_dim(r, 0, k, axis=dim) for r in _sort(x, dim, largest))


register_table(
    {
        aten.sort.default: _sort,
        aten.sort.stable: lambda x, *, stable=None, dim=-1, descending=False: _sort(
            x, dim, descending
        ),
        aten.topk.default: _topk,
    },
    adapt=_on_vector_if_scalar,
)


@lowers(aten.linalg_vector_norm.default)
def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """In float32 for bf16/f16; ord inf/-inf/0 are max|x|, min|x| and the nonzero count."""
    out = x.dtype if dtype is None else to_jax_dtype(dtype)
    y = x.astype(opmath(out))
    return jnp.linalg.vector_norm(y, axis=_axes(x, dim), keepdims=keepdim, ord=ord).astype(out)


@lowers(
    aten.norm.Scalar,
    aten.norm.ScalarOpt_dim,
    aten.norm.ScalarOpt_dtype,
    aten.norm.ScalarOpt_dim_dtype,
)
def _norm(x, p=2, dim=None, keepdim=False, *, dtype=None):
    return _vector_norm(x, 2 if p is None else p, dim, keepdim, dtype=dtype)


@lowers(aten.hash_tensor.default)
def _hash_tensor(x, dim=(), *, keepdim=False, mode=0):
    """ATen's mode 0 (its only one): the XOR of every element's bits as uint64, floats widened
    to float64 first, integers and bools sign-extended."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.bitcast_convert_type(x.astype(jnp.float64), jnp.uint64)
    else:
        bits = x.astype(jnp.int64).astype(jnp.uint64)
    return jnp.bitwise_xor.reduce(bits, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.renorm.default)
def _renorm(x, p, dim, maxnorm):
    """Each slice along ``dim`` whose p-norm exceeds maxnorm is scaled down to it, by ATen's
    factor maxnorm / (norm + 1e-7), computed in float32 for bf16/f16 and rounded to x's dtype."""
    others = [d for d in range(x.ndim) if d != dim % x.ndim]
    y = x.astype(opmath(x.dtype))
    norm = jnp.linalg.vector_norm(y, ord=p, axis=tuple(others), keepdims=True)
    factor = jnp.where(norm > maxnorm, maxnorm / (norm + 1e-7), 1).astype(x.dtype)
    return x * factor


# --- segment_reduce: segments of consecutive elements along ``axis``, as a (segment, position) mask


_SEGMENT_IDENTITY = {"sum": 0, "mean": 0, "prod": 1, "max": -math.inf, "min": math.inf}
_SEGMENT_REDUCE = {
    "sum": jnp.sum,
    "mean": jnp.sum,
    "prod": jnp.prod,
    "max": jnp.max,
    "min": jnp.min,
}
_SEGMENT_WITH_INITIAL = {
    "sum": jnp.add,
    "mean": jnp.add,
    "prod": jnp.multiply,
    "max": jnp.maximum,
    "min": jnp.minimum,
}


def _segment_lengths(lengths, offsets):
    return jnp.diff(offsets, axis=-1) if lengths is None else lengths


def _segment_mask(lengths, data, axis):
    """(*data.shape[:axis], S, N, 1, ...): whether position n along axis lies in segment s, shaped
    to broadcast against data with a segment axis inserted before ``axis``."""
    ends = jnp.cumsum(lengths, -1)[..., None]
    position = jnp.arange(data.shape[axis])
    mask = (position >= ends - lengths[..., None]) & (position < ends)
    return mask.reshape(mask.shape + (1,) * (data.ndim - axis - 1))


def _per_position(values, mask, axis):
    """Each position's segment's value: ``values`` (a segment axis at ``axis``) taken along it."""
    return jnp.take_along_axis(values, jnp.argmax(mask, axis=axis), axis)


@lowers(aten.segment_reduce.default)
def _segment_reduce(
    data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None
):
    """Each segment reduced, starting from ``initial`` where given; an empty segment is initial,
    else the identity (NaN for mean). Computed in float32 for bf16/f16."""
    axis %= data.ndim
    lengths = _segment_lengths(lengths, offsets)
    mask = _segment_mask(lengths, data, axis)
    x = jnp.expand_dims(data.astype(opmath(data.dtype)), axis)
    out = _SEGMENT_REDUCE[reduce](jnp.where(mask, x, _SEGMENT_IDENTITY[reduce]), axis=axis + 1)
    if initial is not None:
        out = _SEGMENT_WITH_INITIAL[reduce](out, initial)
    if reduce == "mean":
        count = lengths.reshape(lengths.shape + (1,) * (data.ndim - axis - 1))
        empty = jnp.nan if initial is None else initial
        out = jnp.where(count == 0, empty, out / jnp.maximum(count, 1))
    return out.astype(data.dtype)


@lowers(aten._segment_reduce_backward.default)
def _segment_reduce_backward(
    grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None
):
    """ATen's rules: max/min give a segment's gradient to the elements equal to its result (NaN
    matching NaN), shared among them only where it is positive (ATen divides only those); prod
    gives output / x, or where x is 0 the product of the others (0 if another is zero)."""
    axis %= data.ndim
    lengths = _segment_lengths(lengths, offsets)
    mask = _segment_mask(lengths, data, axis)
    x = data.astype(opmath(data.dtype))
    g, out = grad.astype(x.dtype), output.astype(x.dtype)
    if reduce == "mean":
        count = lengths.reshape(lengths.shape + (1,) * (data.ndim - axis - 1))
        g = g / jnp.maximum(count, 1)
    if reduce in ("max", "min"):
        result = _per_position(out, mask, axis)
        picked = (x == result) | (jnp.isnan(x) & jnp.isnan(result))
        ties = jnp.sum(jnp.where(mask, jnp.expand_dims(picked, axis), 0), axis=axis + 1)
        g = jnp.where(g > 0, g / jnp.maximum(ties, 1), g)
        return jnp.where(picked, _per_position(g, mask, axis), 0).astype(data.dtype)
    if reduce == "prod":
        expanded = jnp.expand_dims(x, axis)
        zeros = jnp.sum(mask & (expanded == 0), axis=axis + 1)
        others = jnp.prod(jnp.where(mask & (expanded != 0), expanded, 1), axis=axis + 1)
        others = others * (1 if initial is None else initial)
        at_zero = _per_position(g * jnp.where(zeros == 1, others, 0), mask, axis)
        elsewhere = _per_position(g * out, mask, axis) / jnp.where(x == 0, 1, x)
        return jnp.where(x == 0, at_zero, elsewhere).astype(data.dtype)
    return _per_position(g, mask, axis).astype(data.dtype)


# --- order statistics: one stable sort (NaN last), then a position ------------------------------


def _at_position(x, dim, keepdim, position):
    """(value, index) at ``position`` (an int or an array without ``dim``) of the stable sort."""
    dim %= x.ndim
    values, index = _sort(x, dim)
    position = jnp.expand_dims(jnp.asarray(position), dim)
    value = jnp.take_along_axis(values, position, dim)
    chosen = jnp.take_along_axis(index, position, dim)
    return (value, chosen) if keepdim else (value.squeeze(dim), chosen.squeeze(dim))


def _kthvalue(x, k, dim=-1, keepdim=False):
    dim %= x.ndim
    return _at_position(x, dim, keepdim, jnp.full(_without(x.shape, dim), k - 1))


def _median_dim(x, dim=-1, keepdim=False):
    """The lower median; a NaN in the slice is the result, with the index of the first NaN."""
    dim %= x.ndim
    value, index = _at_position(
        x, dim, True, jnp.full(_without(x.shape, dim), (x.shape[dim] - 1) // 2)
    )
    nan = jnp.isnan(x)
    has_nan = nan.any(dim, keepdims=True)
    value = jnp.where(has_nan, jnp.nan, value).astype(x.dtype)
    index = jnp.where(has_nan, jnp.argmax(nan, dim, keepdims=True), index)
    return (value, index) if keepdim else (value.squeeze(dim), index.squeeze(dim))


def _nanmedian_dim(x, dim=-1, keepdim=False):
    """The lower median of the non-NaN elements (NaN sorts last); all NaN gives NaN."""
    dim %= x.ndim
    count = (~jnp.isnan(x)).sum(dim)
    return _at_position(x, dim, keepdim, jnp.maximum(count - 1, 0) // 2)


def _without(shape, dim):
    return shape[:dim] + shape[dim + 1 :]


def _mode(x, dim=-1, keepdim=False):
    """The most frequent value (the smallest on a tie) and the last index holding it."""
    dim %= x.ndim
    moved = jnp.moveaxis(x, dim, -1)
    equal = moved[..., :, None] == moved[..., None, :]
    counts = equal.sum(-1)
    best = counts.max(-1, keepdims=True)
    value = jnp.where(counts == best, moved, moved.max(-1, keepdims=True)).min(-1)
    positions = jnp.arange(moved.shape[-1])
    index = jnp.where(moved == value[..., None], positions, -1).max(-1)
    if keepdim:
        return jnp.expand_dims(value, dim), jnp.expand_dims(index, dim)
    return value, index


register_table(
    {
        aten.kthvalue.default: _kthvalue,
        aten.median.dim: _median_dim,
        aten.nanmedian.dim: _nanmedian_dim,
        aten.mode.default: _mode,
    },
    adapt=_on_vector_if_scalar,
)


@lowers(aten.median.default)
def _median(x):
    return _median_dim(x.reshape(-1), 0)[0]


@lowers(aten.nanmedian.default)
def _nanmedian(x):
    return _nanmedian_dim(x.reshape(-1), 0)[0]


@lowers(aten.logcumsumexp.default)
def _logcumsumexp(x, dim):
    if x.ndim == 0:
        return x
    return lax.cumlogsumexp(x.astype(opmath(x.dtype)), axis=dim % x.ndim).astype(x.dtype)


@lowers(aten.trace.default)
def _trace(x):
    out = _sum_dtype(x, None)
    return jnp.trace(x.astype(out), dtype=opmath(out)).astype(out)


@lowers(aten.histogram.bin_ct)
def _histogram(x, bins=100, *, range=None, weight=None, density=False):
    """ATen's histogram over ``bins`` equal bins. Returns (hist, bin_edges)."""
    edges = _equal_bin_edges(x.reshape(-1), bins, range)
    return _histogram_over(x, edges, weight, density), edges


def _equal_bin_edges(values, bins: int, range=None):
    """``bins + 1`` equally spaced edges over ``range``, or over the values' [min, max] (an empty
    range widened by 0.5 each way, as numpy does; [0, 1] without values)."""
    if range is not None:
        lo, hi = (jnp.float64(v) for v in range)
    elif values.size:
        lo, hi = jnp.min(values).astype(jnp.float64), jnp.max(values).astype(jnp.float64)
    else:
        lo, hi = jnp.float64(0), jnp.float64(1)
    lo, hi = jnp.where(lo == hi, lo - 0.5, lo), jnp.where(lo == hi, hi + 0.5, hi)
    # ATen's linspace, as its scalar loop computes it (its vector loops round some points
    # differently, by the CPU's vector width)
    return _linspace(lo, hi, bins + 1, dtype=to_torch_dtype(values.dtype))


def _histogramdd_edges(x, bins, range=None) -> tuple:
    """Each of the last dimension's columns' equal bin edges (``range``: lo, hi per column)."""
    columns = x.reshape(-1, x.shape[-1])
    ranges = [None] * len(bins) if range is None else list(zip(range[::2], range[1::2]))
    return tuple(_equal_bin_edges(columns[:, d], n, ranges[d]) for d, n in enumerate(bins))


@lowers(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    return _histogramdd_edges(x, bins, range)


@lowers(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    return _histogramdd_over(x, _histogramdd_edges(x, bins, range), weight, density)


@lowers(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    return _histogramdd_over(x, tuple(bins), weight, density)


@meta_kernel("_histogramdd_bin_edges")
def _histogramdd_edges_meta(x, bins, *, range=None, weight=None, density=False):
    return [x.new_empty(n + 1) for n in bins]


@meta_kernel("_histogramdd_from_bin_cts", "_histogramdd_from_bin_tensors")
def _histogramdd_meta(x, bins, *, range=None, weight=None, density=False):
    return x.new_empty([b.shape[0] - 1 if isinstance(b, torch.Tensor) else b for b in bins])


def _histogramdd_over(x, edges: tuple, weight, density):
    """Counts (or summed weights) of the points (rows of the last dimension) in each cell: the
    bins whose edges hold each coordinate, the last bin of a dimension closed; points outside
    and NaN left out. ``density`` divides by the total, then by each dimension's bin widths."""
    points = x.reshape(-1, x.shape[-1])
    sizes = tuple(e.shape[0] - 1 for e in edges)
    inside = jnp.ones(points.shape[0], bool)
    cell = 0
    for d, (e, n) in enumerate(zip(edges, sizes)):
        position = jnp.searchsorted(e, points[:, d], side="right") - 1
        cell = cell * n + jnp.where(position == n, n - 1, position)
        inside &= (points[:, d] >= e[0]) & (points[:, d] <= e[-1])
    values = jnp.ones(points.shape[0], x.dtype) if weight is None else weight.reshape(-1)
    total = math.prod(sizes)
    hist = (
        jnp.zeros(total, x.dtype)
        .at[jnp.where(inside, cell, total)]
        .add(values.astype(x.dtype), mode="drop")
    )
    hist = hist.reshape(sizes)
    if density:
        hist = hist / hist.sum()
        for d, e in enumerate(edges):
            hist = hist / jnp.diff(e).reshape((1,) * d + (-1,) + (1,) * (len(edges) - 1 - d))
    return hist


@meta_kernel("histogram.bin_ct", "histogram.bins_tensor")
def _histogram_meta(x, bins=100, *, range=None, weight=None, density=False):
    """Shapes of (hist, bin_edges)."""
    bins = bins.shape[0] - 1 if isinstance(bins, torch.Tensor) else bins
    return x.new_empty(bins), x.new_empty(bins + 1)


@lowers(aten.histogram.bins_tensor)
def _histogram_edges(x, bins, *, weight=None, density=False):
    """ATen's histogram over the given bin edges. Returns (hist, bin_edges)."""
    return _histogram_over(x, bins, weight, density), bins


def _histogram_over(x, edges, weight, density):
    """histogram's counts: histogramdd's of the flattened values as points of one coordinate."""
    return _histogramdd_over(x.reshape(-1, 1), (edges,), weight, density)


@lowers(aten.histc.default)
def _histc(x, bins=100, min=0, max=0):
    """ATen's histc: ``bins`` equal bins over [min, max], or over the data's range where
    min == max (widened by 1 each way if still empty); elements outside (and NaN) are ignored,
    the last bin is closed. The bin index is computed in the input dtype, as ATen's kernel does."""
    x = x.reshape(-1)
    lo, hi = jnp.asarray(min, jnp.float64), jnp.asarray(max, jnp.float64)
    use_data = lo == hi
    lo = jnp.where(use_data, jnp.min(x, initial=jnp.inf), lo).astype(x.dtype)
    hi = jnp.where(use_data, jnp.max(x, initial=-jnp.inf), hi).astype(x.dtype)
    lo, hi = jnp.where(lo == hi, lo - 1, lo), jnp.where(lo == hi, hi + 1, hi)
    position = ((x - lo) * jnp.asarray(bins, x.dtype) / (hi - lo)).astype(jnp.int64)
    position = jnp.where((x >= lo) & (x <= hi), jnp.minimum(position, bins - 1), bins)
    return jnp.zeros(bins, x.dtype).at[position].add(1, mode="drop")
