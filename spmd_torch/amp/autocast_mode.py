"""``autocast`` for the xla device: ``torch.autocast('xla')`` with the dtype chosen per device kind.

The casts themselves are PyTorch's autocast machinery at the AutocastPrivateUse1 key, with
PyTorch/XLA's cast policy (``spmd_torch._lazy.lowering.amp.AUTOCAST_POLICY``), so this context,
``torch.autocast('xla', ...)`` and ``torch.autocast(device_type='xla')`` cast alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd_torch import runtime

# Device kinds whose default autocast dtype is float16 (PyTorch/XLA's XLA:GPU chose it); every
# other kind defaults to bfloat16, as XLA:TPU does.
_FLOAT16_DEFAULT = ("CUDA", "ROCM")


class autocast(torch.amp.autocast_mode.autocast):  # noqa: N801  (PyTorch/XLA's name)
    """Run the enclosed ops in mixed precision on an xla device, as ``torch_xla.amp.autocast``.

    Matmuls, linear layers and convolutions (and relu, max_pool2d, einsum) run in ``dtype``;
    softmax, log_softmax, batch_norm, the losses and the linear algebra run in float32; cat, stack
    and index_copy run in the widest floating dtype among their inputs. Other ops run in their
    inputs' dtype. Gradients come back in each parameter's own dtype. Usable as a decorator too.

    Args:
        device: an xla device (``'xla'``, ``'xla:0'``, ``torch_xla.device()``).
        enabled: whether casting is on in the region.
        dtype: ``torch.bfloat16`` or ``torch.float16``; ``None`` picks float16 on GPUs and
            bfloat16 on TPUs and CPUs. Any other dtype warns and disables autocast, as
            ``torch.autocast`` does.
        cache_enabled: accepted for compatibility; casts are not cached (see docs/amp.md).

    Example:
        >>> import spmd_torch.amp as amp
        >>> device = spmd_torch.device()
        >>> x = torch.randn(4, 8, device=device)
        >>> layer = torch.nn.Linear(8, 2).to(device)
        >>> with amp.autocast(device):
        ...     y = layer(x)
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(
        self,
        device: str | torch.device,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        cache_enabled: bool = True,
    ):
        if "xla" not in str(device):
            raise AssertionError(
                f"spmd_torch.amp.autocast is for xla devices, got {device!r}; "
                f"use torch.autocast({str(device)!r}) for other devices"
            )
        if dtype is None:
            kind = runtime.xla_device_hw(device)
            dtype = torch.float16 if kind in _FLOAT16_DEFAULT else torch.bfloat16
        super().__init__("xla", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


def custom_fwd(fwd: Callable | None = None, *, cast_inputs: torch.dtype | None = None):
    """``torch.amp.custom_fwd`` for the xla device: decorate a custom autograd Function's
    ``forward`` so it runs with ``cast_inputs`` (autocast off inside) or with the caller's
    autocast state, and its ``backward`` (see ``custom_bwd``) runs with the same state.

    Example:
        >>> class Square(torch.autograd.Function):
        ...     @staticmethod
        ...     @custom_fwd(cast_inputs=torch.float32)
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...
        ...     @staticmethod
        ...     @custom_bwd
        ...     def backward(ctx, grad):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x * grad
    """
    return torch.amp.custom_fwd(fwd, device_type="xla", cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable | None = None):
    """``torch.amp.custom_bwd`` for the xla device: run a custom Function's ``backward`` with the
    autocast state its ``forward`` ran with (see ``custom_fwd`` for an example).

    Example:
        >>> @staticmethod
        ... @custom_bwd
        ... def backward(ctx, grad):
        ...     return grad
    """
    return torch.amp.custom_bwd(bwd, device_type="xla")
