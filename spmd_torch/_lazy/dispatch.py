"""The single ``__torch_dispatch__``: every aten call on an xla tensor is resolved once to a handler.

Lookup order, cached per overload: engine specials (transfers, scalars) -> foreach -> aliases ->
a lowering (views keep aliasing) -> CompositeImplicit decomposition -> in-place/out through the
functional op -> PyTorch's decomposition -> CPU fallback (counted as ``aten::<op>``, warned once).
In eager mode (per engine) each op issued by user code then runs at once.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch._decomp import decomposition_table

from spmd_torch import config

from . import attention, collective, counters, placement, rng, stacks, transfer, views
from .engine import FORKED_AFTER_JAX, current, refuse_in_bad_fork
from .execute import compute_now, stack_counters, sync, to_cpu
from .graph import Aval, Node, Value
from .lowering import LOWERINGS, amp, ctc, factories, optim
from .lowering.foreach import element_overload, element_packet
from .record import (
    LIFTED_INTS,
    NESTED,
    TENSOR,
    DeviceMismatchError,
    Lifted,
    NoStaticShape,
    emit,
    emit_value,
    user_frame,
    user_stacklevel,
)
from .tensor import DEVICE, SEVERAL_DEVICES, LazyTensor, connect, wrap, wrap_data
from .transfer import host_copy, landing, to_device_array, upload

aten = torch.ops.aten

_HANDLERS: dict = {}  # id(overload) -> handler
# PyTorch's decompositions into aten ops; the torch._refs ones end in prims, which we don't lower.
_DECOMPOSITIONS = {
    op: fn
    for op, fn in decomposition_table.items()
    if not getattr(fn, "__module__", "").startswith("torch._refs")
}
_DECOMPOSITIONS |= amp.DECOMPOSITIONS | ctc.DECOMPOSITIONS


def issue(func, args: tuple, kwargs: dict) -> Any:
    """An aten call on xla tensors, from user code: traced, and in eager mode also run at once
    (what an op issues itself, a decomposition's ops, runs with it)."""
    engine = current()
    if not engine.eager:
        return dispatch(func, args, kwargs)
    engine.eager_depth += 1
    try:
        out = dispatch(func, args, kwargs)
    finally:
        engine.eager_depth -= 1
    if engine.eager_depth == 0:
        sync()
    return out


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    handler = _HANDLERS.get(id(func))  # OpOverload.__hash__ is Python code; overloads live forever
    if handler is None:
        handler = _HANDLERS[id(func)] = _resolve(func)
    try:
        return handler(func, args, kwargs)
    except Exception as error:
        # An exception leaving a backward op of a Python PrivateUse1 backend terminates the
        # process (PyTorch 2.11-2.13). Inside backward, a failing handler degrades to the CPU.
        if handler is _cpu_fallback or torch._C._current_autograd_node() is None:
            raise
        warnings.warn(
            f"{func} failed on xla inside backward ({error}); running it on the CPU", stacklevel=2
        )
        return _cpu_fallback(func, args, kwargs)


def _resolve(func) -> Callable:
    if func in SPECIALS:
        return SPECIALS[func]
    if func in _THROUGH_FUNCTIONAL:
        return partial(_through_functional, *_THROUGH_FUNCTIONAL[func])
    name = func._schema.name.split("::")[1]
    if name.startswith("_foreach_"):
        return _foreach_handler(func)
    if func in views.IDENTITY_VIEWS:
        return lambda f, args, kwargs: views.alias(args[0])
    if func in views.SPLIT_VIEWS:
        return lambda f, args, kwargs: views.split_views(args[0], f, args[1:])
    if torch.Tag.inplace_view in func.tags:
        return _inplace_view
    handler = _lowered_handler(func)
    if handler is not None and func in _INDEXING:
        return _with_device_indices(handler)
    if handler is not None and func in _CLASS_TARGETS:
        return _with_class_indices(handler, _CLASS_TARGETS[func])
    if handler is not None and func in factories.MADE_LIKE:  # zeros_like(p): laid out like p
        made_like = partial(_made_like, handler)
        handler = partial(_stacked_like, made_like) if func in factories.STACKED_LIKE else made_like
    if handler is not None and func in factories.CONSTANT_FILLS:
        return partial(_filled, handler)
    if handler is not None:
        return handler
    if _has_kernel(func, "CompositeImplicitAutograd"):
        return lambda f, args, kwargs: f.decompose(*args, **kwargs)
    functional = _functional_variant(func)
    if functional is not None and (functional in LOWERINGS or func not in _DECOMPOSITIONS):
        return _mutation(functional)
    if not any("Tensor" in str(a.type) for a in func._schema.arguments):
        return _cpu_fallback  # factories decompose into themselves; make them on the CPU
    decomposition = _DECOMPOSITIONS.get(func)
    if decomposition is not None:
        return lambda f, args, kwargs: decomposition(*args, **kwargs)
    if func.namespace != "aten" and _has_kernel(func, "CompositeExplicitAutograd"):
        # a library's op (torch.library.custom_op): its kernel's torch ops come back here
        return lambda f, args, kwargs: f._op_dk(_COMPOSITE, *args, **kwargs)
    return _cpu_fallback


_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd


def _made_like(handler: Callable, func, args: tuple, kwargs: dict) -> LazyTensor:
    return placement.follow(handler(func, args, kwargs), args[0])


def _filled(handler: Callable, func, args: tuple, kwargs: dict) -> LazyTensor:
    """A constant fill (``zeros``, ``zeros_like``...): its storage is noted as born of it, for
    the barrier (execute._constants_first)."""
    out = handler(func, args, kwargs)
    storage = out._storage
    node, index = storage.ref
    current().born.append((weakref.ref(storage), weakref.ref(node), index))
    return out


def _stacked_like(made_like: Callable, func, args: tuple, kwargs: dict) -> LazyTensor:
    """``zeros_like(p)``: a member of a new stack where ``p`` is a stack's (stacks.like)."""
    made = stacks.like(made_like, func, args, kwargs)
    return made_like(func, args, kwargs) if made is None else made


def _has_kernel(func, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
}


# PyTorch/XLA takes float class indices as nll_loss targets, where CPU PyTorch wants integers.
_CLASS_TARGETS = {
    aten.nll_loss_forward.default: 1,
    aten.nll_loss2d_forward.default: 1,
    aten.nll_loss_backward.default: 2,
    aten.nll_loss2d_backward.default: 2,
}


def _with_class_indices(handler: Callable, position: int) -> Callable:
    def handle(func, args: tuple, kwargs: dict) -> Any:
        if args[position].dtype.is_floating_point:
            args = (*args[:position], args[position].long(), *args[position + 1 :])
        return handler(func, args, kwargs)

    return handle


def _lowered_handler(func) -> Callable | None:
    lowering = LOWERINGS.get(func)
    if lowering is None:
        return None
    handler = _recorder(func, lowering)
    positions = _LIFTED_AT.get(func)
    return handler if positions is None else partial(_lifting, positions, handler)


def _recorder(func, lowering) -> Callable:
    if func is aten.as_strided.default:
        return _as_strided
    if func.is_view:
        return _view
    if lowering.random is True:
        return _record_random
    if lowering.random:
        return partial(_record_random_when, lowering.random)
    if torch.Tag.pointwise not in func.tags or lowering.static_scalars:
        return _record
    return _record_pointwise if _lifts_ints(func) else _record_pointwise_floats


# Ops ATen does not tag pointwise, and the positions of their numbers that are program inputs too
# (the others, a size, a dim, an index, shape the program): PyTorch/XLA makes these numbers device
# data, so a new value each step is one program, not one per value. ``torch.where(mask, value,
# x)`` wraps its number in ``scalar_tensor``, an LR scheduler writes a tensor learning rate with
# ``lr.fill_(value)``, and ``torch.full(size, value)``, ``index_fill`` or a dropout schedule
# change their number step by step (dropout's backward, tagged pointwise, lifts its scale
# already). A bool, a complex or an int beyond 2**53 there stays in the program.
_LIFTED_AT = {
    aten.where.ScalarSelf: (1,),
    aten.where.ScalarOther: (2,),
    aten.where.Scalar: (1, 2),
    aten.scalar_tensor.default: (0,),
    aten.fill.Scalar: (1,),
    aten.full.default: (1,),
    aten.full_like.default: (1,),
    aten.new_full.default: (2,),
    aten.index_fill.int_Scalar: (3,),
    aten.scatter.value: (3,),
    aten.scatter.value_reduce: (3,),
    aten.native_dropout.default: (1,),
}


def _lifting(positions: tuple, handler: Callable, func, args: tuple, kwargs: dict) -> Any:
    args = list(args)
    for k in positions:
        value = args[k]
        cls = type(value)
        if cls is float or (cls is int and value in LIFTED_INTS):
            args[k] = Lifted(value)
    return handler(func, tuple(args), kwargs)


def _lifts_ints(func) -> bool:
    """Whether an op's Python ints are program inputs, as its floats are: unless its schema
    takes an ``int`` (``round(x, decimals)``), where an int is never a Scalar."""
    return not any(str(a.type).lstrip("Sym").startswith("int") for a in func._schema.arguments)


# --- recording -----------------------------------------------------------------------------------


def _wrap_outputs(node, structure) -> Any:
    """The node's outputs as the op returns them: tensors, and its other results (a SymInt the
    meta kernel computed from shapes, None) as they were."""
    if structure is None:
        return wrap((node, 0), node.avals[0])
    container, entries = structure
    outputs, k = [], 0
    for entry in entries:
        if entry is TENSOR:
            outputs.append(wrap((node, k), node.avals[k]))
            k += 1
        elif container is NESTED:  # a list of tensors, ``entry`` long
            outputs.append([wrap((node, i), node.avals[i]) for i in range(k, k + entry)])
            k += entry
        else:
            outputs.append(entry)
    return tuple(outputs) if container is NESTED else container(outputs)


def _record(func, args: tuple, kwargs: dict) -> Any:
    try:
        node, structure = emit(func, args, kwargs)
    except NoStaticShape:  # data-dependent shape (x[mask]): compute it on the CPU, counted
        return _cpu_fallback(func, args, kwargs, why="has an output shape that depends on its data")
    return _wrap_outputs(node, structure)


def _record_pointwise(func, args: tuple, kwargs: dict) -> Any:
    node, structure = emit(func, args, kwargs, lift_floats=True, lift_ints=True)
    return _wrap_outputs(node, structure)


def _record_pointwise_floats(func, args: tuple, kwargs: dict) -> Any:
    node, structure = emit(func, args, kwargs, lift_floats=True)
    return _wrap_outputs(node, structure)


def _record_random(func, args: tuple, kwargs: dict) -> Any:
    node, structure = emit(func, args, kwargs, key=rng.next_key())
    return _wrap_outputs(node, structure)


def _record_random_when(draws: Callable, func, args: tuple, kwargs: dict) -> Any:
    """An op that draws numbers for some calls only (attention with dropout): the others leave
    the engine's random stream where it was."""
    key = rng.next_key() if draws(args, kwargs) else rng.current_key()
    node, structure = emit(func, args, kwargs, key=key)
    return _wrap_outputs(node, structure)


def _with_device_indices(handler: Callable) -> Callable:
    """Indexing accepts CPU index tensors with device data, as PyTorch does: upload them first."""

    def upload(func, args: tuple, kwargs: dict) -> Any:
        indices = [
            _upload(i, None) if isinstance(i, torch.Tensor) and not isinstance(i, LazyTensor) else i
            for i in args[1]
        ]
        return handler(func, (args[0], indices, *args[2:]), kwargs)

    return upload


def _as_strided(func, args: tuple, kwargs: dict) -> LazyTensor:
    """``as_strided`` must stay inside its base, as PyTorch checks against the storage."""
    base, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset") or 0
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
    elements = math.prod(base._storage.aval.shape)
    if last >= elements:
        raise RuntimeError(
            f"as_strided: size {list(size)}, stride {list(stride)}, offset {offset} reads "
            f"element {last}, out of bounds for a storage of {elements} elements"
        )
    same = (tuple(size), tuple(stride)) == (tuple(base.shape), base.stride())
    if base._view is None and not offset and same:  # the storage as it is (empty_like's restride)
        return views.alias(base)
    return _view(func, args, kwargs)


def _view(func, args: tuple, kwargs: dict) -> LazyTensor:
    if kwargs:
        args = args + tuple(kwargs.values())
    return views.make_view(args[0], func, args[1:])


def _inplace_view(func, args: tuple, kwargs: dict) -> LazyTensor:
    """``x.unsqueeze_(0)``, ``x.t_()``: ``x`` becomes a view of its own former self."""
    target = args[0]
    reshaped = views.make_view(target, _out_of_place_view(func), args[1:])
    with torch._C._DisableTorchDispatch():
        func(target, *args[1:], **kwargs)  # the wrapper's own sizes and strides
    target._view = reshaped._view
    target._remember(reshaped._cache)
    return target


@functools.cache
def _out_of_place_view(func):
    """The view op an in-place one applies: the overload of the same name, or the one taking the
    same arguments (``transpose_.default`` is ``transpose.int``)."""
    packet = getattr(aten, func._schema.name.split("::")[1][:-1])
    if func._overloadname in packet.overloads():
        return getattr(packet, func._overloadname)
    wanted = [str(a.type) for a in func._schema.arguments[1:]]
    for name in packet.overloads():
        if [str(a.type) for a in getattr(packet, name)._schema.arguments[1:]] == wanted:
            return getattr(packet, name)
    raise NotImplementedError(f"{func}: no view overload of {packet} takes its arguments")


# --- mutation ------------------------------------------------------------------------------------

_FUNCTIONAL_SPECIAL = {
    "normal_": "normal_functional",
    "bernoulli_.float": "bernoulli.p",
}


def _functional_variant(func):
    """The out-of-place overload computing what in-place or ``out=`` ``func`` writes, or None."""
    schema = func._schema
    name = schema.name.split("::")[1]
    overload = func._overloadname
    mutated = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not mutated:
        return None
    special = _FUNCTIONAL_SPECIAL.get(f"{name}.{overload}", _FUNCTIONAL_SPECIAL.get(name))
    if special is not None:
        packet_name, _, special_overload = special.partition(".")
        packet = getattr(aten, packet_name, None)
        return getattr(packet, special_overload or "default", None) if packet else None
    if name.endswith("_") and mutated[0].name == "self" and len(mutated) == 1:
        return _overload_taking(getattr(aten, name[:-1], None), schema.arguments, overload)
    if all(a.kwarg_only for a in mutated):  # out= variants
        arguments = [a for a in schema.arguments if a not in mutated]
        return _overload_taking(getattr(aten, name, None), arguments, None, exclude=func)
    # An argument written as a side effect (rrelu_with_noise's noise): functionalization's
    # ``<op>_functional`` returns the results, then the arguments' new values.
    return getattr(getattr(aten, f"{name}_functional", None), "default", None)


def _overload_taking(packet, arguments, preferred, exclude=None):
    """The overload of ``packet`` whose arguments have these names and types (pow_.Scalar takes
    a tensor and a scalar, like pow.Tensor_Scalar, not like pow.Scalar)."""
    if packet is None:
        return None
    wanted = [(a.name, str(a.type)) for a in arguments]
    names = packet.overloads()
    if preferred in names:
        names = [preferred] + [n for n in names if n != preferred]
    for candidate in names:
        op = getattr(packet, candidate)
        if op is not exclude and [(a.name, str(a.type)) for a in op._schema.arguments] == wanted:
            return op
    return None


def _mutation(functional) -> Callable:
    def mutate(func, args: tuple, kwargs: dict) -> Any:
        schema = func._schema
        out_names = [
            a.name
            for a in schema.arguments
            if a.kwarg_only and a.alias_info and a.alias_info.is_write
        ]
        if out_names:  # out= variant: compute, then write into the out tensors
            outs = [kwargs[n] for n in out_names]
            kwargs = {k: v for k, v in kwargs.items() if k not in out_names}
            result = dispatch(functional, args, kwargs)
            results = result if isinstance(result, (tuple, list)) else (result,)
            for out, value in zip(outs, results):
                _assign(out, value, func)
            return outs[0] if len(outs) == 1 else tuple(outs)
        result = dispatch(functional, args, kwargs)
        returned = len(schema.returns)
        if len(functional._schema.returns) > returned:  # results, then the written arguments
            written = [
                k for k, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write
            ]
            for position, value in zip(written, result[returned:]):
                _assign(args[position], value, func)
            return result[0] if returned == 1 else tuple(result[:returned])
        _assign(args[0], result, func)
        return args[0]

    return mutate


def _assign(target: LazyTensor, value: Any, func) -> None:
    """Write ``value`` into ``target`` with in-place semantics: same shape, castable dtype."""
    if not isinstance(value, LazyTensor):
        value = torch.as_tensor(value, dtype=target.dtype)
    if tuple(value.shape) != tuple(target.shape):
        raise RuntimeError(
            f"{func}: output with shape {list(target.shape)} doesn't match the broadcast shape "
            f"{list(value.shape)}"
        )
    if value.dtype != target.dtype:
        if not torch.can_cast(value.dtype, target.dtype):
            raise RuntimeError(
                f"{func}: result type {_dtype_name(value.dtype)} can't be cast to the desired "
                f"output type {_dtype_name(target.dtype)}"
            )
        value = emit_value(aten._to_copy.default, value, dtype=target.dtype)
        target._write(value.ref)
        return
    target._write(value._ref())


def _dtype_name(dtype: torch.dtype) -> str:
    """PyTorch's name for the dtype in errors: Float, Long, BFloat16..."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def _copy_(func, args: tuple, kwargs: dict) -> LazyTensor:
    """``dst.copy_(src)``: the way data enters the device (``.to('xla')``) and writes through views."""
    dst, src = args[0], args[1]
    if not isinstance(dst, LazyTensor):  # device -> CPU copy into an existing CPU tensor
        return dst.copy_(to_cpu(src))
    if isinstance(src, LazyTensor) and src.dtype == dst.dtype and src.shape == dst.shape:
        value = Value(src._ref())  # values are immutable: the copy is src's value itself
        if SEVERAL_DEVICES and value.ref[0].device != dst._ref()[0].device:
            value = emit_value(aten.copy.default, dst, src)  # onto dst's device
    elif isinstance(src, LazyTensor):
        value = emit_value(aten.copy.default, dst, src)
    else:
        if isinstance(src, torch.nn.parameter.UninitializedTensorMixin):
            raise RuntimeError(
                f"{type(src).__name__} (a lazy module's, before its first forward) cannot move to "
                f"the {DEVICE.type} device: run the module once on a CPU input, which gives its "
                "parameters their shapes, then move it"
            )
        host = host_copy(src.detach().to(dst.dtype).expand(dst.shape).contiguous())
        sharding = dst._storage.sharding if dst._view is None else None  # keep a marked layout
        device = dst._ref()[0].device
        array = current().mode.stage(host, device) if sharding is None else upload(host, sharding)
        if dst._view is None:
            placement.remember(dst._storage, array)
            dst._storage.from_host = sharding is None  # lands replicated: a layout, not a spec
        node = Node.data(array, Aval(tuple(dst.shape), dst.dtype), device)
        if type(array) is transfer.HostData and config.FACE.on:
            transfer.UPLOAD_WHEN_READ.add(node)
        value = Value((node, 0))
    dst._write(value.ref)
    return dst


# --- foreach -------------------------------------------------------------------------------------


def _foreach_handler(func) -> Callable:
    """``_foreach_X(lists...)`` as one node over the whole lists where its element op is lowered
    (``lowering/foreach.py``; in place: the functional op, then each result written back), else
    as X applied per element."""
    name = func._schema.name.split("::")[1]
    inplace = name.endswith("_")
    functional = getattr(getattr(aten, name.rstrip("_"), None), func._overloadname, None)
    lowering = LOWERINGS.get(functional if inplace else func)
    if lowering is not None:
        lift = not lowering.static_scalars
        lift_ints = lift and _lifts_ints(functional if inplace else func)
        element = element_overload(func)[0]
        pointwise = element is not None and torch.Tag.pointwise in element.tags
        record = partial(_record_foreach, functional if inplace else None, lift, lift_ints)
        if func is aten._foreach_norm.Scalar:
            return partial(_norms_over_stacks, record)
        return partial(_over_stacks, record) if pointwise else record
    packet = element_packet(func)
    write_back = inplace and not packet.__name__.endswith("_")  # maximum_ does not exist: copy
    element, trailing = element_overload(func)
    if element is not None:  # the element's positional arguments; the rest are its keywords
        positional = sum(not a.kwarg_only for a in element._schema.arguments)

    def foreach(func, args: tuple, kwargs: dict) -> Any:
        length = next(len(a) for a in args if isinstance(a, (list, tuple)))
        results = []
        for i in range(length):
            element_args = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            element_kwargs = {
                k: v[i] if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()
            }
            if element is None:  # no overload matched by type: let PyTorch resolve it
                result = packet(*element_args, **element_kwargs)
            else:
                element_kwargs.update(zip(trailing, element_args[positional:]))
                result = dispatch(element, tuple(element_args[:positional]), element_kwargs)
            if write_back:
                _assign(element_args[0], result, func)
            results.append(result)
        return None if inplace else results

    return foreach


def _record_foreach(functional, lift: bool, lift_ints: bool, func, args: tuple, kwargs: dict):
    """One node for the whole call; in place (``functional`` given), each of its results is
    written to the tensor of the first list it belongs to."""
    if not args[0]:
        return None if functional is not None else []
    op = func if functional is None else functional
    node, structure = emit(op, args, kwargs, lift_floats=lift, lift_ints=lift_ints)
    if functional is None:
        return _wrap_outputs(node, structure)
    for k, target in enumerate(args[0]):
        aval = node.avals[k]
        if aval.dtype == target.dtype and aval.shape == tuple(target.shape):
            target._write((node, k))
        else:
            _assign(target, wrap((node, k), aval), func)
    return None


def _over_stacks(record: Callable, func, args: tuple, kwargs: dict) -> Any:
    """A pointwise foreach op recorded over whole stacks where its lists hold all their members
    (stacks.py: one array updated per stack, not one per member)."""
    if len(args) == 2 and not isinstance(args[1], (list, tuple)):
        stack_counters(args[0])  # ``_foreach_add_(step_counters, 1)``
    collapsed = stacks.collapse(args)
    if collapsed is None:
        return record(func, args, kwargs)
    args, plan, made = collapsed
    _compute_new_stacks(made)
    results = record(func, args, kwargs)
    return None if results is None else stacks.expand(results, plan)


def _compute_new_stacks(made: list) -> None:
    """Stacks a foreach op made (stacks.collapse) laid out as their members were, and those of
    data computed now, by a small program of their own: the step's program is then the one every
    later step runs (they read the stacks as data)."""
    for whole, layouts, _ in made:
        placement.lay_out_stack(whole, layouts)
    compute_now([whole for whole, _, data in made if data])


def _norms_over_stacks(record: Callable, func, args: tuple, kwargs: dict) -> list:
    """``_foreach_norm`` (clip_grad_norm_'s): the norms of a complete stack's members as one
    ``vector_norm`` of the stack over all but its stacked axis, the other tensors' as one node."""
    collapsed = stacks.collapse(args)
    if collapsed is None:
        return record(func, args, kwargs)
    (tensors, *rest), plan, made = collapsed
    _compute_new_stacks(made)
    ord = rest[0] if rest else kwargs.get("ord", 2)
    dtype = rest[1] if len(rest) > 1 else kwargs.get("dtype")
    singles = [t for t, where in zip(tensors, plan) if type(where) is int]
    norms = iter(record(func, (singles, *rest), kwargs) if singles else [])
    results = [
        next(norms)
        if type(where) is int
        else torch.linalg.vector_norm(t.reshape(t.shape[0], -1), ord, dim=1, dtype=dtype)
        for t, where in zip(tensors, plan)
    ]
    return stacks.expand(results, plan)


# Ops writing lists in place -> (their functional overload, the arguments they write).
_THROUGH_FUNCTIONAL = optim.FUSED_STEPS | amp.CHECK_AND_UNSCALE


def _through_functional(functional, writes: tuple, func, args: tuple, kwargs: dict) -> None:
    """An op writing lists in place (a fused optimizer step, the scaler's check) as one node:
    its functional overload, whose results are written back to the arguments it updates (a
    step's gradients too when it unscales them). Over whole stacks where its lists hold all of
    a stack's members, as a pointwise foreach op is (``_over_stacks``)."""
    if kwargs.get("grad_scale") is not None:
        writes += (1,)
    counters = optim.STEP_COUNTERS.get(functional)
    collapsed = stacks.collapse(args, frozenset(writes), counters)
    if collapsed is not None:
        args, _, made = collapsed
        _compute_new_stacks(made)
    if counters is not None:
        args = (*args[:counters], stacks.counters_read(args[counters]), *args[counters + 1 :])
    node, (_, entries) = emit(functional, args, kwargs, lift_floats=True)
    start = 0
    for position, entry in enumerate(entries):
        length = 1 if entry is TENSOR else entry
        if position in writes:
            targets = (
                args[position] if isinstance(args[position], (list, tuple)) else [args[position]]
            )
            for k, target in enumerate(targets):
                target._write((node, start + k))
        start += length


# --- specials ------------------------------------------------------------------------------------


def _copy_from(func, args: tuple, kwargs: dict) -> LazyTensor:
    """``_copy_from(src, dst)``: the backend half of ``dst.copy_(src)``."""
    return _copy_(aten.copy_.default, (args[1], args[0]), {})


def _to_copy(func, args: tuple, kwargs: dict) -> Any:
    """``.to(device/dtype)``: leaving the device materialises; staying records a conversion."""
    device = kwargs.get("device")
    device = None if device is None else torch.device(device)
    if device is not None and device.type != DEVICE.type:
        out = to_cpu(args[0])
        dtype = kwargs.get("dtype")
        return out.to(dtype) if dtype is not None else out
    if device is not None and device.index:  # another xla device: its program reads this
        current().mode.use_device(device.index)
    node, structure = emit(func, args, kwargs)
    return _wrap_outputs(node, structure)


def _mm(func, args: tuple, kwargs: dict) -> LazyTensor:
    """``a @ x.t()`` is recorded as ``linear(a, x)``: the matmul reads ``x`` itself, the value the
    forward pass's matmul read too (autograd's ``mm(grad, weight.t().t())``), so the partitioner
    gathers a sharded weight once for both passes, as it does for jax's autodiff."""
    a, b = args
    if type(b) is LazyTensor:
        node, index = b._ref()
        if node.op is aten.t.default and len(node.avals[0].shape) == 2:
            out, _ = emit(aten.linear.default, (a, Value(node.src[0])), {})
            return wrap((out, 0), out.avals[0])
    node, structure = emit(func, args, kwargs)
    return _wrap_outputs(node, structure)


def _local_scalar_dense(func, args: tuple, kwargs: dict) -> Any:
    """``.item()``: counted under PyTorch/XLA's name, which its troubleshooting guide finds host
    syncs by, though the value is computed on the device and only the scalar transferred."""
    counters.bump(counters.HOST_SCALAR_READ)
    return to_cpu(args[0]).item()


def _is_nonzero(func, args: tuple, kwargs: dict) -> bool:
    """``bool(t)``, ``if t:``: a host read of one scalar, counted as ``.item()``."""
    counters.bump(counters.HOST_SCALAR_READ)
    return _materialising(func, args, kwargs)


def _materialising(func, args: tuple, kwargs: dict) -> Any:
    """Ops whose result is host data (equal, is_nonzero), like ``.item()``: not a fallback."""
    return _cpu_fallback(func, args, kwargs, count=False)


def _allclose(func, args: tuple, kwargs: dict) -> bool:
    """``isclose(...).all()`` on the device: only the answer comes back to the host."""
    close = dispatch(aten.isclose.default, args, kwargs)
    return bool(to_cpu(dispatch(aten.all.default, (close,), {})).item())


_WARNED: set = set()


def _cpu_fallback(func, args: tuple, kwargs: dict, count: bool = True, why: str = "") -> Any:
    """Run an op on the CPU (no lowering, or a data-dependent shape); the result uploaded."""
    name = func._schema.name.split("::")[1]
    if count:
        counters.bump(f"aten::{name}")
        counters.note_site(f"aten::{name}", user_frame())
        if func not in _WARNED:
            _WARNED.add(func)
            why = why or "has no xla lowering"
            warnings.warn(
                f"{func} {why}; it runs on the CPU (slow: a device round trip)",
                stacklevel=user_stacklevel(),
            )

    def to_host(x):
        if isinstance(x, LazyTensor):
            return to_cpu(x)
        if isinstance(x, torch.device) and x.type == DEVICE.type:
            return torch.device("cpu")
        if isinstance(x, (list, tuple)):
            return type(x)(to_host(v) for v in x)
        return x

    host_args = to_host(args)
    host_kwargs = {k: to_host(v) for k, v in kwargs.items()}
    out = func(*host_args, **host_kwargs)
    device = next((a._ref()[0].device for a in args if isinstance(a, LazyTensor)), 0)
    names = [a.name for a in func._schema.arguments]
    for argument in func._schema.arguments:  # CPU-side mutations go back to the device tensors
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        position = names.index(argument.name)
        if argument.kwarg_only:
            target, source = kwargs.get(argument.name), host_kwargs.get(argument.name)
        elif position < len(args):
            target, source = args[position], host_args[position]
        else:
            continue
        if isinstance(target, LazyTensor):
            _copy_(aten.copy_.default, (target, source), {})
            if out is source:
                return target
    return _upload(out, device or 0)


def _upload(out: Any, device: int = 0) -> Any:
    """A CPU result as device data on xla:``device`` (None: read by any device's program)."""
    if isinstance(out, torch.Tensor):
        out = out.contiguous()
        array = to_device_array(out, landing(device or 0))
        return wrap_data(array, Aval(tuple(out.shape), out.dtype), device)
    if isinstance(out, (list, tuple)):
        return type(out)(_upload(o, device) for o in out)
    return out


def _set_(func, args: tuple, kwargs: dict) -> LazyTensor:
    """``t.set_(src)``: make ``t`` an alias of ``src``'s value (``param.data = x``)."""
    dst, src = args[0], args[1]
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise RuntimeError(f"set_: cannot rebind a {list(dst.shape)} tensor to {list(src.shape)}")
    dst._alias_of(src)
    return dst


def _functional_all_reduce(func, args: tuple, kwargs: dict) -> LazyTensor:
    """torch.distributed's functional all_reduce (xm.all_reduce inside torch.compile) over all
    replicas; its group name is empty, as PyTorch/XLA's is."""
    tensor, reduce_type = args[0], args[1]
    return collective.all_reduce(reduce_type, [tensor], 1.0, None)[0]


_FUNCTIONAL = torch.ops._c10d_functional

SPECIALS: dict = {
    _FUNCTIONAL.all_reduce.default: _functional_all_reduce,
    _FUNCTIONAL.wait_tensor.default: lambda func, args, kwargs: views.alias(args[0]),
    aten.copy_.default: _copy_,
    aten._copy_from.default: _copy_from,
    aten._copy_from_and_resize.default: _copy_from,
    aten._to_copy.default: _to_copy,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.mm.default: _mm,
    aten.set_.source_Tensor: _set_,
    aten.equal.default: _materialising,
    aten.allclose.default: _allclose,
    aten._linalg_check_errors.default: _materialising,  # raises PyTorch's error from `info`
    aten.is_nonzero.default: _is_nonzero,
    aten.nonzero.default: _cpu_fallback,  # data-dependent output shapes
    aten.masked_select.default: _cpu_fallback,
    aten._unique2.default: _cpu_fallback,
    # reached where autograd is skipped (inference mode): the fused op, not the math form
    aten.scaled_dot_product_attention.default: lambda func, args, kwargs: (
        attention.scaled_dot_product_attention(*args, **kwargs)
    ),
}

connect(issue)


def _refuse_after_fork(func, args: tuple, kwargs: dict) -> Any:
    refuse_in_bad_fork(f"{func} on an xla tensor")


def _after_fork_in_child() -> None:
    """In a child forked after JAX started, every op on an xla tensor raises at once: JAX cannot
    run there, and a DataLoader worker's collate would build a shared xla storage and crash."""
    if FORKED_AFTER_JAX:
        connect(_refuse_after_fork)


os.register_at_fork(after_in_child=_after_fork_in_child)  # after engine's: it notes the fork

__all__ = ["dispatch", "DeviceMismatchError"]
