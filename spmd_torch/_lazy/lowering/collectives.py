"""Lowerings of PyTorch/XLA's replica collectives (all_reduce, all_gather, reduce_scatter,
all_to_all, collective_permute) for the multiprocessing emulation.

The replicas' graphs run as one ``jax.shard_map`` over a 1-D mesh whose axis is ``REPLICA_AXIS``;
these lowerings run inside its body, where each value has its per-replica shape. Each node's last
argument is that axis, or None in a world of one (a program that is not a replica of ``launch``),
where every collective is the value one replica alone would get; ``ALONE_AXIS`` there
(``XLA_ALWAYS_ALLREDUCE``) still emits the collective, over a mesh of the one device. ``groups`` is
torch_xla's: a tuple of equal-sized tuples of replica ordinals partitioning the replicas, or None
for all replicas in ordinal order. Without groups each op is one ``jax.lax`` collective where one
exists. With groups every replica gathers all values and picks its group's members through static
tables, since ``axis_index_groups`` is not supported throughout ``shard_map`` (psum raises
NotImplementedError under ``check_vma``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh, PartitionSpec

from .registry import EngineOp, lowers

REPLICA_AXIS = "replica"
ALONE_AXIS = "replica of one"  # a world of one whose collectives are emitted all the same

# args (xs, reduce_type, scale, groups, axis): xs a tuple of arrays -> a tuple, one result per input
ALL_REDUCE = EngineOp("all_reduce")
# args (x, dim, groups, axis): the group's values concatenated along dim, in group order
ALL_GATHER = EngineOp("all_gather")
# args (x, reduce_type, scale, scatter_dim, shard_count, groups, axis): reduce, keep chunk rank-in-group
REDUCE_SCATTER = EngineOp("reduce_scatter")
# args (x, split_dimension, concat_dimension, split_count, groups, axis)
ALL_TO_ALL = EngineOp("all_to_all")
# args (x, pairs, axis): pairs a tuple of (source, target) ordinals; replicas receiving nothing get 0
COLLECTIVE_PERMUTE = EngineOp("collective_permute")

_REDUCERS = {
    "sum": jnp.sum,
    "mul": jnp.prod,
    "min": jnp.min,
    "max": jnp.max,
    "and": jnp.bitwise_and.reduce,
    "or": jnp.bitwise_or.reduce,
}
_FAST = {"sum": lax.psum, "min": lax.pmin, "max": lax.pmax}
_FAST_BOOL = {"and": lax.pmin, "or": lax.pmax, "min": lax.pmin, "max": lax.pmax}


def _tables(groups: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per ordinal, its group's members in group order (N, m) and its rank in the group (N,):
    static, so a replica finds its own row with its traced axis index."""
    size = sum(map(len, groups))
    members = np.zeros((size, len(groups[0])), np.int32)
    ranks = np.zeros(size, np.int32)
    for group in groups:
        for rank, ordinal in enumerate(group):
            members[ordinal] = group
            ranks[ordinal] = rank
    return members, ranks


def _members(x, groups, axis):
    """The values of x on this replica's group, stacked in group order along a new axis 0."""
    if axis is None:
        return x[None]
    everyone = lax.all_gather(x, axis)
    if groups is None:
        return everyone
    members, _ = _tables(groups)
    return jnp.take(everyone, jnp.asarray(members)[lax.axis_index(axis)], axis=0)


def _rank(groups, axis):
    """This replica's position in its group (traced), which picks its chunk."""
    if axis is None:
        return 0
    if groups is None:
        return lax.axis_index(axis)
    _, ranks = _tables(groups)
    return jnp.asarray(ranks)[lax.axis_index(axis)]


def _emitted_alone(lowering):
    """``lowering``, run on ``ALONE_AXIS`` inside a ``shard_map`` over a one-device replica axis,
    so the world of one still gets its XLA collective."""

    @functools.wraps(lowering)
    def lower(x, *args, **kwargs):
        if kwargs.get("axis", args[-1] if args else None) != ALONE_AXIS:
            return lowering(x, *args, **kwargs)
        if "axis" in kwargs:
            kwargs = {**kwargs, "axis": REPLICA_AXIS}
        else:
            args = (*args[:-1], REPLICA_AXIS)
        body = functools.partial(_with_static, lowering, args, kwargs)
        mesh = AbstractMesh((1,), (REPLICA_AXIS,))
        spec = PartitionSpec()
        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)

    return lower


def _with_static(lowering, args, kwargs, x):
    return lowering(x, *args, **kwargs)


def _concat(stack, dim: int):
    """The stacked values (axis 0) concatenated along dim, in stack order."""
    moved = jnp.moveaxis(stack, 0, dim)
    shape = moved.shape
    return moved.reshape(shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2 :])


def _chunk(x, index, count: int, dim: int):
    """Chunk number ``index`` (traced) of ``count`` equal chunks of x along dim."""
    size = x.shape[dim] // count
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)


def _scaled(x, scale: float):
    """torch_xla multiplies by scale, converted to the result's dtype, only when it is not 1."""
    return x if scale == 1.0 else x * jnp.asarray(scale, x.dtype)


def _reduce(op: str, x, reduce_type: str, groups, axis):
    """x reduced over this replica's group, in x's dtype: a native collective where one fits."""
    bitwise = reduce_type in ("and", "or")
    if reduce_type not in _REDUCERS or (bitwise and jnp.issubdtype(x.dtype, jnp.inexact)):
        raise ValueError(
            f"{op}: reduce type {reduce_type!r} does not apply to {x.dtype}{list(x.shape)} "
            f"(groups {groups}); expected one of {sorted(_REDUCERS)}, and/or for bool or integers"
        )
    is_bool = x.dtype == jnp.bool_
    fast = (_FAST_BOOL if is_bool else _FAST).get(reduce_type)
    if groups is None and fast is not None and axis is not None:
        return fast(x.astype(jnp.int8) if is_bool else x, axis).astype(x.dtype)
    return _REDUCERS[reduce_type](_members(x, groups, axis), axis=0).astype(x.dtype)


@lowers(ALL_REDUCE)
@_emitted_alone
def _all_reduce(xs, reduce_type, scale, groups, axis):
    """One node reduces a whole list of tensors, as xm.all_reduce does for a list."""
    return tuple(_scaled(_reduce("all_reduce", x, reduce_type, groups, axis), scale) for x in xs)


@lowers(ALL_GATHER)
@_emitted_alone
def _all_gather(x, dim, groups, axis):
    """xm.all_gather: the group's values side by side along dim."""
    if groups is None and axis is not None:
        return lax.all_gather(x, axis, axis=dim, tiled=True)
    return _concat(_members(x, groups, axis), dim)


@lowers(REDUCE_SCATTER)
@_emitted_alone
def _reduce_scatter(x, reduce_type, scale, scatter_dim, shard_count, groups, axis):
    """xm.reduce_scatter: the reduction's chunk that belongs to this replica's rank."""
    if groups is None and axis is not None and reduce_type == "sum" and x.dtype != jnp.bool_:
        summed = lax.psum_scatter(x, axis, scatter_dimension=scatter_dim, tiled=True)
        return _scaled(summed, scale)
    reduced = _scaled(_reduce("reduce_scatter", x, reduce_type, groups, axis), scale)
    return _chunk(reduced, _rank(groups, axis), shard_count, scatter_dim)


@lowers(ALL_TO_ALL)
@_emitted_alone
def _all_to_all(x, split_dimension, concat_dimension, split_count, groups, axis):
    """xm.all_to_all: rank r receives every member's chunk r, concatenated in group order."""
    if groups is None and axis is not None:
        return lax.all_to_all(x, axis, split_dimension, concat_dimension, tiled=True)
    members = _members(x, groups, axis)
    chunks = _chunk(members, _rank(groups, axis), split_count, split_dimension + 1)
    return _concat(chunks, concat_dimension)


@lowers(COLLECTIVE_PERMUTE)
@_emitted_alone
def _collective_permute(x, pairs, axis):
    """xm.collective_permute: each source sends to its target; lax.ppermute zero-fills the rest."""
    if axis is None:
        return x if (0, 0) in pairs else jnp.zeros_like(x)
    return lax.ppermute(x, axis, perm=pairs)
