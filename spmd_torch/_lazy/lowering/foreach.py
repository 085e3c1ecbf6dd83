"""Lowerings: torch's multi-tensor ops (``_foreach_*``), each one node over its whole lists.

torch.optim's default (foreach) path and ``clip_grad_norm_`` call them: recorded whole, an
optimizer step is a handful of nodes instead of several per parameter. A foreach overload is
lowered as its element op's lowering mapped over the lists, inside the one JAX function (XLA fuses
the elements again). A ``Scalar[]`` argument arrives as Python numbers, or as one lifted vector
when its values are program data; either is indexed per element.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._helpers import traced_once
from .registry import LOWERINGS, Lowering, lowers

aten = torch.ops.aten

# A foreach op whose element op has another name.
_TARGETS = {"norm": "linalg_vector_norm"}


def element_packet(func):
    """The op applied to each element: in place for an in-place foreach op where one exists."""
    name = func._schema.name.split("::")[1][len("_foreach_") :]
    base = _TARGETS.get(name.rstrip("_"), name.rstrip("_"))
    packet = getattr(aten, base + "_", None) if name.endswith("_") else None
    return packet or getattr(aten, base, None)


def element_overload(func) -> tuple:
    """The overload applied to one element of each of ``func``'s lists, and the names of its
    keyword-only arguments that receive ``func``'s trailing positionals (``_foreach_addcdiv_(...,
    scalars)`` is ``addcdiv_(..., value=s)``); (None, []) when no overload takes them."""
    packet = element_packet(func)
    if packet is None:
        return None, []

    def element_type(argument) -> str:
        kind = argument.type
        return str(kind.getElementType() if isinstance(kind, torch._C.ListType) else kind)

    positional = [element_type(a) for a in func._schema.arguments if not a.kwarg_only]
    keywords = {a.name for a in func._schema.arguments if a.kwarg_only}
    for overload in packet.overloads():
        op = getattr(packet, overload)
        candidates = [a for a in op._schema.arguments if not a.kwarg_only]
        named = [a for a in op._schema.arguments if a.kwarg_only]
        extra = len(positional) - len(candidates)
        trailing = named[:extra] if extra > 0 else []
        slots = candidates + trailing
        if (
            [str(a.type) for a in slots[: len(positional)]] == positional
            and all(a.has_default_value() for a in slots[len(positional) :])
            and keywords <= {a.name for a in named}
        ):
            return op, [a.name for a in trailing]
    return None, []


def _mapped(func, element, trailing: list, lowering: Lowering) -> Callable:
    """``func``'s lowering: ``element``'s applied to the i-th entry of each list argument."""
    arguments = func._schema.arguments
    listed = [isinstance(a.type, torch._C.ListType) for a in arguments if not a.kwarg_only]
    positional = sum(not a.kwarg_only for a in element._schema.arguments)
    fn = traced_once(lowering.fn)  # the lists' entries are mostly a few shapes, many times over

    def foreach(*args, **kwargs) -> list:
        length = len(next(a for a, is_list in zip(args, listed) if is_list))
        outputs = []
        for i in range(length):
            entry = [a[i] if is_list else a for a, is_list in zip(args, listed)]
            named = dict(kwargs, **dict(zip(trailing, entry[positional:])))
            outputs.append(fn(*entry[:positional], **named))
        return outputs

    return foreach


@lowers(aten._foreach_norm.Scalar, static_scalars=True)  # the norm's order picks its formula
def _norm(tensors, ord=2, dtype=None) -> list:
    """``linalg_vector_norm`` of each (its ``dtype`` is a keyword there, positional here)."""
    vector_norm = LOWERINGS[aten.linalg_vector_norm.default].fn
    return [vector_norm(x, ord, dtype=dtype) for x in tensors]


def register_all() -> None:
    """A lowering for every functional foreach overload whose element op is lowered (called once
    every other table is loaded)."""
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()}
    for name in sorted(n for n in names if n.startswith("_foreach_") and not n.endswith("_")):
        packet = getattr(aten, name, None)
        if packet is None:  # an operator of another namespace that starts alike
            continue
        for overload in packet.overloads():
            func = getattr(packet, overload)
            element, trailing = element_overload(func)
            lowering = LOWERINGS.get(element)
            if func not in LOWERINGS and lowering is not None and not lowering.random:
                lowers(func, static_scalars=lowering.static_scalars)(
                    _mapped(func, element, trailing, lowering)
                )
