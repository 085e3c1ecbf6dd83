"""torch_xla.experimental.fori_loop: ``fori_loop`` and ``while_loop`` on xla tensors, one node each.

The condition and the body are traced once per call on placeholders and lowered as one
``jax.lax.while_loop``: the program holds one iteration whatever the trip count, and the count
may be a device value. Importing this module makes PyTorch's ``while_loop`` higher-order op
(``torch._higher_order_ops.while_loop``) run so on xla tensors, as importing PyTorch/XLA's does.

As in PyTorch/XLA, no gradient flows through a while loop (an input requiring grad raises where
grad mode is on); ``fori_loop`` with Python int bounds has a known trip count and is a scan, which
autograd goes through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._higher_order_ops.while_loop import while_loop_op

from spmd_torch._lazy import loop
from spmd_torch._lazy.tensor import LazyTensor

from .scan import _text, _xla_tensor, without_dynamo

__all__ = ["fori_loop", "while_loop"]


def fori_loop(
    lower: int | torch.Tensor, upper: int | torch.Tensor, body_fun: Callable, *input_value
):
    """Run ``body_fun`` ``upper - lower`` times on ``input_value``, as PyTorch/XLA's ``fori_loop``.

    ``body_fun(*values)`` returns the next values (one tensor, or a tuple of as many as it takes)
    with unchanged shapes and dtypes; it does not receive the index. Python int bounds give a
    known trip count (a scan, differentiable); tensor bounds a count known on the device only (a
    while loop, not differentiable).

    Args:
        lower: The first index: a Python int or a one-element xla tensor.
        upper: One past the last index, likewise.
        body_fun: The loop body.
        *input_value: The initial values, xla tensors.

    Returns:
        A list: the count of iterations left (a tensor, 0 after a full run), then the values.

    Example:
        >>> from spmd_torch.experimental.fori_loop import fori_loop
        >>> _, x = fori_loop(0, 10, lambda x: x + 1, torch.zeros(3, device='xla'))
        >>> x.cpu()
        tensor([10., 10., 10.])
    """
    return without_dynamo(_fori_loop)(lower, upper, body_fun, list(input_value))


def while_loop(
    cond_fn: Callable,
    body_fn: Callable,
    carried_inputs: Sequence[torch.Tensor],
    additional_inputs: Sequence[torch.Tensor] | None = None,
) -> tuple:
    """Run ``body_fn`` on ``carried_inputs`` while ``cond_fn`` holds, as one XLA while loop.

    ``cond_fn(*carried, *additional)`` returns a one-element xla tensor (a bool, or a number
    compared with 0); ``body_fn(*carried, *additional)`` returns the next carried values, with
    unchanged shapes and dtypes. Both may read tensors they close over. Also what
    ``torch._higher_order_ops.while_loop.while_loop`` runs on xla tensors.

    Args:
        cond_fn: The condition.
        body_fn: The loop body.
        carried_inputs: The initial values, xla tensors.
        additional_inputs: Tensors both functions read unchanged (passed after the carried ones).

    Returns:
        The carried values after the last iteration, a tuple.

    Example:
        >>> from spmd_torch.experimental.fori_loop import while_loop
        >>> i, x = torch.tensor(10, device='xla'), torch.tensor(3, device='xla')
        >>> i, x = while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, x + 1), (i, x))
        >>> x.item()
        13
    """
    additional = tuple(additional_inputs or ())
    return without_dynamo(_while_loop)(cond_fn, body_fn, list(carried_inputs), additional)


def _fori_loop(lower: Any, upper: Any, body_fun: Callable, values: list) -> list:
    if not values:
        raise ValueError("fori_loop: give at least one input value")
    names = [f"input_value[{k}]" for k in range(len(values))]
    for name, value in zip(names, values):
        _xla_tensor(f"fori_loop: {name}", value)
    step = _body("fori_loop", "body_fun", body_fun, names)
    if type(lower) is int and type(upper) is int:
        if upper < lower:
            raise ValueError(f"fori_loop: upper ({upper}) is below lower ({lower})")
        body = loop.record_scan("fori_loop", lambda c, _: (step(c), []), values, [], names)
        carry, _ = loop.scan(body, values, [], upper - lower)
        return [torch.zeros((), dtype=torch.int64, device=values[0].device), *carry]
    count = upper - lower
    _xla_tensor("fori_loop: upper - lower (a trip count on the device)", count)
    if count.numel() != 1:
        raise ValueError(f"fori_loop: the bounds must be one element each, not {_text(count)}")
    count = count.reshape(())
    return loop.while_loop(
        "fori_loop with tensor bounds",
        lambda c: [c[0] > 0],
        lambda c: [c[0] - 1, *step(c[1:])],
        [count, *values],
        ["upper - lower", *names],
    )


def _while_loop(cond_fn: Callable, body_fn: Callable, carried: list, additional: tuple) -> tuple:
    names = [f"carried_inputs[{k}]" for k in range(len(carried))]
    for name, value in zip(names, carried):
        _xla_tensor(f"while_loop: {name}", value)

    def cond(values: list) -> list:
        out = cond_fn(*values, *additional)
        if not isinstance(out, LazyTensor) or out.numel() != 1:
            what = _text(out) if isinstance(out, LazyTensor) else f"a {type(out).__name__}"
            raise ValueError(
                f"while_loop: cond_fn must return a one-element xla tensor, not {what}"
            )
        return [out]

    step = _body("while_loop", "body_fn", lambda *v: body_fn(*v, *additional), names)
    return tuple(loop.while_loop("while_loop", cond, step, carried, names))


def _body(api: str, what: str, function: Callable, names: list) -> Callable[[list], list]:
    """``function`` on a list of values, its result checked: as many tensors, shapes unchanged."""

    def body(values: list) -> list:
        out = function(*values)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(out) != len(values):
            raise ValueError(f"{api}: {what} returned {len(out)} values, it takes {len(values)}")
        for name, before, after in zip(names, values, out):
            _xla_tensor(f"{api}: {what}'s new {name}", after)
            if (after.shape, after.dtype) != (before.shape, before.dtype):
                raise ValueError(
                    f"{api}: {what} changed {name} from {_text(before)} to {_text(after)}; a loop's "
                    "values keep their shapes and dtypes"
                )
        return out

    return body


while_loop_op.py_impl(LazyTensor)(while_loop)
