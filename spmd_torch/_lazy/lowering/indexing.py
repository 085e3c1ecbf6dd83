"""Lowerings: views as values, the scatters that write a view back into its base, advanced indexing,
gathers/scatters and shape ops.

Every lowering is functional: the engine keeps aliasing and in-place writes to itself and hands us
contiguous arrays, so a view is just the array it reads.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..layout import crop
from .dtypes import promote, to_jax_dtype
from .registry import EngineOp, lowers

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------- helpers


def _at(ndim: int, dim: int, index: object) -> tuple:
    """An index tuple applying ``index`` to axis ``dim`` (negative allowed), keeping the rest."""
    return (slice(None),) * (dim % ndim) + (index,)


def _indices(indices: list) -> tuple:
    """aten's list of optional index tensors as a NumPy-style index (None = the whole axis)."""
    return tuple(slice(None) if i is None else i for i in indices)


def _scalar_as_vector(fn):
    """PyTorch's dim-wise index ops treat a 0-d self (and 0-d index/src) as one-element vectors,
    with dim 0 or -1, and give a 0-d self a 0-d result; NumPy has no axis there to index."""

    def lowering(x, dim, *args, **kwargs):
        if x.ndim:
            return fn(x, dim, *args, **kwargs)
        args = [a.reshape(1) if isinstance(a, jnp.ndarray) and a.ndim == 0 else a for a in args]
        return fn(x.reshape(1), dim, *args, **kwargs).reshape(())

    return lowering


def _scatter_index(index: jnp.ndarray, dim: int) -> tuple:
    """scatter/gather as one advanced index: ``index`` along ``dim``, the position elsewhere."""
    grid = list(jnp.indices(index.shape, sparse=True))
    grid[dim % index.ndim] = index
    return tuple(grid)


def _strided_index(size: list, stride: list, storage_offset: int | None) -> jnp.ndarray:
    """Flat positions an as_strided view reads from a contiguous buffer, as iotas XLA fuses."""
    iotas = (lax.broadcasted_iota(jnp.int64, tuple(size), d) * s for d, s in enumerate(stride))
    return sum(iotas, jnp.asarray(storage_offset or 0, jnp.int64))


def _diag_index(rows: int, cols: int, offset: int) -> tuple:
    """Row and column positions of the ``offset`` diagonal of a rows x cols matrix."""
    n = max(0, min(rows + min(offset, 0), cols - max(offset, 0)))
    return np.arange(n) - min(offset, 0), np.arange(n) + max(offset, 0)


def _pad_widths(ndim: int, pad: list) -> list:
    """PyTorch pads ((before, after) pairs, last axis first) as per-axis widths, first first."""
    pairs = [(pad[i], pad[i + 1]) for i in range(0, len(pad), 2)][::-1]
    return [(0, 0)] * (ndim - len(pairs)) + pairs


def _masked_put(x: jnp.ndarray, k: int, mask: jnp.ndarray, values: jnp.ndarray, accumulate: bool):
    """``x[(:,)*k + (mask,)] = values`` with static shapes: the i-th true element takes values[i],
    found by the mask's running count, so no data-dependent nonzero is needed."""
    rest = x.shape[k + mask.ndim :]
    flat = x.reshape(*x.shape[:k], -1, *rest)
    m = mask.reshape(-1)
    v = values.reshape((1,) * (flat.ndim - values.ndim) + values.shape)
    if v.shape[k] == 0:  # no values: the mask has no true position (a masked_select of none)
        return x
    picked = jnp.take(v, jnp.cumsum(m) - 1, axis=k, mode="clip")
    m = m.reshape(-1, *(1,) * len(rest))
    out = flat + jnp.where(m, picked, 0) if accumulate else jnp.where(m, picked, flat)
    return out.reshape(x.shape)


def _floor_or_true_div(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """PyTorch's scatter mean divides integers with floor rounding and floats exactly."""
    return jnp.floor_divide(a, b) if jnp.issubdtype(a.dtype, jnp.integer) else a / b


def _reduce_identity(reduce: str, dtype: object) -> object:
    """The value that leaves ``reduce`` unchanged: what include_self=False puts in place of self."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if reduce == "amax" else jnp.inf
    return jnp.iinfo(dtype).min if reduce == "amax" else jnp.iinfo(dtype).max


_AT_METHOD = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "max", "amin": "min"}
_LEGACY_REDUCE = {"add": "sum", "multiply": "prod"}


# ------------------------------------------------------------------------------- views as values


@lowers(aten.view.default, aten._unsafe_view.default, aten.view_copy.default)
def _view(x, size):
    return jnp.reshape(x, size)


@lowers(aten._reshape_alias.default)
def _reshape_alias(x, size, stride):
    """Only emitted when the reshape is a view, i.e. on our contiguous arrays a plain reshape."""
    return jnp.reshape(x, size)


@lowers(aten.view.dtype, aten.view_copy.dtype)
def _view_dtype(x, dtype):
    """Reinterpret the bytes; a narrower dtype widens the last axis and a wider one shrinks it."""
    out = to_jax_dtype(dtype)
    if out.itemsize > x.dtype.itemsize:
        x = x.reshape(*x.shape[:-1], -1, out.itemsize // x.dtype.itemsize)
    y = lax.bitcast_convert_type(x, out)
    return y.reshape(*x.shape[:-1], -1) if out.itemsize < x.dtype.itemsize else y


@lowers(aten.alias.default, aten.alias_copy.default)
def _alias(x):
    return x


@lowers(aten.view_as_real.default, aten.view_as_real_copy.default)
def _view_as_real(x):
    """A complex tensor as a trailing (real, imag) axis; XLA has no bitcast from complex."""
    return jnp.stack([x.real, x.imag], axis=-1)


@lowers(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def _view_as_complex(x):
    return lax.complex(x[..., 0], x[..., 1])


@lowers(aten.permute.default, aten.permute_copy.default)
def _permute(x, dims):
    return jnp.transpose(x, dims)


@lowers(aten.t.default, aten.t_copy.default)
def _t(x):
    """t() transposes a matrix and leaves 0-d and 1-d tensors as they are."""
    return jnp.swapaxes(x, 0, 1) if x.ndim == 2 else x


@lowers(aten.transpose.int, aten.transpose_copy.int)
def _transpose(x, dim0, dim1):
    return jnp.swapaxes(x, dim0, dim1)


@lowers(aten.expand.default, aten.expand_copy.default)
def _expand(x, size, implicit=False):
    """-1 keeps the size of the aligned (trailing) axis; extra leading sizes make new axes."""
    lead = len(size) - x.ndim
    return jnp.broadcast_to(x, [x.shape[i - lead] if s == -1 else s for i, s in enumerate(size)])


@lowers(aten.select.int, aten.select_copy.int)
def _select(x, dim, index):
    return x[_at(x.ndim, dim, index)]


@lowers(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    """Python slices clamp out-of-range and wrap negative bounds exactly as aten.slice does."""
    return x[_at(x.ndim, dim, slice(start, end, step))]


# A read of one slice of known data, its index a program input (views.py's reads by index).
SELECT_AT = EngineOp("select_at")  # args (x, index, dim)
SLICE_AT = EngineOp("slice_at")  # args (x, start, dim, length): step 1


@lowers(SELECT_AT)
def _select_at(x, index, dim):
    return lax.dynamic_index_in_dim(x, index.astype(jnp.int32), dim, keepdims=False)


@lowers(SLICE_AT)
def _slice_at(x, start, dim, length):
    return lax.dynamic_slice_in_dim(x, start.astype(jnp.int32), length, dim)


@lowers(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def _unsqueeze(x, dim):
    return jnp.expand_dims(x, dim)


@lowers(
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze_copy.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
)
def _squeeze(x, dim=None):
    """Squeezing an axis whose size is not 1 is a no-op in PyTorch (an error in NumPy)."""
    dims = range(x.ndim) if dim is None else [dim] if isinstance(dim, int) else dim
    return jnp.squeeze(x, tuple(d % x.ndim for d in dims if x.ndim and x.shape[d] == 1))


@lowers(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, dim1, dim2)


@lowers(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(x, size, stride, storage_offset=None):
    return x.reshape(-1)[_strided_index(size, stride, storage_offset)]


@lowers(aten.unfold.default, aten.unfold_copy.default)
def _unfold(x, dimension, size, step):
    """Windows become a new axis at ``dimension`` and the window elements the last axis; a 0-d
    tensor has one window, of size 1 (or 0), and PyTorch returns it as a 1-d tensor."""
    if x.ndim == 0:
        return jnp.broadcast_to(x, (size,))
    dim = dimension % x.ndim
    starts = np.arange((x.shape[dim] - size) // step + 1) * step
    return jnp.moveaxis(jnp.take(x, starts[:, None] + np.arange(size), axis=dim), dim + 1, -1)


@lowers(
    aten.split_with_sizes.default,
    aten.split_with_sizes_copy.default,
    aten.unsafe_split_with_sizes.default,
)
def _split_with_sizes(x, split_sizes, dim=0):
    ends = np.cumsum(split_sizes).tolist()
    return [x[_at(x.ndim, dim, slice(e - n, e))] for n, e in zip(split_sizes, ends, strict=True)]


@lowers(aten.split.Tensor, aten.split_copy.Tensor, aten.unsafe_split.Tensor)
def _split(x, split_size, dim=0):
    """Equal chunks of split_size and a shorter last one; an empty axis still gives one chunk."""
    n, size = x.shape[dim], max(split_size, 1)
    sizes = [size] * (n // size) + ([n % size] if n % size else [])
    return _split_with_sizes(x, sizes or [n], dim)


@lowers(aten.unbind.int, aten.unbind_copy.int)
def _unbind(x, dim=0):
    return [x[_at(x.ndim, dim, i)] for i in range(x.shape[dim])]


# ------------------------------------------------------------ writing a view back into its base


@lowers(aten.slice_scatter.default)
def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    return x.at[_at(x.ndim, dim, slice(start, end, step))].set(src)


@lowers(aten.select_scatter.default)
def _select_scatter(x, src, dim, index):
    return x.at[_at(x.ndim, dim, index)].set(src)


@lowers(aten.diagonal_scatter.default)
def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """Move the two axes last, where the diagonal's positions index them as in diagonal()."""
    y = jnp.moveaxis(x, (dim1, dim2), (-2, -1))
    rows, cols = _diag_index(*y.shape[-2:], offset)
    return jnp.moveaxis(y.at[..., rows, cols].set(src), (-2, -1), (dim1, dim2))


@lowers(aten.as_strided_scatter.default)
def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    flat = x.reshape(-1).at[_strided_index(size, stride, storage_offset)].set(src)
    return flat.reshape(x.shape)


# ----------------------------------------------------------------------------- advanced indexing


@lowers(aten.index.Tensor)
def _index(x, indices):
    """NumPy and PyTorch agree on advanced indexing (negative indices wrap, separated index tensors
    move to the front); a bool mask only lowers where its values are known, else jit refuses it."""
    return x[_indices(indices)]


@lowers(aten.index_put.default)
def _index_put(x, indices, values, accumulate=False):
    """A lone bool mask (``x[mask] = v``, the common case) keeps a static shape via _masked_put."""
    given = [(k, i) for k, i in enumerate(indices) if i is not None]
    if len(given) == 1 and given[0][1].dtype == jnp.bool_:
        return _masked_put(x, *given[0], values, accumulate)
    at = x.at[_indices(indices)]
    return at.add(values) if accumulate else at.set(values)


@lowers(aten.index_select.default)
@_scalar_as_vector
def _index_select(x, dim, index):
    """A 0-d index still keeps the axis (with size 1)."""
    return jnp.take(x, index.reshape(-1), axis=dim)


@lowers(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(sorted_sequence, x, *, out_int32=False, right=False, side=None, sorter=None):
    """Per row of the leading dims (or one 1-d sequence for every value), as ATen's."""
    side = side or ("right" if right else "left")
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    x = jnp.asarray(x)
    search = partial(jnp.searchsorted, side=side)
    if sorted_sequence.ndim == 1:
        return search(sorted_sequence, x)
    flat = jax.vmap(search)(sorted_sequence.reshape(-1, sorted_sequence.shape[-1]),
                            x.reshape(-1, x.shape[-1]))  # fmt: skip
    return flat.reshape(x.shape)


@lowers(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(x, boundaries, *, out_int32=False, right=False):
    """searchsorted of every element in the 1-d boundaries; ``right`` is its side."""
    return jnp.searchsorted(boundaries, jnp.asarray(x), side="right" if right else "left")


@lowers(aten.gather.default)
def _gather(x, dim, index, sparse_grad=False):
    """The index may be smaller than self along the other axes: gather from that corner of self.
    A 0-d self (a one-element vector) or an empty index (any rank) just gives the index's shape."""
    if x.ndim == 0 or index.size == 0:
        return jnp.take(x.reshape(-1), index)
    shape = [n if d != dim % x.ndim else x.shape[d] for d, n in enumerate(index.shape)]
    return jnp.take_along_axis(crop(x, shape), index, axis=dim)


@lowers(aten.scatter.src, aten.scatter.value)
@_scalar_as_vector
def _scatter(x, dim, index, src):
    """scatter.value brings a Python scalar as ``src``; a tensor src may be larger than index."""
    src = crop(src, index.shape) if jnp.ndim(src) else src
    # PyTorch casts src to self's dtype; jax will refuse unsafe casts (int64 -> bool) itself.
    return x.at[_scatter_index(index, dim)].set(jnp.asarray(src).astype(x.dtype))


@lowers(aten.scatter_add.default)
@_scalar_as_vector
def _scatter_add(x, dim, index, src):
    """bool adds as PyTorch's bool addition does: True + True is True (a logical or)."""
    at = x.at[_scatter_index(index, dim)]
    src = crop(src, index.shape)
    return at.max(src) if x.dtype == jnp.bool_ else at.add(src)


@lowers(aten.scatter_reduce.two)
@_scalar_as_vector
def _scatter_reduce(x, dim, index, src, reduce, include_self=True):
    return _reduce_into(x, _scatter_index(index, dim), crop(src, index.shape), reduce, include_self)


@lowers(aten.index_reduce.default)
@_scalar_as_vector
def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """scatter_reduce's rules, over the slices of self that index picks along dim."""
    return _reduce_into(x, _at(x.ndim, dim, index), source, reduce, include_self)


def _reduce_into(x, idx, src, reduce, include_self):
    """x.at[idx] reduced with src. include_self=False first resets the targets to the reduction's
    identity; mean counts self as one element iff included (untouched positions divide by 1)."""
    if not include_self:
        x = x.at[idx].set(_reduce_identity(reduce, x.dtype))
    out = getattr(x.at[idx], _AT_METHOD[reduce])(src)
    if reduce != "mean":
        return out
    count = jnp.zeros_like(x).at[idx].add(1) + include_self
    return _floor_or_true_div(out, jnp.maximum(count, 1))


@lowers(aten.scatter.reduce, aten.scatter.value_reduce)
@_scalar_as_vector
def _scatter_legacy_reduce(x, dim, index, src, reduce):
    """The deprecated reduce="add"|"multiply" forms, which always include self."""
    src = jnp.broadcast_to(jnp.asarray(src, x.dtype), index.shape) if jnp.ndim(src) == 0 else src
    return _scatter_reduce(x, dim, index, src, _LEGACY_REDUCE[reduce])


@lowers(aten.index_add.default)
@_scalar_as_vector
def _index_add(x, dim, index, source, alpha=1):
    return x.at[_at(x.ndim, dim, index)].add(source * alpha if alpha != 1 else source)


@lowers(aten.index_copy.default)
@_scalar_as_vector
def _index_copy(x, dim, index, source):
    return x.at[_at(x.ndim, dim, index)].set(source)


@lowers(aten.put.default)
def _put(x, index, source, accumulate=False):
    """take's inverse: flat (wrapping negative) indices into x, set or added."""
    flat, at = x.reshape(-1), index.reshape(-1) % max(x.size, 1)
    values = source.reshape(-1)
    return (flat.at[at].add(values) if accumulate else flat.at[at].set(values)).reshape(x.shape)


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
@_scalar_as_vector
def _index_fill(x, dim, index, value):
    """The value cast to self's dtype first, as PyTorch does (2.7 fills an int tensor with 2):
    a lifted number arrives as a float64 or int64 array, which JAX's scatter will not cast."""
    return x.at[_at(x.ndim, dim, index)].set(jnp.asarray(value).astype(x.dtype))


@lowers(aten.masked_scatter.default)
def _masked_scatter(x, mask, source):
    """The i-th true position of the (broadcast) mask takes the i-th element of source."""
    return _masked_put(x, 0, jnp.broadcast_to(mask, x.shape), source.reshape(-1), False)


@lowers(aten.masked_scatter_backward.default)
def _masked_scatter_backward(grad_output, mask, sizes):
    """The grad at the mask's true positions, in order, then zeros: source's grad, shaped ``sizes``.
    The running count of the mask places each value, so no data-dependent masked_select is needed."""
    shape = jnp.broadcast_shapes(grad_output.shape, mask.shape)
    grad = jnp.broadcast_to(grad_output, shape).reshape(-1)
    m = jnp.broadcast_to(mask, shape).reshape(-1)
    numel = math.prod(sizes)
    slot = jnp.where(m, jnp.cumsum(m) - 1, numel)
    return jnp.zeros(numel, grad.dtype).at[slot].set(grad, mode="drop").reshape(sizes)


# ------------------------------------------------------------------------------------ shape ops


@lowers(aten.cat.default)
def _cat(tensors, dim=0):
    """Legacy rule: 1-d empty tensors are skipped whatever the other shapes; dtypes promote."""
    dtype = promote(*(t.dtype for t in tensors))
    kept = [t for t in tensors if t.shape != (0,)] or tensors[:1]
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=dim)


@lowers(aten.stack.default)
def _stack(tensors, dim=0):
    dtype = promote(*(t.dtype for t in tensors))
    return jnp.stack([t.astype(dtype) for t in tensors], axis=dim)


@lowers(aten.constant_pad_nd.default)
def _constant_pad_nd(x, pad, value=0):
    """lax.pad takes negative widths too, which crop as in PyTorch."""
    widths = [(lo, hi, 0) for lo, hi in _pad_widths(x.ndim, pad)]
    return lax.pad(x, jnp.asarray(value, x.dtype), widths)


@lowers(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def _reflection_pad(x, padding):
    return jnp.pad(x, _pad_widths(x.ndim, padding), mode="reflect")


@lowers(
    aten.replication_pad1d.default,
    aten.replication_pad2d.default,
    aten.replication_pad3d.default,
)
def _replication_pad(x, padding):
    """Output i of an axis reads input clamp(i - before, 0, n - 1), as PyTorch's kernel does, so
    negative widths crop, and a crop of the whole axis still repeats its far edge (jnp.pad's
    "edge" mode takes neither)."""
    for axis, (before, after) in enumerate(_pad_widths(x.ndim, padding)):
        n = x.shape[axis]
        x = jnp.take(x, np.clip(np.arange(n + before + after) - before, 0, n - 1), axis=axis)
    return x


@lowers(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def _replication_pad_backward(grad_output, x, padding):
    """The adjoint of the gather above: each output's gradient adds onto the input it read."""
    _, pullback = jax.vjp(lambda y: _replication_pad(y, padding), x)
    return pullback(grad_output)[0]


@lowers(aten.flip.default)
def _flip(x, dims):
    return jnp.flip(x, tuple(dims))


@lowers(aten.roll.default)
def _roll(x, shifts, dims=()):
    """Without dims PyTorch rolls the flattened tensor."""
    return jnp.roll(x, tuple(shifts), tuple(dims)) if dims else jnp.roll(x, shifts[0])


@lowers(aten.repeat.default)
def _repeat(x, repeats):
    """jnp.tile matches repeat, including extra leading repeats that add axes."""
    return jnp.tile(x, repeats)


@lowers(aten.tril.default)
def _tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowers(aten.triu.default)
def _triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lowers(aten.rot90.default)
def _rot90(x, k=1, dims=(0, 1)):
    return jnp.rot90(x, k, axes=tuple(dims))


@lowers(aten.diag_embed.default)
def _diag_embed(x, offset=0, dim1=-2, dim2=-1):
    """The last dim of x on the ``offset`` diagonal of new dims ``dim1`` and ``dim2``."""
    out = x[..., :, None] * jnp.eye(x.shape[-1], dtype=x.dtype)
    before, after = max(-offset, 0), max(offset, 0)
    out = jnp.pad(out, [(0, 0)] * (x.ndim - 1) + [(before, after), (after, before)])
    ndim = x.ndim + 1
    return jnp.moveaxis(out, (ndim - 2, ndim - 1), (dim1 % ndim, dim2 % ndim))


@lowers(aten.block_diag.default)
def _block_diag(tensors):
    """0-dim and 1-dim blocks are one-row matrices, as ATen reads them."""
    dtype = jnp.result_type(*tensors)
    blocks = [t.reshape(1, -1) if t.ndim < 2 else t for t in tensors]
    return jax.scipy.linalg.block_diag(*[b.astype(dtype) for b in blocks])


@lowers(aten.nonzero_static.default)
def _nonzero_static(x, *, size, fill_value=-1):
    """The first ``size`` nonzero positions, one row each, the rest ``fill_value``: a shape that
    does not depend on the data, unlike ``nonzero``'s."""
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    return jnp.stack(jnp.nonzero(x, size=size, fill_value=fill_value), axis=1).astype(jnp.int64)
