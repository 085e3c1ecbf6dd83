"""torch_xla.utils.checkpoint: activation checkpointing whose recomputation XLA keeps.

``torch.utils.checkpoint`` frees a block's activations after the forward pass and recomputes them
in the backward pass. Traced into one program, the recomputation is the same expression on the
same inputs as the forward pass, so XLA's common-subexpression elimination merges the two and the
activations stay alive: no memory is saved. Here, as in PyTorch/XLA, the backward pass first puts
the block's saved inputs, the gradients it received and, for a module's forward, the module's
parameters and buffers through one optimization barrier, and recomputes from the barrier's outputs:
XLA can neither prove them equal to the forward's values nor start the recomputation before the
gradients arrive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import check_backward_validity, detach_variable

from spmd_torch._lazy import rng as _rng
from spmd_torch._lazy.tensor import DEVICE as _DEVICE
from spmd_torch._lazy.tensor import on_xla

__all__ = ["CheckpointFunction", "checkpoint", "optimization_barrier_"]

_AUTOCAST_DEVICES = ("cpu", _DEVICE.type)


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """Put xla ``tensors`` through one optimization barrier, in place (``xm.optimization_barrier_``).

    Each tensor takes the barrier's output for it: the same value, but XLA may neither move
    computation across the barrier nor merge expressions read through it with equal ones before
    it. Not recorded by autograd.

    Args:
        tensors: xla tensors.

    Example:
        >>> a, b = torch.ones(3, device='xla'), torch.zeros(3, device='xla')
        >>> optimization_barrier_([a, b])
    """
    tensors = [on_xla(t, "optimization_barrier_", TypeError) for t in tensors]
    if not tensors:
        return
    with torch.no_grad():
        outputs = torch.ops.xla.optimization_barrier(tensors)
    for t, out in zip(tensors, outputs):
        t.data = out


class CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint: forward without saving activations, recompute them in backward.

    :func:`checkpoint` is the usual entry; ``apply`` takes the function, whether to replay the
    RNG state, then the function's arguments.

    Example:
        >>> out = CheckpointFunction.apply(block, True, x)
        >>> out.sum().backward()  # block runs again here, behind an optimization barrier
    """

    @staticmethod
    def forward(ctx, run_function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
        check_backward_validity(args)
        ctx.run_function = run_function
        ctx.preserve_rng_state = preserve_rng_state
        ctx.autocast = {
            device: {
                "enabled": torch.is_autocast_enabled(device),
                "dtype": torch.get_autocast_dtype(device),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            }
            for device in _AUTOCAST_DEVICES
        }
        if preserve_rng_state:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.device_key = _rng.state().ref  # a graph value: saving it runs nothing
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.inputs = [None if torch.is_tensor(a) else a for a in args]
        tensor_inputs = [args[i] for i in ctx.tensor_indices]
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*tensor_inputs)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs: Any) -> tuple:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint: the reentrant checkpoint is not compatible with torch.autograd.grad() "
                "or with the `inputs` argument of .backward(); call .backward() without `inputs`"
            )
        inputs = list(ctx.inputs)
        for index, saved in zip(ctx.tensor_indices, ctx.saved_tensors):
            inputs[index] = saved
        module = getattr(ctx.run_function, "__self__", None)
        state = (
            [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
        )
        separated = [*ctx.saved_tensors, *grad_outputs, *state]
        optimization_barrier_([t for t in separated if _on_device(t)])
        with (
            torch.random.fork_rng(devices=[], enabled=ctx.preserve_rng_state),
            _forward_device_key(ctx),
        ):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng)
            detached = detach_variable(tuple(inputs))
            with torch.enable_grad(), contextlib.ExitStack() as autocasts:
                for device, kwargs in ctx.autocast.items():
                    autocasts.enter_context(torch.autocast(device, **kwargs))
                outputs = ctx.run_function(*detached)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        with_grad = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if torch.is_tensor(out) and out.requires_grad
        ]
        if not with_grad:
            raise RuntimeError(
                "checkpoint: none of the function's outputs requires grad; checkpointing it is not "
                "needed"
            )
        torch.autograd.backward([o for o, _ in with_grad], [g for _, g in with_grad])
        grads = tuple(t.grad if isinstance(t, torch.Tensor) else None for t in detached)
        return (None, None) + grads


def _on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == _DEVICE.type


@contextlib.contextmanager
def _forward_device_key(ctx) -> Iterator[None]:
    """The recomputation draws the forward pass's random numbers (dropout masks) on the device."""
    if not ctx.preserve_rng_state:
        yield
        return
    key = _rng.state()
    current = key.ref
    key.set(ctx.device_key)
    try:
        yield
    finally:
        key.set(current)


def checkpoint(function: Callable, *args: Any, use_reentrant: bool | None = None, **kwargs: Any):
    """Run ``function(*args)`` without keeping its activations; recompute them in backward.

    Trades compute for memory, as ``torch.utils.checkpoint.checkpoint`` does, with an optimization
    barrier that keeps XLA from merging the recomputation with the forward pass. The random
    numbers the recomputation draws (CPU and device) are the forward pass's.

    Args:
        function: The block to checkpoint, called as ``function(*args)``.
        *args: Its arguments; tensors among them are saved for the recomputation.
        use_reentrant: ``True`` or ``None`` (PyTorch/XLA's reentrant implementation);
            ``False`` raises ``ValueError``, as in PyTorch/XLA.
        preserve_rng_state: (keyword) Replay the forward pass's random numbers; default True.

    Returns:
        What ``function`` returns.

    Example:
        >>> from spmd_torch.utils.checkpoint import checkpoint
        >>> h = checkpoint(block, x)  # block's activations are recomputed in backward
        >>> h.sum().backward()
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("checkpoint: unexpected keyword arguments: " + ", ".join(kwargs))
    if use_reentrant is False:
        raise ValueError(
            "checkpoint: use_reentrant=False is not supported (as in PyTorch/XLA); "
            "pass use_reentrant=True"
        )
    return CheckpointFunction.apply(function, preserve, *args)
