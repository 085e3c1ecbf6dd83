"""Where device data lives: one device, or (in SPMD mode) the devices of the mesh, sharded as marked.

Outside SPMD mode every array sits on JAX's default device. In SPMD mode (modes.SpmdMesh) uploads
land replicated over all devices, and any array still on one device moves onto them the first time
a program uses it (PyTorch/XLA's one-time replication when SPMD starts).

A tensor's sharding belongs to its storage: ``mark`` places data or constrains a pending value
(a ``CONSTRAIN`` node), and the barrier constrains every later value written to that storage the
same way, so in-place updates (parameters, optimizer state) keep their layout and a training loop
compiles once. An output the partitioner sharded on its own keeps that sharding from then on.
A tensor made like a sharded one (``zeros_like``, ``clone``), and a marked parameter's gradient,
get its layout (``follow``): optimizer state is sharded like its parameter, as in any FSDP.

Uneven shardings (a dimension not divisible by its mesh axes) are stored padded at the end of each
dimension, as PyTorch/XLA does, because JAX arrays cannot be uneven: the graph keeps the logical
shape, programs slice padded inputs and pad outputs back.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from . import stacks, transfer
from .engine import current
from .graph import Arg, Aval, Node, Ref
from .layout import canonical, crop, even_part, pad_to, padded, padded_shape
from .lowering.sharding import CONSTRAIN
from .tensor import LazyTensor, Storage, on_xla, wrap, wrap_data


def resolve(node: Node, index: int) -> jax.Array:
    """A leaf's device array: host-held data is uploaded (replicated) first."""
    array = node.arrays[index]
    if type(array) is transfer.HostData:
        array = node.arrays[index] = transfer.upload(array.host, array.sharding)
    elif type(array) is transfer.ReplicaShard:
        return array.local()  # the handle stays: the next program takes the stacked array whole
    return array


def output_sharding(storage: Storage, aval: Aval):
    """The sharding the barrier gives ``storage``'s new value (None: the partitioner decides)."""
    sharding = storage.sharding
    if sharding is not None and len(getattr(sharding, "spec", ())) > len(aval.shape):
        return None  # the storage changed rank since it was marked (resize_, set_)
    return sharding


def remember(storage: Storage, array: jax.Array) -> None:
    """Keep the layout the partitioner chose for an output, so the next step reuses it (a
    replica's block has none). The output is the storage's own value from now on."""
    storage.from_host = False
    if storage.sharding is not None:
        return
    sharding = getattr(array, "sharding", None)  # a replica's block has none
    if type(sharding) is not SingleDeviceSharding and sharding is not None:
        if sharding.num_devices > 1:  # a property that builds a set: asked only when needed
            storage.sharding = key_of(sharding)


def key_of(sharding):
    """``sharding`` as compile keys see it: replicated over every device is one layout, whichever
    mesh object it names (uploads use ours, program outputs the user's)."""
    replicated = current().mode.replicated
    if replicated is not None and sharding.num_devices > 1 and sharding.is_fully_replicated:
        return replicated
    return sharding


def mark(t: LazyTensor, sharding: NamedSharding) -> None:
    """Give ``t`` this sharding: data moves onto the mesh, a pending value gets a constraint."""
    sharding = canonical(sharding)
    on_xla(t, "mark_sharding")
    current().mode.refuse_per_replica("mark_sharding")
    found = stacks.member(t)
    if found is not None and type(sharding) is NamedSharding:  # a layer's weight in its stack
        mark(
            stacks.whole(found[0]),
            NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec)),
        )
        return
    node, index = ref = t._ref()
    if t._view is not None and not node.is_leaf(index):
        t._remember(_constrained(ref, sharding))  # a pending view: this value only, as PyTorch/XLA
        return
    storage = t._storage  # its own value, or an identity view (detach) of one: mark the storage
    storage.sharding = sharding
    _grads_follow(t)
    node, index = storage.ref
    aval = node.avals[index]
    if node.is_leaf(index) and type(node.arrays[index]) is not jax.ShapeDtypeStruct:
        storage.set((Node.data(_place(node.arrays[index], aval, sharding), aval), 0))
        return
    # a pending value, or an input of a graph being traced (a placeholder: no data to move)
    storage.set(_constrained(storage.ref, sharding))


def restack(tensors: list) -> tuple[LazyTensor | None, bool]:
    """``stacks.restack(tensors)``, the new stack laid out as they were (``lay_out_stack``), and
    whether they all held data: a stack of data is computed before the step that reads it
    (``execute.compute_now``), so that step's program is the one every later step runs."""
    layouts = {sharding_of(t) for t in tensors}
    data = stacks.holds_data(tensors)
    whole = stacks.restack(tensors)
    if whole is not None:
        lay_out_stack(whole, layouts)
    return whole, data


def lay_out_stack(whole: LazyTensor, layouts: set) -> None:
    """A new stack laid out as its members were (``layouts``: their shardings) when they all
    had one sharding over several devices, the stacked axis unsplit."""
    if len(layouts) == 1:
        (layout,) = layouts
        if type(layout) is NamedSharding and not layout.is_fully_replicated:
            mark(whole, NamedSharding(layout.mesh, PartitionSpec(None, *layout.spec)))


def _constrained(ref: Ref, sharding: NamedSharding) -> Ref:
    aval = ref[0].avals[ref[1]]
    return (Node(CONSTRAIN, (ref,), (Arg(0), sharding), {}, (aval,)), 0)


def follow(t, source):
    """``t``, made like ``source``, laid out as ``source``'s storage is unless ``t``'s has a layout
    already; a replicated source (or none: one device, a replica of launch) leaves it to the
    partitioner. Returns ``t``."""
    if not (type(t) is type(source) is LazyTensor) or t._view or source._view:
        return t  # a view's value is not its storage's
    sharding = source._storage.sharding
    if t._storage.sharding is None and sharding is not None and not sharding.is_fully_replicated:
        t._storage.sharding = sharding
    return t


def _grads_follow(t: LazyTensor) -> None:
    """A marked parameter's gradient is laid out like it (FSDP shards gradients too), and so is
    what is copied from it (SGD's momentum is ``clone(grad)``)."""
    hooks = t._post_accumulate_grad_hooks or {}
    if t.requires_grad and t.is_leaf and _grad_like_param not in hooks.values():
        t.register_post_accumulate_grad_hook(_grad_like_param)


def _grad_like_param(param: LazyTensor) -> None:
    grad = param.grad
    pair = stacks.member(param), stacks.member(grad)
    if None not in pair:  # a stack's member, as its parameter is: the stacks share the layout
        follow(stacks.whole(pair[1][0]), stacks.whole(pair[0][0]))
        return
    if type(grad) is LazyTensor and grad._view is not None:  # autograd kept a view of its buffer
        ref = grad._ref()
        grad._alias_of(wrap(ref, ref[0].avals[ref[1]]))  # the gradient's own storage, to lay out
    follow(grad, param)


def clear(t: LazyTensor) -> None:
    """Forget ``t``'s sharding: later values are laid out by the partitioner."""
    found = stacks.member(t)  # a layer's weight in its stack: the stack's layout
    (found[0] if found is not None else _own_storage(t, "clear_sharding")).sharding = None


def sharding_of(t: LazyTensor):
    """``t``'s sharding: marked, remembered from its last program, or its upload's; None once
    cleared or while unmarked and pending (a view reports its data's, if it has data)."""
    if t._view is None:
        return t._storage.sharding
    found = stacks.member(t)
    if found is not None:  # a member is laid out as its stack, less the stacked axis
        stack = found[0].sharding
        spec = tuple(stack.spec) if type(stack) is NamedSharding else (0,)
        if not spec or spec[0] is None:
            return NamedSharding(stack.mesh, PartitionSpec(*spec[1:]))
    node, index = t._ref()
    return node.arrays[index].sharding if node.is_leaf(index) else None


def adopt(array: jax.Array, shape: tuple, dtype, sharding=None, device: int = 0) -> LazyTensor:
    """A tensor on xla:``device`` of logical ``shape`` holding an array
    ``transfer.to_device_array`` uploaded (a loader's prefetch thread may upload; this part
    touches engine state: main thread only)."""
    t = wrap_data(array, Aval(tuple(shape), dtype), device)
    if sharding is None:
        remember(t._storage, array)
    else:
        t._storage.sharding = canonical(sharding)
    return t


def _own_storage(t: LazyTensor, api: str) -> Storage:
    on_xla(t, api)
    if t._view is not None:
        raise ValueError(
            f"{api}: the tensor of shape {tuple(t.shape)} is a view of another tensor; "
            "mark the tensor it views (or a .clone() of the view)"
        )
    return t._storage


def _place(array: jax.Array, aval: Aval, sharding: NamedSharding) -> jax.Array:
    """``array`` laid out with ``sharding``; through the host when the layout needs padding."""
    if type(array) is transfer.HostData:  # never uploaded: each device receives its shard only
        return transfer.upload(array.host, sharding)
    if type(array) is transfer.Placeholder:
        shape = padded_shape(aval.shape, sharding)
        return transfer.Placeholder(shape, array.dtype, sharding, aval.shape)
    if padded_shape(aval.shape, sharding) == array.shape:
        return jax.device_put(array, sharding)
    return jax.device_put(padded(crop(np.asarray(array), aval.shape), sharding), sharding)


def layout_of(t: LazyTensor):
    """Where ``t``'s value lives: its storage's sharding, else its data's; None while pending and
    unmarked (the partitioner decides)."""
    sharding = sharding_of(t)
    if sharding is not None:
        return sharding
    node, index = t._ref()
    if not node.is_leaf(index):
        return None
    return node.arrays[index].sharding


def logical(array: jax.Array, shape: tuple) -> jax.Array:
    """A computed array at its logical ``shape``: a padded (uneven) one is cropped into the
    closest even layout (``layout.even_part``), as JAX arrays cannot be uneven."""
    if tuple(array.shape) == tuple(shape):
        return array
    return _resize(tuple(shape), even_part(array.sharding, tuple(shape)))(array)


def assign(t: LazyTensor, array: jax.Array) -> None:
    """Make ``array`` (logical shape, any layout) ``t``'s value, laid out as ``t``'s value is
    now (padded if that layout is uneven), as an in-place write through any alias."""
    node, index = t._ref()
    aval = node.avals[index]
    target = layout_of(t) or transfer.landing(node.device or 0)
    if target is not None and array.sharding != target:
        shape = padded_shape(aval.shape, target)
        fits = shape == tuple(array.shape)
        array = jax.device_put(array, target) if fits else _resize(shape, target)(array)
    t._write((Node.data(array, aval, node.device), 0))


@functools.lru_cache(maxsize=256)
def _resize(shape: tuple, sharding):
    """A program cropping or zero-padding its input to ``shape``, laid out as ``sharding``."""

    def resize(x):
        return pad_to(x[tuple(slice(0, min(n, m)) for n, m in zip(shape, x.shape))], shape)

    return jax.jit(resize, out_shardings=sharding)
