"""torch_xla.experimental.distributed_checkpoint on orbax: sharded, async, crash-safe checkpoints.

A checkpoint is a plain orbax checkpoint directory (see ``_orbax``): each device's shard is
written from where it lives, replicated shards once, and a checkpoint is visible only once
complete. Restoring fills a state dict in place, each tensor keeping its current layout (resharded
from the saved one as needed), and creates optimizer state that does not exist yet. Unlike
PyTorch/XLA, nothing here needs a process group or ``prime_optimizer``. See docs/checkpointing.md.
"""

from __future__ import annotations

import os

from . import _io, _orbax
from ._orbax import CheckpointReadError
from ._tree import Mismatch
from .manager import CheckpointManager
from .planners import SPMDLoadPlanner, SPMDSavePlanner
from .util import prime_optimizer

__all__ = [
    "CheckpointManager",
    "CheckpointReadError",
    "Mismatch",
    "SPMDLoadPlanner",
    "SPMDSavePlanner",
    "load",
    "prime_optimizer",
    "save",
]


def save(state_dict: dict, path: str | os.PathLike) -> None:
    """Write ``state_dict`` as a new checkpoint directory ``path`` (an orbax checkpoint).

    Pending values are computed first (a barrier). Each device writes its own shards; a
    replicated tensor is written once. ``path`` appears only when complete.

    Args:
        state_dict: Nested dicts, lists and tuples of xla or CPU tensors, Python scalars,
            strings and None (``{'model': model.state_dict(), 'optim': opt.state_dict()}``).
        path: A directory that does not exist yet.

    Raises:
        FileExistsError: ``path`` exists (nothing is overwritten).
        OSError: The write failed (unwritable directory, disk full); nothing is left at ``path``.

    Example:
        >>> import spmd_torch.experimental.distributed_checkpoint as xc
        >>> xc.save({'model': model.state_dict()}, '/tmp/ckpt')
    """
    path = _io.absolute(path)
    if os.path.exists(path):
        raise FileExistsError(f"checkpoint path {path} exists; save writes a new directory")
    saved = _io.prepare(state_dict, "distributed_checkpoint.save")
    _io.start_write(_orbax.checkpointer(background=False), path, saved)


def load(state_dict: dict, path: str | os.PathLike) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``.

    xla tensors keep their current layout: each device reads only the chunks its shard needs,
    whatever mesh the checkpoint was saved from. CPU tensors are copied into; Python values are
    replaced. Entries of an optimizer's empty ``state`` are created (load the dict into the
    optimizer afterwards). On any error the state dict is left untouched.

    Args:
        state_dict: The target, shaped as the one saved.
        path: A checkpoint directory written by :func:`save` or :class:`CheckpointManager`.

    Raises:
        FileNotFoundError: No checkpoint at ``path``.
        Mismatch: Missing or unexpected keys, or a shape or dtype that differs (all listed).
        CheckpointReadError: The checkpoint is truncated or damaged.

    Example:
        >>> state = {'model': model.state_dict(), 'optim': opt.state_dict()}
        >>> xc.load(state, '/tmp/ckpt')
        >>> opt.load_state_dict(state['optim'])
    """
    _io.restore(state_dict, _io.absolute(path), "distributed_checkpoint.load")
