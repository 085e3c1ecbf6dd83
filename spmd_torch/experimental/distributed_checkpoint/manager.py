"""torch_xla.experimental.distributed_checkpoint.manager: checkpoints per step, async, on preemption."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from collections import deque
from concurrent import futures

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from . import _io, _orbax, _preemption

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Checkpoints of a training run, one directory per step under ``path``.

    PyTorch/XLA's ``CheckpointManager``, on orbax. Each checkpoint is a plain orbax checkpoint
    directory ``path/<step>``, visible only once complete: a process killed at any moment leaves
    every earlier checkpoint restorable and the partial one out of :meth:`all_steps`.

    Differences from PyTorch/XLA, on purpose: no process group is needed (``process_group`` is
    accepted and ignored); preemption is SIGTERM on every platform (and JAX's preemption notice
    in a multi-process run), and once the checkpoint it triggers is written the process exits
    with status 0; ``restore`` creates optimizer state that does not exist yet, so
    ``prime_optimizer`` is never needed.

    Args:
        path: The directory holding the checkpoints (created if missing).
        save_interval: Take a checkpoint when ``step % save_interval == 0``.
        max_to_keep: Keep at most this many checkpoints, deleting the oldest (the earliest
            saved, whatever their steps, as in PyTorch/XLA; a step saved again counts as new);
            0 keeps all. The newest complete checkpoint is never deleted.
        max_pending_async: At most this many :meth:`save_async` writes in flight; the next one
            waits for the oldest.
        process_group: Ignored (PyTorch/XLA needs a gloo group; this runtime does not).
        chkpt_on_preemption: Take a checkpoint at the first :meth:`save` or :meth:`save_async`
            after a SIGTERM, whatever the step, then exit.

    Example:
        >>> import spmd_torch.experimental.distributed_checkpoint as xc
        >>> mgr = xc.CheckpointManager('/tmp/run', save_interval=100)
        >>> if mgr.all_steps():
        ...     state = {'model': model.state_dict(), 'optim': opt.state_dict()}
        ...     mgr.restore(max(mgr.all_steps()), state)
        ...     opt.load_state_dict(state['optim'])
        >>> for step, batch in enumerate(loader):
        ...     train_step(batch)
        ...     mgr.save_async(step, {'model': model.state_dict(), 'optim': opt.state_dict()})
        >>> mgr.join()
    """

    def __init__(
        self,
        path: str | os.PathLike,
        save_interval: int,
        max_to_keep: int | None = 0,
        max_pending_async: int | None = 1,
        process_group=None,
        chkpt_on_preemption: bool = True,
    ):
        for name, value, low in (
            ("save_interval", save_interval, 1),
            ("max_to_keep", max_to_keep or 0, 0),
            ("max_pending_async", max_pending_async or 1, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(
                    f"CheckpointManager: {name} must be an integer >= {low}, got {value!r}"
                )
        self.base_path = _io.absolute(path)
        self.save_interval = save_interval
        self.max_to_keep = max_to_keep or 0
        self.max_pending_async = max_pending_async or 1
        self.chkpt_on_preemption = chkpt_on_preemption
        self._pending: deque = deque()  # (step, future of its _save), oldest first
        # Finishes save_async's writes, one at a time; joined at exit, so none is cut short.
        self._worker = futures.ThreadPoolExecutor(1, thread_name_prefix="CheckpointManager")
        self._preempted = threading.Event()
        _make_directory(self.base_path)
        if jax.process_index() == 0:  # the path is shared by every host: one of them tidies it
            for entry in os.listdir(self.base_path):  # writes a killed job left unfinished
                if ".orbax-checkpoint-tmp" in entry:
                    shutil.rmtree(os.path.join(self.base_path, entry), ignore_errors=True)
        _every_host_here("CheckpointManager")
        if chkpt_on_preemption and jax.process_count() == 1:
            self._watch_sigterm()  # several hosts: JAX's preemption notice (reached_preemption)

    def _watch_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("CheckpointManager made off the main thread: SIGTERM is not watched")
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            logger.warning(
                "SIGTERM: a checkpoint is taken at the next save, then the process exits"
            )
            self._preempted.set()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _path(self, step: int) -> str:
        return os.path.join(self.base_path, str(step))

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due a checkpoint: on the interval, or after a preemption."""
        preempted = self.chkpt_on_preemption and self.reached_preemption(step)
        return step % self.save_interval == 0 or preempted

    def save(self, step: int, state_dict: dict, force: bool = False) -> bool:
        """Write a checkpoint of ``state_dict`` for ``step`` if due (or ``force``), and wait for it.

        Returns:
            Whether a checkpoint was taken.
        """
        saved = self._due(step, state_dict, force, "CheckpointManager.save")
        if saved is None:
            return False
        self._save(step, self._start(step, saved, background=False))
        self._exit_if_preempted(step)
        return True

    def save_async(self, step: int, state_dict: dict, force: bool = False) -> bool:
        """Like :meth:`save`, but returns once the values are copied off the devices; the write
        is finished on a background thread (later steps may change the tensors freely), as in
        PyTorch/XLA. At most ``max_pending_async`` writes are in flight: the next one waits.

        Returns:
            Whether a checkpoint was taken.
        """
        saved = self._due(step, state_dict, force, "CheckpointManager.save_async")
        if saved is None:
            return False
        self._reap()
        while len(self._pending) >= self.max_pending_async:
            self._finish_oldest()
        writer = self._start(step, saved, background=True)
        self._pending.append((step, self._worker.submit(self._save, step, writer)))
        self._exit_if_preempted(step)
        return True

    def _due(self, step: int, state_dict: dict, force: bool, api: str):
        """``state_dict`` split for writing if ``step`` is due a checkpoint, else None."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"{api}: step must be a non-negative integer, got {step!r}")
        if not (force or self.should_save(step)):
            return None
        return _io.prepare(state_dict, api)

    def _start(self, step: int, saved, background: bool):
        """Begin the checkpoint of ``step``; returns its writer. A background writer has copied
        the values off the devices when this returns. A step saved again replaces its
        checkpoint, as in PyTorch/XLA."""
        path = self._path(step)
        if os.path.exists(path) or any(pending == step for pending, _ in self._pending):
            self.join()
            if jax.process_index() == 0:
                shutil.rmtree(path, ignore_errors=True)
            _every_host_here(f"CheckpointManager.save replacing step {step}")
        writer = _orbax.checkpointer(background)
        _io.start_write(writer, path, saved)
        return writer

    def _save(self, step: int, writer) -> None:
        """Finish the checkpoint of ``step`` that ``writer`` writes: wait for it, then delete the
        oldest beyond ``max_to_keep``. On the background thread for :meth:`save_async` (until
        it returns, the step is not among :meth:`all_steps`)."""
        try:
            _io.finish_write(writer, self._path(step))
        finally:
            writer.close()
        self._release_oldest()

    def _exit_if_preempted(self, step: int) -> None:
        """After the checkpoint a preemption triggered is written, the process exits (0)."""
        if self.chkpt_on_preemption and self.reached_preemption(step):
            self.join()
            logger.warning("preemption checkpoint of step %d written; exiting", step)
            raise SystemExit(0)

    def _release_oldest(self) -> None:
        """Delete the oldest checkpoints beyond ``max_to_keep``, by the time their save began (as
        PyTorch/XLA, whatever their steps; never the newest complete one); the first host does,
        for all of them."""
        if not self.max_to_keep or jax.process_index() != 0:
            return
        steps = sorted(self._complete_steps(), key=lambda step: (self._created(step), step))
        for step in steps[: max(0, len(steps) - self.max_to_keep)]:
            shutil.rmtree(self._path(step), ignore_errors=True)

    def _created(self, step: int) -> int:
        """When the checkpoint of ``step`` began to be written (ns), from orbax's step metadata;
        0 for a directory without it, so those go first."""
        try:
            return ocp.metadata.get_step_metadata(self._path(step)).init_timestamp_nsecs or 0
        except (OSError, ValueError):
            return 0

    def _reap(self) -> None:
        """Forget the background writes that finished, raising the error of a failed one."""
        while self._pending and self._pending[0][1].done():
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        _, done = self._pending.popleft()
        done.result()  # raises the background write's error

    def restore(self, step: int, state_dict: dict) -> None:
        """Fill ``state_dict`` in place from the checkpoint of ``step``.

        xla tensors keep their current layout (resharded from the saved one), missing optimizer
        state is created, and on any error nothing is changed. Call ``model.load_state_dict``
        and ``optimizer.load_state_dict`` afterwards for Python values and new entries.

        Raises:
            FileNotFoundError: No complete checkpoint of ``step`` (the valid steps are listed).
        """
        if any(pending_step == step for pending_step, _ in self._pending):
            self.join()
        steps = self.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint of step {step} in {self.base_path}; complete checkpoints: {steps}"
            )
        _io.restore(state_dict, self._path(step), "CheckpointManager.restore")

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint, ascending (a background write counts once
        its thread finished it)."""
        self._reap()
        pending = {step for step, _ in self._pending}
        return [step for step in self._complete_steps() if step not in pending]

    def _complete_steps(self) -> list[int]:
        if not os.path.isdir(self.base_path):
            return []
        return sorted(int(e) for e in os.listdir(self.base_path) if e.isdigit())

    def join(self) -> None:
        """Wait for every background write; raises the error of one that failed."""
        while self._pending:
            self._finish_oldest()

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption was signalled (SIGTERM, or JAX's notice in a multi-process run)
        by ``step``."""
        if not self.chkpt_on_preemption:
            raise RuntimeError(
                "reached_preemption: preemption is not watched; create the CheckpointManager "
                "with chkpt_on_preemption=True"
            )
        if self._preempted.is_set():
            return True
        if jax.process_count() > 1:
            return _preemption.jax_sync_point_reached(step)
        return False


def _every_host_here(what: str) -> None:
    """A barrier of the job's hosts (none with one host)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"spmd_torch {what}")


def _make_directory(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".spmd_torch_write_probe.{jax.process_index()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise type(error)(
            error.errno, f"CheckpointManager: cannot write checkpoints to {path} ({error.strerror})"
        ) from error
