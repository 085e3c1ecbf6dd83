"""torch_xla.experimental.gradient_accumulation: accumulate a model's gradients over micro-batches
in one loop of the program.

``gradient_accumulation(train_step, (data, target), model)`` runs ``train_step`` on each slice of
the leading dimension of its iterable tensors and adds up the gradients of ``loss / steps`` into
the model's parameters' ``.grad``, as calling ``loss.backward()`` once per micro-batch would.
The loop is one node (a ``jax.lax.scan`` whose body takes JAX's value and gradient of the
recorded step), so the program holds one micro-batch's forward and backward whatever the count,
and one micro-batch's activations live at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd_torch._lazy import loop, stacks

from .scan import _text, _xla_tensor, without_dynamo

__all__ = ["gradient_accumulation"]


def gradient_accumulation(
    train_step: Callable[..., Any],
    iterable_tensors: Sequence[torch.Tensor],
    model: torch.nn.Module,
    *carried_tensors: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Accumulate ``model``'s gradients over the leading dimension of ``iterable_tensors``.

    ``train_step(*slices, *carried)`` returns the micro-batch's loss (a 0-dim floating tensor),
    or ``(loss, *new_carried)``. It must be pure but for reading the model: it writes no tensor
    from outside and runs no backward itself. Each parameter requiring grad that it reads gets
    the sum over micro-batches of the gradient of ``loss / steps``, added to its ``.grad`` (or
    set when that is None); the optimizer step then follows as usual.

    Args:
        train_step: The micro-batch step.
        iterable_tensors: Xla tensors with one shared leading dimension, the micro-batch count.
        model: The module whose parameters get the gradients.
        *carried_tensors: Xla tensors threaded from one micro-batch to the next.

    Returns:
        The accumulated loss (the mean of the micro-batches' losses), then the last carried
        tensors if any were given.

    Example:
        >>> def train_step(data, target):
        ...     return loss_fn(model(data), target)
        >>> loss = gradient_accumulation(train_step, (data, target), model)  # data: [4, B, ...]
        >>> optimizer.step()
    """
    return without_dynamo(_gradient_accumulation)(
        train_step, tuple(iterable_tensors), model, list(carried_tensors)
    )


def _gradient_accumulation(
    train_step: Callable, iterables: tuple, model: torch.nn.Module, carried: list
) -> Any:
    if not iterables:
        raise ValueError("gradient_accumulation: iterable_tensors cannot be empty")
    names = [f"iterable_tensors[{k}]" for k in range(len(iterables))]
    for name, t in zip(names, iterables):
        _xla_tensor(f"gradient_accumulation: {name}", t)
        if t.dim() == 0 or t.numel() == 0:
            raise ValueError(f"gradient_accumulation: {name} ({_text(t)}) has no micro-batches")
        if t.shape[0] != iterables[0].shape[0]:
            raise ValueError(
                f"gradient_accumulation: {name} has {t.shape[0]} micro-batches, "
                f"{names[0]} has {iterables[0].shape[0]}"
            )
    carried_names = [f"carried_tensors[{k}]" for k in range(len(carried))]
    for name, t in zip(carried_names, carried):
        _xla_tensor(f"gradient_accumulation: {name}", t)

    def body(carry: list, slices: list) -> tuple[list, list]:
        result = train_step(*slices, *carry)
        loss, *new = result if isinstance(result, (tuple, list)) else (result,)
        if len(new) != len(carry):
            raise ValueError(
                f"gradient_accumulation: train_step returned {len(new)} carried tensors, "
                f"it was given {len(carry)}"
            )
        loss = _xla_tensor("gradient_accumulation: train_step's loss", loss)
        if loss.dim() != 0 or not loss.is_floating_point():
            raise ValueError(
                f"gradient_accumulation: train_step's loss must be a 0-dim floating tensor, "
                f"not {_text(loss)}"
            )
        return new, [loss]

    with torch.no_grad():  # the gradients come from the recording, not from autograd
        try:
            recorded = loop.record_scan(
                "gradient_accumulation", body, carried, list(iterables), carried_names + names
            )
        except loop.WrittenInBody as error:  # PyTorch/XLA asserts the step is pure
            raise AssertionError(str(error)) from None
        targets = _gradient_targets(model, recorded.captured)
        start = len(carried) + len(iterables)
        diff = tuple(start + k for k, _ in targets)
        carry, loss, grads = loop.accumulate(
            recorded, carried, list(iterables), iterables[0].shape[0], diff
        )
        for (_, assign), grad in zip(targets, grads):
            assign(grad)
    return loss if not carried else (loss, *carry)


def _gradient_targets(model: torch.nn.Module, captured: list) -> list[tuple[int, Callable]]:
    """Per tensor the step read from outside that holds parameters requiring grad: (its place
    among them, how its gradient reaches the parameters' ``.grad``). A parameter is read as
    itself, or, under ``scan_layers``, as a member of the stack the step read whole."""
    wanted = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    by_id = {id(p): p for p in wanted}
    by_stack: dict = {}
    for p in wanted:
        found = stacks.member(p)
        if found is not None:
            by_stack.setdefault(id(found[0]), {})[found[1]] = p
    targets = []
    for k, t in enumerate(captured):
        if id(t) in by_id:
            targets.append((k, lambda grad, p=by_id[id(t)]: _add_grad(p, grad)))
        elif t._view is None and id(t._storage) in by_stack:
            members = by_stack[id(t._storage)]
            targets.append((k, lambda grad, members=members: _add_stacked(members, grad)))
    return targets


def _add_stacked(members: dict, grad: torch.Tensor) -> None:
    for k, p in members.items():
        _add_grad(p, grad[k])


def _add_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
