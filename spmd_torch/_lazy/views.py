"""Views made functional: each view op knows how to read itself from its base and how to write an
updated view back into the base, so ``x[0] += 1`` and ``p.grad.zero_()`` become updates of the
storage every alias shares (the torchax ``ViewInfo`` idea, over graph values).
"""

from __future__ import annotations

import torch

from .graph import Arg, Aval, Node, Ref, Value
from .lowering.indexing import SELECT_AT, SLICE_AT
from .record import emit_value
from .tensor import LazyTensor

aten = torch.ops.aten

# Views that are the very same value as their base: the alias shares the base's storage and chain.
IDENTITY_VIEWS = {aten.alias.default, aten.detach.default, aten.lift_fresh.default}


def _reshape_back(base: Value, new: Value, *args) -> Value:
    return emit_value(aten.view.default, new, list(base.aval.shape))


def _permute_back(base: Value, new: Value, dims) -> Value:
    rank = len(dims)
    inverse = sorted(range(rank), key=lambda i: dims[i] % rank)
    return emit_value(aten.permute.default, new, inverse)


WRITE_BACK: dict = {
    aten.view.default: _reshape_back,
    aten._unsafe_view.default: _reshape_back,
    aten.unsqueeze.default: _reshape_back,
    aten.squeeze.default: _reshape_back,
    aten.squeeze.dim: _reshape_back,
    aten.squeeze.dims: _reshape_back,
    aten._reshape_alias.default: _reshape_back,
    aten.permute.default: _permute_back,
    aten.transpose.int: lambda base, new, d0, d1: emit_value(aten.transpose.int, new, d0, d1),
    aten.t.default: lambda base, new: emit_value(aten.t.default, new),
    aten.select.int: lambda base, new, *a: emit_value(aten.select_scatter.default, base, new, *a),
    aten.slice.Tensor: lambda base, new, *a: emit_value(aten.slice_scatter.default, base, new, *a),
    aten.diagonal.default: lambda base, new, *a: emit_value(
        aten.diagonal_scatter.default, base, new, *a
    ),
    aten.as_strided.default: lambda base, new, *a: emit_value(
        aten.as_strided_scatter.default, base, new, *a
    ),
    aten.view_as_real.default: lambda base, new: emit_value(aten.view_as_complex.default, new),
    aten.view_as_complex.default: lambda base, new: emit_value(aten.view_as_real.default, new),
}


# Views whose elements overlap in memory. PyTorch refuses most writes through them; the one
# legal way to reach one is autograd keeping an expanded gradient as ``.grad`` (our tensors
# report contiguous strides), whose later ``add_``/``zero_`` must not touch the base.
OVERLAPPING = {aten.expand.default, aten.unfold.default}


class View:
    """One step of a view chain: ``func(base, *args)`` and its write-back."""

    __slots__ = ("func", "args", "overlapping")

    def __init__(self, func, args: tuple):
        self.func = func
        self.args = args
        self.overlapping = func in OVERLAPPING

    def read(self, base: Ref) -> Ref:
        return emit_value(self.func, Value(base), *self.args).ref

    def write(self, base: Ref, new: Ref) -> Ref:
        write_back = WRITE_BACK.get(self.func)
        if write_back is None:
            raise NotImplementedError(f"in-place update through a view made by {self.func}")
        return write_back(Value(base), Value(new), *self.args).ref


def make_view(base: LazyTensor, func, args: tuple) -> LazyTensor:
    """A tensor aliasing ``base`` through ``func(base, *args)``."""
    entry = View(func, args)
    ref = entry.read(base._ref())
    aval = ref[0].avals[ref[1]]
    view = LazyTensor(base._storage, aval, (base._view or ()) + (entry,))
    view._remember(ref)
    return view


def alias(base: LazyTensor) -> LazyTensor:
    """Another tensor for the very same value (detach, alias): same storage, same chain. A view's
    value is read when first needed (autograd detaches every gradient it stores, slices of a
    stacked gradient too, and most are next read whole, through their stack)."""
    if base._view is None:
        return LazyTensor(base._storage, base._storage.aval)
    view = LazyTensor(base._storage, Aval(tuple(base.shape), base.dtype), base._view)
    if base._cache_version == base._storage.version:
        view._remember(base._cache)
    return view


def split_views(base: LazyTensor, func, args: tuple) -> list[LazyTensor]:
    """Multi-output views (split, unbind) as one single-output view per piece."""
    if func is aten.unbind.int:
        dim = args[0] if args else 0
        return [make_view(base, aten.select.int, (dim, i)) for i in range(base.shape[dim])]
    dim = args[1] if len(args) > 1 else 0
    dim %= base.dim()
    length = base.shape[dim]
    if func is aten.split.Tensor:
        step = args[0]
        sizes = [min(step, length - start) for start in range(0, length, step)] or [0]
    else:
        sizes = list(args[0])
    views, start = [], 0
    for size in sizes:
        views.append(make_view(base, aten.slice.Tensor, (dim, start, start + size)))
        start += size
    return views


SPLIT_VIEWS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}


# --- reading views of known data -----------------------------------------------------------------

_SELECT, _SLICE = aten.select.int, aten.slice.Tensor
# View ops whose result does not depend on an index: read again as they are.
_UNINDEXED = set(WRITE_BACK) - {_SELECT, _SLICE} | IDENTITY_VIEWS


def read_by_index(ref: Ref) -> Ref | None:
    """``ref``, a chain of view ops over known data holding a select or a slice, recorded again
    with their indices as program inputs: reading each slice of a stack (a checkpoint's
    parameters) or each row of a tensor then compiles one program per shape, not one per index.
    None where ``ref`` is not such a chain."""
    chain, (node, index) = [], ref
    while not node.is_leaf(index):
        if index or len(node.src) != 1 or node.kwargs:
            return None
        if node.op not in _UNINDEXED and node.op is not _SELECT and node.op is not _SLICE:
            return None
        chain.append(node)
        node, index = node.src[0]
    if not any(n.op is _SELECT or n.op is _SLICE for n in chain):
        return None
    source = (node, index)
    for view in reversed(chain):
        source = _read_again(view, source)
    return source


def indexed(chain: tuple) -> bool:
    """Whether a view chain reads at an index (a select or a slice)."""
    return any(entry.func is _SELECT or entry.func is _SLICE for entry in chain)


def _read_again(view: Node, source: Ref) -> Ref:
    """``view``'s op on ``source``, an index it holds lifted to a program input."""
    shape = source[0].avals[source[1]].shape
    op, args = view.op, view.args
    if op is _SELECT:
        dim = args[1] % len(shape)
        op, src, args = SELECT_AT, (source, _lifted(args[2] % shape[dim])), (Arg(0), Arg(1), dim)
    elif op is _SLICE and _slice_args(args)[3] == 1:
        dim, start, end, _ = _slice_args(args)
        dim %= len(shape)
        kept = range(shape[dim])[start:end]
        op, src, args = SLICE_AT, (source, _lifted(kept.start)), (Arg(0), Arg(1), dim, len(kept))
    else:
        src = (source,)
    node = Node(op, src, args, view.kwargs, view.avals)
    node.device = view.device
    return (node, 0)


def _slice_args(args: tuple) -> tuple:
    """``aten.slice.Tensor``'s (dim, start, end, step), defaults filled in."""
    return tuple(args[1:]) + (0, None, None, 1)[len(args) - 1 :]


def _lifted(index: int) -> Ref:
    return (Node.scalar(index, shared=False), 0)
