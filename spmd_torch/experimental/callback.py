"""torch_xla.experimental.callback: run a function once a computed tensor's device buffer is ready.

The wait happens on a worker thread of this module (one, so callbacks run in the order they were
installed), never on the caller's: the step goes on tracing while a logging callback waits for
its loss. The worker is an ordinary thread, joined at exit after its callbacks ran.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import jax
import torch

from spmd_torch._lazy.tensor import on_xla

__all__ = ["on_ready_callback", "on_ready_event"]

_WORKER = futures.ThreadPoolExecutor(1, thread_name_prefix="spmd_torch-on-ready")


def on_ready_callback(tensor: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
    """Call ``callback(tensor)`` once ``tensor``'s device buffer holds its value.

    ``tensor`` must be computed (or uploaded): a pending value has no buffer yet, as in
    PyTorch/XLA, so run the step first (``torch_xla.sync()``, a compiled function's call).

    Args:
        tensor: An xla tensor holding device data.
        callback: Called with ``tensor`` on this module's worker thread.

    Example:
        >>> loss = step(batch)  # a torch_xla.compile'd step: its result is dispatched
        >>> callback.on_ready_callback(loss, lambda t: print(t.item()))
    """
    array = _buffer(tensor, "on_ready_callback")
    _WORKER.submit(_when_ready, array, callback, tensor)


def on_ready_event(tensor: torch.Tensor) -> threading.Event:
    """A ``threading.Event`` set once ``tensor``'s device buffer holds its value.

    Example:
        >>> on_ready_event(loss).wait(timeout=3)
    """
    event = threading.Event()
    _WORKER.submit(_when_ready, _buffer(tensor, "on_ready_event"), lambda _: event.set(), tensor)
    return event


def _buffer(tensor: torch.Tensor, api: str):
    """The array holding ``tensor``'s value (None: data still on the host, ready already)."""
    node, index = on_xla(tensor, f"callback.{api}", RuntimeError)._ref()
    if not node.is_leaf(index):
        raise RuntimeError(
            f"callback.{api}: the tensor of shape {tuple(tensor.shape)} is pending (its value is "
            "an op not run yet), so it has no device buffer to wait for: run the step first "
            "(torch_xla.sync())"
        )
    array = node.arrays[index]
    return array if isinstance(array, jax.Array) else None


def _when_ready(array, callback: Callable, tensor: torch.Tensor) -> None:
    if array is not None:
        try:
            array.block_until_ready()
        except RuntimeError:  # a later program took the buffer (donated): it was ready before
            pass
    callback(tensor)
