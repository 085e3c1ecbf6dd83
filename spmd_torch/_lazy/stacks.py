"""Stacks: same-shaped tensors kept as the slices of one array, updated as one.

A deep model's optimizer step is the same few elementwise updates applied to every parameter. One
array per parameter makes that one XLA kernel per parameter, and XLA compiles each (a 64-layer
decoder's AdamW step: hundreds of kernels, most of its first step's time). JAX users keep each
kind of layer weight stacked (layers x ...) for that reason. Here a stack is a storage of shape
(L, ...) whose L members are tensors viewing it through ``select(0, k)``: the view machinery reads
and writes each member as any view, and an elementwise foreach op given all L members of a stack
(torch.optim's, in any order) is recorded over the stack itself, so the step updates one array
per stack whatever the depth.

Stacks are made where the members are known to come together: ``scan_layers`` stacks each
parameter of its layers (``restack``), the gradients its scan returns are members of one
gradient, and ``zeros_like`` (and the other constant ``*_like`` ops) of members 0, 1, ... of a
stack, in order, as torch.optim makes its moments, are members of one new stack (``like``), and
so are plain tensors a foreach op gives beside a stack's members (an optimizer's state loaded
from a checkpoint, one tensor per layer, beside the stacked gradients; or alone, right after
such a call, at the positions it grouped). A
tensor made alone from one member (``zeros_like(layers[3].weight)``) is a tensor of its own; one
made from member 0 is member 0 of a new stack, and holds the stack's memory.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch

from .engine import current
from .graph import Aval, Value
from .lowering.factories import CONSTANT_FILLS
from .record import emit, emit_value
from .tensor import LazyTensor, Storage, wrap
from .views import View

aten = torch.ops.aten
_SELECT = aten.select.int


def member(t) -> tuple[Storage, int] | None:
    """(the stack, the index) of a tensor viewing a storage through ``select(0, index)`` only."""
    view = t._view if type(t) is LazyTensor else None
    if view is None:
        return None
    k = _MEMBER_INDEX.get(id(view))
    if k is not None:
        return t._storage, k
    if len(view) != 1 or view[0].func is not _SELECT or view[0].args[0] != 0:
        return None
    return t._storage, view[0].args[1]


def members(stack: Storage) -> list[LazyTensor]:
    """New tensors viewing each slice of ``stack``."""
    shape, dtype = stack.aval
    aval = Aval(shape[1:], dtype)
    return [LazyTensor(stack, aval, _member_view(k)) for k in range(shape[0])]


# Member k's view chain, (select(0, k),): one object for every stack's member k, so that telling
# a member and its index is one dictionary lookup (foreach ops check every tensor of their lists).
_MEMBER_VIEWS: list[tuple] = []
_MEMBER_INDEX: dict[int, int] = {}  # id(a member's view chain) -> its index


def _member_view(k: int) -> tuple:
    while len(_MEMBER_VIEWS) <= k:
        view = (View(_SELECT, (0, len(_MEMBER_VIEWS))),)
        _MEMBER_INDEX[id(view)] = len(_MEMBER_VIEWS)
        _MEMBER_VIEWS.append(view)
    return _MEMBER_VIEWS[k]


def slices(t) -> list[LazyTensor] | None:
    """``t``'s slices along its first axis as members of its storage (no node recorded until
    one is read); None unless ``t`` is a tensor holding its storage's value as it is."""
    if type(t) is not LazyTensor or t._view is not None or not t.dim():
        return None
    return members(t._storage)


def whole(stack: Storage) -> LazyTensor:
    """A tensor for the whole stack (a write to it is a write to every member)."""
    return LazyTensor(stack, stack.aval)


def stack_of(tensors: list) -> Storage | None:
    """The stack whose members 0, 1, ... in order ``tensors`` are, else None."""
    first = member(tensors[0]) if tensors else None
    if first is None or first[0].aval.shape[0] != len(tensors):
        return None
    for k, t in enumerate(tensors):
        if member(t) != (first[0], k):
            return None
    return first[0]


def restack(tensors: list, value: LazyTensor | None = None) -> LazyTensor | None:
    """Make ``tensors`` the members of one new stack holding their values (or ``value``, a
    tensor equal to their stack), and return it whole; None (nothing changed) unless each is a
    distinct plain tensor that nothing else aliases (re-homing one alias would part it from the
    others)."""
    if len({id(t._storage) for t in tensors if type(t) is LazyTensor}) != len(tensors):
        return None
    for t in tensors:
        # references to the storage: the tensor's own and getrefcount's argument
        if t._view is not None or sys.getrefcount(t._storage) > 2:
            return None
    if value is None:
        value = emit_value(aten.stack.default, [Value(t._storage.ref) for t in tensors], 0)
        value = wrap(value.ref, value.aval)
    stack = value._storage
    for t, new in zip(tensors, members(stack)):
        t._alias_of(new)
    _RESTACKED[0] = True
    return whole(stack)


_RESTACKED = [False]  # whether any stack was ever made: until then foreach ops look for none


def groups_in(values: list) -> tuple:
    """The positions of every stack all of whose members ``values`` holds, each once: one tuple
    per stack, in member order, the tuples sorted (by member 0's position); () when it holds
    none. A stack that is also held otherwise (whole, or through another view) does not count."""
    if not _RESTACKED[0]:
        return ()
    complete = {stack: positions for stack, positions in _complete_stacks(values)}
    if not complete:
        return ()
    held: dict = {}  # stack -> tensors of it in values
    for t in values:
        if type(t) is LazyTensor and t._storage in complete:
            held[t._storage] = held.get(t._storage, 0) + 1
    return tuple(
        sorted(
            tuple(positions)
            for stack, positions in complete.items()
            if held[stack] == len(positions)
        )
    )


def still_grouped(values: list, groups: tuple) -> bool:
    """Whether ``groups`` (``groups_in`` of earlier values) still describes ``values``: each
    group's positions hold members 0..L-1 of one stack (``_aligned``), and no other position
    holds a tensor of those stacks."""
    if not groups:
        return True  # nothing recorded as a stack: the arguments are taken one by one as before
    held: set = set()
    for positions in groups:
        head = values[positions[0]]
        if type(head) is not LazyTensor or not _aligned(values, (None, positions), head.shape):
            return False
        held.add(head._storage)
    tensors = sum(type(t) is LazyTensor and t._storage in held for t in values)
    return tensors == sum(map(len, groups))


def holds_data(tensors: list) -> bool:
    """Whether each of ``tensors`` is a plain xla tensor whose value is data, not pending."""
    return all(
        type(t) is LazyTensor and t._storage.ref[0].is_leaf(t._storage.ref[1]) for t in tensors
    )


def holds_constants(tensors: list) -> bool:
    """Whether each of ``tensors`` is a plain xla tensor whose value the step does not compute:
    data, or a constant fill (``zeros``, ``full_like`` of a parameter) of data or numbers,
    nothing written since. A stack of them can be computed before the step
    (``execute.compute_now``) as a stack of data is, so that the step's program is the one every
    later step runs."""
    for t in tensors:
        if type(t) is not LazyTensor or t._view is not None:
            return False
        node, index = t._storage.ref
        if not node.is_leaf(index) and not (
            node.op in CONSTANT_FILLS and all(src.is_known(i) for src, i in node.src)
        ):
            return False
    return True


def counters_stacked(values) -> tuple[LazyTensor | None, bool]:
    """(the stack, whether to compute it now) when ``values`` are the step counters of a fused
    or capturable optimizer before its first step: more than one 0-dim tensor of one dtype, none
    a stack's member, each holding data or a constant fill (``holds_constants``). They become the
    members of one stack, so that every step's program reads and writes one array for all of
    them (where layers are stacked, a slice of it per stack of layers) instead of one per
    parameter, and the first step's program is the one every later step runs: equal sourceless
    fills (torch.optim's ``zeros(())``) as one fill of the whole stack, which the barrier
    computes with the other fills; data as a stack computed before the step. (None, False) for
    other values."""
    if (
        len(values) < 2
        or not all(type(t) is LazyTensor and not t.dim() and member(t) is None for t in values)
        or len({(t.dtype, t.device) for t in values}) != 1
        or not holds_constants(values)
    ):
        return None, False
    fill = values[0]._storage.ref[0]
    recipe = (fill.op, fill.args, fill.kwargs)
    if (
        fill.op not in _SIZED_FILLS
        or fill.src
        or any((n.op, n.args, n.kwargs) != recipe for n in (t._storage.ref[0] for t in values))
    ):
        return restack(values), True
    return restack(values, fill.op([len(values)], *fill.args[1:], **fill.kwargs)), False


def counters_read(values: list) -> list:
    """A fused step's counters as its node reads them: each member of a stack of counters
    (``counters_stacked``) one output of a single ``unbind`` of that stack, instead of a
    ``select`` node per parameter; the rest as they are."""
    unbound: dict = {}  # stack -> its unbind node
    read = []
    for t in values:
        found = member(t) if type(t) is LazyTensor and not t.dim() else None
        if found is None:
            read.append(t)
            continue
        stack, k = found
        node = unbound.get(stack)
        if node is None:
            node = unbound[stack] = emit(aten.unbind.int, (Value(stack.ref), 0), {})[0]
        read.append(Value((node, k)))
    return read


# Fills whose first argument is their size: one of shape (L,) is L of shape () at once.
_SIZED_FILLS = frozenset((aten.zeros.default, aten.ones.default, aten.full.default))


# --- foreach ops over whole stacks ---------------------------------------------------------------


def collapse(
    args: tuple, written: frozenset = frozenset(), counters: int | None = None
) -> tuple[tuple, list, list] | None:
    """A pointwise foreach op's arguments with every complete stack of one of its lists written
    as the stack itself, in each of its lists alike; with the plan ``expand`` needs: per entry of
    the shortened lists, the original positions it stands for (a stack's, in member order) or one
    position; and the stacks made here (below), as ``_restacked`` gives them. None when no
    stack is complete in every list. The first list's stacks, and those of the lists at
    ``written``, come as whole tensors (the op writes them), the others' as graph values; empty
    lists stay as they are (Adam's ``max_exp_avg_sqs`` without amsgrad).

    A fused optimizer step takes one 0-dim step counter per parameter (the list at
    ``counters``): at a stack's positions they become a stack of shape (L,) of their own, which
    the step's lowering broadcasts along the stacked axis.

    A stack counts when its L members sit at the same positions of every tensor list (member k
    of one list beside member k of the others, all of one shape), the Python scalar lists hold
    one value at those positions, and every other argument is one value for all elements. Plain
    tensors at a stack's positions are made the members of a new stack (``restack``), as an
    optimizer's state restored from a checkpoint beside stacked parameters is, so that the
    optimizer updates it whole from then on."""
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    if not lists or not args[lists[0]]:
        return None
    lists = [i for i in lists if args[i]]
    first = args[lists[0]]  # pow(Scalar, Tensor[]): its list comes second
    for i, a in enumerate(args):
        if i not in lists and isinstance(a, torch.Tensor) and a.dim() != 0:
            return None  # a tensor of per-element scalars
    source, groups, made = first, _complete_stacks(first), []
    last, _LAST_GROUPS[:] = _LAST_GROUPS[:], [0, []]  # good for the next call only
    if not groups and _RESTACKED[0]:
        source, groups = _found_elsewhere(args, lists, last, made)
    for i in lists:
        if args[i] is not source:
            groups = [
                g
                for g in groups
                if _stacked_alike(args[i], g, i == counters, made)
                or (
                    i != lists[0]
                    and i not in written
                    and (_repeated(args[i], g) or _per_member_scalars(args[i], g))
                )
            ]
    if not groups:
        return None
    _LAST_GROUPS[:] = [
        len(first),
        [(positions, stack.aval.shape[1:]) for stack, positions in groups],
    ]
    first_of = {positions[0]: positions for _, positions in groups}
    grouped = {p for _, positions in groups for p in positions}
    plan = [
        first_of.get(position, position)
        for position in range(len(first))
        if position in first_of or position not in grouped
    ]
    new_args = list(args)
    new_args[lists[0]] = [_entry(first, where, whole) for where in plan]
    for i in lists[1:]:  # read only: their stacks as graph values, no tensors made
        if i == counters:  # a fused step's: one (L,) value per stack, broadcast in its lowering
            new_args[i] = [_counters_along(args[i], where) for where in plan]
            continue
        as_whole = whole if i in written else _value
        new_args[i] = [_entry(args[i], where, as_whole, first) for where in plan]
    return tuple(new_args), plan, made


def _stacked_alike(values, group: tuple[Storage, list], counter: bool, made: list) -> bool:
    """Whether ``values`` holds a stack at ``group``'s positions, aligned or made now, of members
    shaped as the group's (0-dim for step counters)."""
    shape = () if counter else group[0].aval.shape[1:]
    if _aligned(values, group, shape) or _restacked(values, group[1], shape, made):
        return True
    return counter and all(type(values[p]) is LazyTensor and not values[p].dim() for p in group[1])


def _repeated(values, group: tuple[Storage, list]) -> bool:
    """Whether one tensor stands at every one of a stack's positions of a list the op only reads
    (the sync-free optimizers' ``found_inf``), of no more dimensions than a member: the op takes
    it as is, broadcast over the stack as over each member."""
    stack, positions = group
    head = values[positions[0]]
    return (
        len(positions) > 1
        and isinstance(head, torch.Tensor)
        and head.dim() < len(stack.aval.shape)
        and all(values[p] is head for p in positions)
    )


def _per_member_scalars(values, group: tuple[Storage, list]) -> bool:
    """Whether a list the op only reads holds a 0-dim tensor at each of a stack's positions
    (a capturable optimizer's bias corrections, one per parameter, made from its step counters),
    where the stack's members are not 0-dim: the op takes them stacked, one per member, broadcast
    along the member's axes (``_entry``)."""
    stack, positions = group
    return len(stack.aval.shape) > 1 and all(
        type(values[p]) is LazyTensor and values[p].dim() == 0 for p in positions
    )


def _found_elsewhere(args: tuple, lists: list, last: list, made: list) -> tuple[list, list]:
    """(a list, its complete stacks) when the first list holds none: another list holding some
    (the gradients beside an optimizer's state restored from a checkpoint), else the first list
    restacked at the positions the call just before grouped (``last``; Adam's
    ``_foreach_mul_(exp_avg_sqs, beta2)`` comes right after ``_foreach_lerp_(exp_avgs, grads)``,
    and alone)."""
    for i in lists[1:]:
        found = _complete_stacks(args[i])
        if found:
            return args[i], found
    first = args[lists[0]]
    length, groups = last
    if length != len(first):
        return first, []
    for positions, shape in groups:
        _restacked(first, positions, shape, made)
    return first, _complete_stacks(first)


# The groups of the last foreach call over stacks, if it was the last foreach call at all:
# [its list length, [(positions, member shape)]].
_LAST_GROUPS: list = [0, []]


def _restacked(values, positions: list, shape: tuple, made: list) -> bool:
    """Whether the tensors of ``values`` at ``positions`` became the members of a new stack, in
    order (each a plain tensor of ``shape`` that nothing else aliases); the new stack is appended
    to ``made`` with its members' former shardings and whether it can be computed before the
    step: they all held data, or constants where the mode runs programs of its own."""
    tensors = [values[p] for p in positions]
    if not all(type(t) is LazyTensor and t._view is None and t.shape == shape for t in tensors):
        return False
    layouts = {t._storage.sharding for t in tensors}
    data = holds_data(tensors) or (current().mode.runs_side_programs and holds_constants(tensors))
    new = restack(tensors)
    if new is not None:
        made.append((new, layouts, data))
    return new is not None


def _complete_stacks(values) -> list[tuple[Storage, list]]:
    """(stack, the positions of its members 0..L-1) for each stack all of whose members are in
    ``values`` (``member`` inlined: this runs for every tensor of an optimizer's lists)."""
    at: dict = {}  # stack -> positions by index
    index = _MEMBER_INDEX.get
    for position, t in enumerate(values):
        view = t._view if type(t) is LazyTensor else None
        if view is None:
            continue
        k = index(id(view))
        if k is None:
            if len(view) != 1 or view[0].func is not _SELECT:
                continue
            axis, k = view[0].args
            if axis != 0 or k < 0:
                continue
        slots = at.get(t._storage)
        if slots is None:
            slots = at[t._storage] = [None] * t._storage.aval.shape[0]
        if slots[k] is None:
            slots[k] = position
    return [(stack, positions) for stack, positions in at.items() if None not in positions]


def _aligned(values, group: tuple[Storage, list], shape: tuple) -> bool:
    """Whether ``values`` holds, at the positions of ``group``'s stack, the members 0..L-1 of one
    stack of members of ``shape`` (or, for Python scalars, one value)."""
    stack, positions = group
    head = values[positions[0]]
    if not isinstance(head, torch.Tensor):  # Python scalars: one value for the whole stack
        return all(values[p] == head for p in positions)
    found = member(head)
    if found is None or found[0].aval.shape != (len(positions), *shape):
        return False
    theirs = found[0]
    for k, p in enumerate(positions):
        t = values[p]
        if type(t) is not LazyTensor or t._storage is not theirs:
            return False
        view = t._view
        if view is not _MEMBER_VIEWS[k] and (
            view is None or len(view) != 1 or view[0].func is not _SELECT or view[0].args != (0, k)
        ):
            return False
    return True


def _entry(values, where, as_whole: Callable, members: list | None = None):
    """The value at ``where`` (a position), or (a stack's positions) its stack, ``as_whole``;
    ``members``: the op's first list, whose stack at ``where`` the others are taken along."""
    if type(where) is int:
        return values[where]
    first = values[where[0]]
    if not isinstance(first, torch.Tensor):
        return first  # a Python scalar, one for the whole stack
    if len(where) > 1 and values[where[1]] is first:
        return first  # one tensor at every position (_repeated), broadcast over the stack
    if members is not None and first.dim() == 0 and members[where[0]].dim() > 0:
        # one 0-dim tensor per member (_per_member_scalars): stacked, shaped (L, 1, ...)
        stacked = emit_value(aten.stack.default, [Value(values[p]._ref()) for p in where], 0)
        shape = [len(where)] + [1] * members[where[0]].dim()
        return emit_value(aten.view.default, stacked, shape)
    return as_whole(first._storage)


def _counters_along(values, where):
    """A fused step's counter at ``where`` (a position), or at a stack's positions one value of
    shape (L,): their own stack, a strided slice of the one holding every counter
    (``counters_stacked``), else the counters stacked."""
    if type(where) is int:
        return values[where]
    found = [member(values[p]) for p in where]
    stack = found[0][0] if found[0] is not None else None
    if stack is not None and all(f is not None and f[0] is stack for f in found):
        indices = [k for _, k in found]
        start, step = indices[0], indices[1] - indices[0] if len(indices) > 1 else 1
        if step > 0 and indices == list(range(start, start + step * len(indices), step)):
            if len(indices) == stack.aval.shape[0]:
                return Value(stack.ref)
            return emit_value(aten.slice.Tensor, Value(stack.ref), 0, start, indices[-1] + 1, step)
    return emit_value(aten.stack.default, [Value(values[p]._ref()) for p in where], 0)


def _value(stack: Storage) -> Value:
    return Value(stack.ref)


def expand(outputs: list, plan: list) -> list:
    """A collapsed foreach op's results at the original positions: a stack's, its members."""
    length = sum(1 if type(where) is int else len(where) for where in plan)
    results: list = [None] * length
    for out, where in zip(outputs, plan):
        if type(where) is int:
            results[where] = out
        else:
            for position, piece in zip(where, members(out._storage)):
                results[position] = piece
    return results


# --- new stacks like existing ones ---------------------------------------------------------------

# stack -> {(op, arguments): [[a new stack like it (weakly), the next member to hand out], ...]}
_LIKE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def like(make, func, args: tuple, kwargs: dict):
    """``func(member k of a stack, ...)`` for a constant ``*_like`` op: member k of a new stack,
    ``func`` of the whole stack, shared with the calls for members 0..k-1 that came before it in
    order (as torch.optim makes each parameter's moments, one new stack per moment); None where
    ``args[0]`` is not such a member."""
    found = member(args[0])
    if found is None:
        return None
    stack, k = found
    key = (func, tuple(args[1:]), tuple(sorted(kwargs.items(), key=str)))
    opened = _LIKE.setdefault(stack, {}).setdefault(key, [])
    opened[:] = [e for e in opened if e[0]() is not None and e[1] < stack.aval.shape[0]]
    entry = next((e for e in opened if e[1] == k), None)
    if entry is None:
        if k != 0:
            return None
        new = make(func, (whole(stack),) + tuple(args[1:]), kwargs)._storage
        entry = [weakref.ref(new), 0]
        opened.append(entry)
    new = entry[0]()
    entry[1] += 1
    shape, dtype = new.aval
    return LazyTensor(new, Aval(shape[1:], dtype), _member_view(k))
