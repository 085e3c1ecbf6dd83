"""torch_xla.distributed.fsdp.utils: ``checkpoint_module``, activation checkpointing of a module.

Example:
    >>> blocks = [checkpoint_module(Block()) for _ in range(12)]
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch

from spmd_torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_module"]


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

        def run(*packed: Any) -> Any:  # checkpoint passes arguments by position only
            positional = packed[: len(packed) - len(names)]
            return original(*positional, **dict(zip(names, packed[len(positional) :])))

        return checkpoint(run, *inputs)

    module.forward = MethodType(forward_with_checkpoint, module)
    return module
