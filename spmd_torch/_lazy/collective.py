"""Replica collectives recorded as graph nodes: PyTorch/XLA's all_reduce, all_gather, ...

Each node carries the mesh axis its engine's mode gives it: in a replica of ``launch`` the
replicas' axis, lowered to jax collectives inside the one program every replica runs at the
barrier (replicas.py); in a world of one, none, and each collective is its own value
(lowering/collectives.py). Arguments are checked here, where the error can name the call; the
results are fresh tensors (callers reducing in place copy them back).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .engine import current
from .graph import Arg, Aval, Node
from .lowering.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_PERMUTE,
    REDUCE_SCATTER,
)
from .tensor import LazyTensor, on_xla, wrap

REDUCE_TYPES = ("sum", "mul", "and", "or", "min", "max")
# The ops whose programs a replica runs only with every other replica's (compiled graphs add theirs).
COLLECTIVES = {ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE}


def world_size() -> int:
    """How many programs the calling engine's world has: the replicas of ``launch``, else the
    job's processes."""
    return current().mode.world_size


def all_reduce(
    reduce_type: str, tensors: Sequence[torch.Tensor], scale: float, groups
) -> list[LazyTensor]:
    """Each tensor reduced over its replica's group, times ``scale`` (one node for the list)."""
    check_reduce_type("all_reduce", reduce_type)
    groups = _groups("all_reduce", groups, equal_sizes=False)
    tensors = [on_xla(t, "all_reduce") for t in tensors]
    args = (tuple(Arg(i) for i in range(len(tensors))), reduce_type, float(scale), groups)
    avals = tuple(Aval(tuple(t.shape), t.dtype) for t in tensors)
    return _record("all_reduce", ALL_REDUCE, tensors, args, avals)


def all_gather(value: torch.Tensor, dim: int, groups) -> LazyTensor:
    """The group's values concatenated along ``dim``, in group order."""
    value = on_xla(value, "all_gather")
    groups = _groups("all_gather", groups)
    dim = _dim("all_gather", dim, value)
    shape = list(value.shape)
    shape[dim] *= _group_size(groups)
    aval = Aval(tuple(shape), value.dtype)
    (out,) = _record("all_gather", ALL_GATHER, [value], (Arg(0), dim, groups), (aval,))
    return out


def reduce_scatter(
    reduce_type: str, value: torch.Tensor, scale: float, dim: int, shard_count: int, groups
) -> LazyTensor:
    """The group's reduction times ``scale``, split in ``shard_count`` along ``dim``: this
    replica's chunk (its rank in the group)."""
    check_reduce_type("reduce_scatter", reduce_type)
    value = on_xla(value, "reduce_scatter")
    groups = _groups("reduce_scatter", groups)
    dim = _dim("reduce_scatter", dim, value)
    _check_split("reduce_scatter", value, dim, shard_count, groups, "shard_count")
    shape = list(value.shape)
    shape[dim] //= shard_count
    args = (Arg(0), reduce_type, float(scale), dim, shard_count, groups)
    (out,) = _record(
        "reduce_scatter", REDUCE_SCATTER, [value], args, (Aval(tuple(shape), value.dtype),)
    )
    return out


def all_to_all(
    value: torch.Tensor, split_dim: int, concat_dim: int, split_count: int, groups
) -> LazyTensor:
    """Chunk r of each member's value (split along ``split_dim``) concatenated along
    ``concat_dim`` on the member of rank r."""
    value = on_xla(value, "all_to_all")
    groups = _groups("all_to_all", groups)
    split_dim = _dim("all_to_all", split_dim, value)
    concat_dim = _dim("all_to_all", concat_dim, value)
    _check_split("all_to_all", value, split_dim, split_count, groups, "split_count")
    shape = list(value.shape)
    shape[split_dim] //= split_count
    shape[concat_dim] *= split_count
    args = (Arg(0), split_dim, concat_dim, split_count, groups)
    (out,) = _record("all_to_all", ALL_TO_ALL, [value], args, (Aval(tuple(shape), value.dtype),))
    return out


def collective_permute(value: torch.Tensor, pairs) -> LazyTensor:
    """Each (source, target) pair sends the source's value to the target; replicas no pair
    targets receive zeros."""
    value = on_xla(value, "collective_permute")
    size = world_size()
    pairs = tuple((int(s), int(t)) for s, t in pairs)
    for name, column in (("source", 0), ("target", 1)):
        ordinals = [pair[column] for pair in pairs]
        bad = [k for k in ordinals if not 0 <= k < size]
        if bad or len(set(ordinals)) != len(ordinals):
            raise ValueError(
                f"collective_permute: pairs {list(pairs)} must name each {name} once, among the "
                f"{size} replicas (0..{size - 1})"
            )
    aval = Aval(tuple(value.shape), value.dtype)
    (out,) = _record("collective_permute", COLLECTIVE_PERMUTE, [value], (Arg(0), pairs), (aval,))
    return out


def _record(api: str, op, tensors: list, args: tuple, avals: tuple) -> list[LazyTensor]:
    """The collective's node, its last argument the mode's axis (None: a world of one)."""
    args += (current().mode.collective_axis(api),)
    node = Node(op, tuple(t._ref() for t in tensors), args, {}, avals)
    return [wrap((node, i), aval) for i, aval in enumerate(avals)]


def check_reduce_type(api: str, reduce_type: str) -> None:
    if reduce_type not in REDUCE_TYPES:
        raise ValueError(f"{api}: unknown reduce_type {reduce_type!r}; one of {REDUCE_TYPES}")


def _dim(api: str, dim: int, value: torch.Tensor) -> int:
    rank = value.dim()
    if not -rank <= dim < rank:
        raise IndexError(
            f"{api}: dim {dim} is out of range for a tensor of shape {tuple(value.shape)} "
            f"(rank {rank})"
        )
    return dim % rank


def _groups(api: str, groups, equal_sizes: bool = True) -> tuple | None:
    """``groups`` as a tuple of tuples, checked to split the replicas (None: one group of all)."""
    if not groups:
        return None
    size = world_size()
    groups = tuple(tuple(int(k) for k in group) for group in groups)
    members = sorted(k for group in groups for k in group)
    if members != list(range(size)):
        raise ValueError(
            f"{api}: groups {[list(g) for g in groups]} must name each of the {size} replicas "
            f"(0..{size - 1}) exactly once"
        )
    sizes = sorted({len(group) for group in groups})
    if equal_sizes and len(sizes) > 1:
        raise ValueError(
            f"{api}: groups {[list(g) for g in groups]} have different sizes {sizes}; "
            f"{api} needs groups of one size"
        )
    return groups


def _group_size(groups) -> int:
    return world_size() if groups is None else len(groups[0])


def _check_split(api: str, value, dim: int, count: int, groups, name: str) -> None:
    members = _group_size(groups)
    if count != members:
        raise ValueError(f"{api}: {name}={count} must equal the group size {members}")
    if value.shape[dim] % count:
        raise ValueError(
            f"{api}: dimension {dim} of shape {tuple(value.shape)} does not split into "
            f"{count} equal chunks"
        )
