"""torch_xla.distributed.fsdp.utils: ``checkpoint_module``, activation checkpointing of a module,
and ``apply_xla_patch_to_nn_linear``, FSDP's in-place patch of ``nn.Linear`` forwards.

Example:
    >>> blocks = [checkpoint_module(Block()) for _ in range(12)]
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

from spmd_torch.distributed.spmd.xla_sharding import xla_patched_nn_linear_forward
from spmd_torch.utils.checkpoint import checkpoint

__all__ = ["apply_xla_patch_to_nn_linear", "checkpoint_module"]


def checkpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    """Make ``module``'s forward recompute its activations in the backward pass instead of
    keeping them (activation, or gradient, checkpointing), in place.

    The forward is replaced by one running the original under
    ``spmd_torch.utils.checkpoint.checkpoint`` (whose optimization barrier keeps XLA from merging
    the recomputation back into the forward pass), keyword arguments passed along; when no input
    requires gradients there is nothing to save and it runs as is. The original
    forward stays reachable as ``module._xla_checkpointed_forward_original``.

    Args:
        module: The module to checkpoint.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.

    Example:
        >>> layer = checkpoint_module(nn.TransformerEncoderLayer(512, 8))
        >>> layer(x).sum().backward()  # the layer's activations are recomputed here
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"checkpoint_module: expected a torch.nn.Module, got {type(module)}")
    module._xla_checkpointed_forward_original = module.forward

    def forward_with_checkpoint(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        original = self._xla_checkpointed_forward_original
        inputs = (*args, *kwargs.values())
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return original(*args, **kwargs)
        names = tuple(kwargs)

        def run(_module: torch.nn.Module, *packed: Any) -> Any:  # checkpoint passes by position
            positional = packed[: len(packed) - len(names)]
            return original(*positional, **dict(zip(names, packed[len(positional) :])))

        # bound to the module: the recomputation's barrier takes its parameters and buffers too
        return checkpoint(MethodType(run, self), *inputs)

    module.forward = MethodType(forward_with_checkpoint, module)
    return module


def apply_xla_patch_to_nn_linear(
    module: torch.nn.Module, patched_function: Callable = xla_patched_nn_linear_forward
) -> torch.nn.Module:
    """Make every ``nn.Linear`` in ``module`` (itself included) compute its forward with
    ``patched_function(linear, input)``, in place: same module objects, same parameters.

    The default is ``XLAPatchedLinear`` (an einsum whose backward reads the weight itself, which
    FSDP v1 needs to free gathered weights). A forward already replaced by other means is left
    alone, except the one ``checkpoint_module`` keeps as ``_xla_checkpointed_forward_original``,
    which is patched too. The original stays as ``_nn_linear_forward_original``.

    Args:
        module: Any module.
        patched_function: ``(linear, input) -> output``.

    Returns:
        ``module`` itself.

    Example:
        >>> model = apply_xla_patch_to_nn_linear(model)  # before wrapping in FSDP
    """

    def patch(linear: torch.nn.Linear, name: str) -> None:
        forward = getattr(linear, name, None)
        if getattr(forward, "__func__", None) is not torch.nn.Linear.forward:
            return
        linear._nn_linear_forward_original = forward
        setattr(linear, name, MethodType(patched_function, linear))

    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            patch(m, "forward")
            patch(m, "_xla_checkpointed_forward_original")
    return module
