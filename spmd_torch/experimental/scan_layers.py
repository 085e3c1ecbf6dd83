"""torch_xla.experimental.scan_layers: layers of one structure run as one scan.

``scan_layers(layers, x)`` is ``nn.Sequential(*layers)(x)`` whose program holds one layer's ops
whatever the depth: each parameter and buffer is stacked across the layers along a new leading
axis, and the first layer, called with ``torch.func.functional_call`` on one slice of each stack,
is the body of a ``scan`` over them. The first call makes the layers' tensors the members of
their stack (stacks.py), so that later steps read it as it is and the optimizer updates one array
per kind of weight, whatever the depth; stacks of data are computed then, by a program of their
own, so that the first call's program is every later call's. The parameters stay the layers' own: autograd takes each
gradient back through its stack to the layer's parameter, so optimizers, ``state_dict`` and
checkpoints see the usual per-layer names. A parameter marked with ``mark_sharding`` lays its
stack out the same way, the stacked axis unsplit. With ``is_layer_pure=True`` the first layer's
recording is kept and replayed at later calls (``_ONE_LAYER_CACHE``, scan's tracing cache).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from spmd_torch._lazy import execute, loop, placement, stacks

from .scan import _scan, _text, _xla_tensor, without_dynamo

__all__ = ["scan_layers"]


def scan_layers(
    layers: Iterable[torch.nn.Module],
    input_data: Any,
    partition_fn: Callable | None = None,
    is_layer_pure: bool = False,
) -> Any:
    """Run ``layers`` one after another on ``input_data``, as one scan over their stacked weights.

    Equivalent to ``torch.nn.Sequential(*layers)(input_data)`` (a tuple ``input_data`` is passed
    as the arguments, and each layer returns the next tuple); compiles in about the time of one
    layer. The layers must have the same structure: the same module types, parameter and buffer
    names, shapes and dtypes, and training mode; the first layer's code runs for all of them.

    Args:
        layers: The layers (an ``nn.ModuleList``, a list...).
        input_data: The first layer's input: an xla tensor or a pytree of them.
        partition_fn: What each layer keeps for the backward, as in
            :func:`spmd_torch.experimental.scan.scan`
            (``jax.checkpoint_policies.nothing_saveable`` checkpoints every layer).
        is_layer_pure: The layers compute their outputs from their inputs and tensors only,
            with no side effects: the first layer is recorded once per structure of its inputs
            (and training modes) and the recording replayed at later calls.

    Returns:
        The last layer's output.

    Example:
        >>> from spmd_torch.experimental.scan_layers import scan_layers
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(10)).to('xla')
        >>> out = scan_layers(layers, torch.randn(4, 16, device='xla'))
        >>> out.shape
        torch.Size([4, 16])
    """
    return without_dynamo(_scan_layers)(list(layers), input_data, partition_fn, is_layer_pure)


def _scan_layers(layers: list, input_data: Any, partition_fn: Callable | None, pure: bool) -> Any:
    if not layers:
        return input_data
    first = layers[0]
    structures = [_structure(m) for m in layers]
    states = [state for _, state in structures]
    _check_same_modules([modules for modules, _ in structures], states)
    groups = {name: [state[name] for state in states] for name in states[0]}
    stacks_now = {name: stacks.stack_of(tensors) for name, tensors in groups.items()}
    _check_same_tensors(groups, stacks_now)
    new_stacks: list = []
    wholes = {
        name: _whole(tensors, new_stacks) if stacks_now[name] is None else stacks.whole(stack)
        for (name, tensors), stack in zip(groups.items(), stacks_now.values())
    }
    execute.compute_now(new_stacks)
    numbers = functools.cache(lambda: _layer_numbers(len(layers), _device_of(states)))
    stacked = _stacked(groups, wholes, numbers)
    one_layer = _one_layer_function(first, partition_fn, pure)
    modes = tuple(m.training for m in first.modules()) if pure else ()  # in the recording's key
    return _scan(one_layer, input_data, stacked, partition_fn, pure, modes)[0]


# PyTorch/XLA's name: (id(partition_fn), id(first layer)) -> (the layer, weakly; the function
# scanned for it), for layers called with is_layer_pure=True: the same function at each call, so
# that scan keeps its recording (_SCAN_COMPUTATION_CACHE is per function).
_ONE_LAYER_CACHE: dict = {}


def _one_layer_function(first: torch.nn.Module, partition_fn: Callable | None, pure: bool):
    """``first`` as a scan body over its stacked tensors; a pure layer's is made once."""
    key = (id(partition_fn), id(first))
    if pure:
        kept = _ONE_LAYER_CACHE.get(key)
        if kept is not None and kept[0]() is first:
            return kept[1]
    layer = weakref.ref(first)  # the cache keeps no layer, nor its stacks, alive

    def one_layer(carry: Any, state: dict) -> tuple[Any, None]:
        args = carry if isinstance(carry, tuple) else (carry,)
        return torch.func.functional_call(layer(), state, args), None

    if pure:
        _ONE_LAYER_CACHE[key] = (layer, one_layer)
    return one_layer


def _structure(layer: torch.nn.Module) -> tuple[list, dict]:
    """``layer``'s modules as (name, type, training mode), and its parameters then its buffers by
    name: ``named_modules``, ``named_parameters`` and ``named_buffers`` in one walk over the
    module dicts (this runs for every layer at every call: the three generators cost a
    sixteen-layer decoder's step 0.2 ms more). A loop, not a recursive closure, whose cycle would
    keep the tensors alive until the collector ran."""
    modules: list = []
    parameters: dict = {}
    buffers: dict = {}
    seen_modules: set = set()
    seen_tensors: tuple[set, set] = (set(), set())
    to_visit = [(layer, "")]  # depth first, children in order, as named_modules
    while to_visit:
        module, prefix = to_visit.pop()
        if module in seen_modules:
            continue
        seen_modules.add(module)
        modules.append((prefix, type(module), module.training))
        dot = prefix + "." if prefix else ""
        for found, seen, named in (
            (module._parameters, seen_tensors[0], parameters),
            (module._buffers, seen_tensors[1], buffers),
        ):
            for name, t in found.items():
                if t is not None and id(t) not in seen:  # Tensor.__hash__ is Python code
                    seen.add(id(t))
                    named[dot + name] = t
        children = [(c, dot + name) for name, c in module._modules.items() if c is not None]
        to_visit.extend(reversed(children))
    return modules, {**parameters, **buffers}


def _check_same_modules(structures: list, states: list) -> None:
    """Every layer like the first in its modules' types and training modes and its tensors'
    names (one layer's code runs for all of them)."""
    modules = structures[0]
    names = set(states[0])
    for k, (theirs, state) in enumerate(zip(structures, states)):
        keys = (
            ""
            if set(state) == names
            else f"mismatched keys: missing {sorted(names - set(state))}, extra "
            f"{sorted(set(state) - names)}"
        )
        if theirs != modules:
            at = next(
                i
                for i, pair in enumerate(zip(theirs + [None], modules + [None]))
                if pair[0] != pair[1]
            )
            raise ValueError(
                f"scan_layers: layer {k} differs from layer 0 at module "
                f"{_module_text(theirs, at)} (layer 0: {_module_text(modules, at)})"
                f"{f', and has {keys}' if keys else ''}; scanned layers must have the same "
                "structure"
            )
        if keys:
            raise ValueError(f"scan_layers: layer {k} has {keys}")


def _check_same_tensors(groups: dict, stacks_now: dict) -> None:
    """Every layer's tensor of each name like the first's, an xla tensor of its shape and dtype;
    the members of one stack (``stacks_now``: every step's after the first) are alike by
    construction."""
    for name, tensors in groups.items():
        if stacks_now[name] is not None:
            continue
        ref = tensors[0]
        for k, t in enumerate(tensors):
            _xla_tensor(f"scan_layers: layer {k}'s {name}", t)
            if (t.shape, t.dtype) != (ref.shape, ref.dtype):
                raise ValueError(
                    f"scan_layers: Shape mismatch for {name!r} in layer {k}: {_text(t)}, layer 0's "
                    f"is {_text(ref)}"
                )


def _module_text(modules: list, at: int) -> str:
    if at >= len(modules):
        return "none"
    name, kind, training = modules[at]
    return f"{name or '(itself)'!r}, a {kind.__name__}{'' if training else ' in eval mode'}"


class _Stack(torch.autograd.Function):
    """Each kind of the layers' tensors as one (layers x ...) tensor, all kinds in one call (a
    call of an autograd Function costs more than the stack it hands out): their stack itself
    where they are one stack's members, else ``torch.stack`` of them. Layer k's gradient is
    member k of the stacked gradient, so that torch.optim's foreach ops update it whole
    (stacks.py); outside a stack it is read at ``numbers()[k]``, a device tensor of its own,
    instead of at a constant offset, so that every layer's gradient is one XLA kernel compiled
    once for all the layers."""

    @staticmethod
    def forward(ctx, layers: int, numbers: Callable, wholes: list, *tensors: torch.Tensor) -> tuple:
        """``wholes``: per kind, the stack the tensors are the members of, or None."""
        ctx.set_materialize_grads(False)
        ctx.layers, ctx.numbers, ctx.members = layers, numbers, [w is not None for w in wholes]
        return tuple(
            torch.stack(tensors[k * layers : (k + 1) * layers]) if whole is None else whole
            for k, whole in enumerate(wholes)
        )

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        needed, layers, pieces = ctx.needs_input_grad[3:], ctx.layers, []
        for grad, members in zip(grads, ctx.members):
            if grad is None:
                layer_grads = [None] * layers
            elif members:
                layer_grads = stacks.slices(grad) or [grad.select(0, k) for k in range(layers)]
            else:
                layer_grads = [grad.index_select(0, k).squeeze(0) for k in ctx.numbers()]
            pieces += layer_grads
        return None, None, None, *(piece if n else None for piece, n in zip(pieces, needed))


def _whole(tensors: list, new_stacks: list) -> torch.Tensor | None:
    """The layers' tensors of one kind, not yet one stack's members, made the members of one
    (stacks.restack); the whole stack, or None where they cannot be.

    Their first call makes them the members of one stack: each step then reads
    the stack as it is, and its optimizer updates one array per kind of weight, not one per
    layer. The stack is laid out as they were when they all had one sharding over several
    devices (the new axis unsplit). A stack of tensors holding data (initialised, restored) is
    appended to ``new_stacks``, to be computed before the step: the first step's program is then
    every later step's, not one more to compile. Tensors that cannot be re-homed (shared with
    other layers or aliased elsewhere) are stacked again at each call."""
    if loop.recording_inside():  # the stack's value would be the loop body's, not the step's
        return None
    whole, data = placement.restack(tensors)
    if whole is not None and data:
        new_stacks.append(whole)
    return whole


def _stacked(groups: dict, wholes: dict, numbers: Callable) -> dict:
    """Each kind of the layers' tensors stacked, by name; the kinds autograd follows through one
    ``_Stack`` call, whose backward hands each layer its gradient."""
    followed = [
        name
        for name, tensors in groups.items()
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    ]
    stacked = {
        name: torch.stack(tensors) if wholes[name] is None else wholes[name]
        for name, tensors in groups.items()
        if name not in followed
    }
    if followed:
        layers = len(groups[followed[0]])
        tensors = [t for name in followed for t in groups[name]]
        followed_wholes = [wholes[name] for name in followed]
        stacked.update(zip(followed, _Stack.apply(layers, numbers, followed_wholes, *tensors)))
    return {name: stacked[name] for name in groups}


def _layer_numbers(count: int, device: torch.device) -> list:
    """Each layer's number, a device tensor of its own (what ``_Stack`` reads gradients at)."""
    return [torch.tensor([k], device=device) for k in range(count)]


def _device_of(states: list) -> torch.device:
    return next(iter(states[0].values())).device
