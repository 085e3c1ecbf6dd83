"""PyTorch/XLA's preemption sync manager (``torch_xla._XLAC._activate_preemption_sync_manager``,
``_sync_point_reached``, ``_deactivate_preemption_sync_manager``): after a SIGTERM, every process of
the job agrees on one step at which to checkpoint.

In a multi-process job that is JAX's preemption sync manager, which ``jax.distributed`` starts
with the job (it watches SIGTERM and agrees on the step through the coordination service). A
single process has nobody to agree with: activating installs a SIGTERM handler, and the sync
point is the first step checked after the signal, as the agreed step (one past the last step
checked before the notice) is when steps are checked one by one. The handler chains to the one
it replaced, and deactivating puts that one back.

Example:
    >>> from spmd_torch.experimental.distributed_checkpoint import _preemption
    >>> _preemption.activate_preemption_sync_manager()
    >>> _preemption.sync_point_reached(10)  # no SIGTERM yet
    False
    >>> _preemption.deactivate_preemption_sync_manager()
"""

from __future__ import annotations

import logging
import signal
import threading

import jax
from jax.experimental import multihost_utils

__all__ = [
    "activate_preemption_sync_manager",
    "deactivate_preemption_sync_manager",
    "sync_point_reached",
]

logger = logging.getLogger(__name__)


class _Sigterm:
    """The one-process sync manager: a SIGTERM handler and the step it fixes as the sync point."""

    def __init__(self) -> None:
        self.noticed = threading.Event()
        self.sync_step: int | None = None
        self.previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self.on_sigterm)

    def on_sigterm(self, signum, frame) -> None:
        logger.warning("SIGTERM: the preemption sync point is the next step checked")
        self.noticed.set()
        if callable(self.previous):
            self.previous(signum, frame)

    def reached(self, step: int) -> bool:
        if not self.noticed.is_set():
            return False
        if self.sync_step is None:
            self.sync_step = step
        return step == self.sync_step

    def close(self) -> None:
        if signal.getsignal(signal.SIGTERM) == self.on_sigterm:
            signal.signal(signal.SIGTERM, self.previous)


class _Jax:
    """The multi-process sync manager: JAX's, agreed by every process of the job."""

    def reached(self, step: int) -> bool:
        return jax_sync_point_reached(step)

    def close(self) -> None:
        pass  # JAX's lives as long as jax.distributed


_lock = threading.Lock()
_active: _Sigterm | _Jax | None = None


def activate_preemption_sync_manager() -> None:
    """Start watching for a preemption (SIGTERM); nothing happens if already watching.

    Raises:
        RuntimeError: In one process, called off the main thread (Python installs signal
            handlers there only).

    Example:
        >>> activate_preemption_sync_manager()
    """
    global _active
    with _lock:
        if _active is not None:
            return
        if jax.process_count() > 1:
            _active = _Jax()
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "_activate_preemption_sync_manager: called off the main thread; a single "
                "process watches SIGTERM with a signal handler, which only the main thread can "
                "install"
            )
        _active = _Sigterm()


def deactivate_preemption_sync_manager() -> None:
    """Stop watching for a preemption, putting back the SIGTERM handler activation replaced;
    nothing happens if not watching.

    Example:
        >>> deactivate_preemption_sync_manager()
    """
    global _active
    with _lock:
        if _active is not None:
            _active.close()
        _active = None


def sync_point_reached(step: int) -> bool:
    """Whether ``step`` is the preemption sync point: the step at which every process takes its
    checkpoint after a SIGTERM (True for that one step only).

    Args:
        step: The current training step; check every step, in order.

    Raises:
        RuntimeError: No sync manager is active (call
            :func:`activate_preemption_sync_manager` first).

    Example:
        >>> sync_point_reached(step)
        False
    """
    active = _active
    if active is None:
        raise RuntimeError(
            f"_sync_point_reached({step}): no preemption sync manager is active; call "
            "_activate_preemption_sync_manager() first"
        )
    return active.reached(step)


def jax_sync_point_reached(step: int) -> bool:
    """JAX's preemption sync point, agreed by every process; False when the job's distributed
    runtime has no preemption service."""
    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:
        return False
