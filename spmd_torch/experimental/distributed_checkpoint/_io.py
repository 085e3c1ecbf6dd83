"""Saving a state dict as a checkpoint directory and restoring one into a state dict in place."""

from __future__ import annotations

import os
import shutil

import orbax.checkpoint as ocp

from spmd_torch import _barrier
from spmd_torch._lazy import engine

from . import _orbax, _tree


def absolute(path) -> str:
    """``path`` as orbax needs it: absolute, with ``~`` expanded."""
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def refuse_in_replica(api: str) -> None:
    engine.current().mode.refuse_per_replica(
        api,
        "distributed checkpoints save one program's sharded state; in per-device scripts use "
        "xm.save on the master",
    )


def prepare(state_dict: dict, api: str) -> _tree.Saved:
    """The state dict split for writing, after the barrier (the values are plain device data,
    computed by the usual cached step program)."""
    refuse_in_replica(api)
    if not isinstance(state_dict, dict):
        raise TypeError(f"{api}: state_dict must be a dict, got {type(state_dict).__name__}")
    _barrier.barrier()
    return _tree.split(state_dict)


def start_write(writer: ocp.AbstractCheckpointer, path: str, saved: _tree.Saved) -> None:
    """Begin writing ``saved`` to the new checkpoint ``path``; a failure removes the partial
    directory and names ``path``."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        _orbax.write(writer, path, saved)
    except Exception as error:
        remove_partial(path)
        raise _write_error(path, error) from error


def finish_write(writer: ocp.AbstractCheckpointer, path: str) -> None:
    """Wait for a background write (a synchronous one is done); a failure removes the partial
    directory and names ``path``."""
    if not isinstance(writer, ocp.AsyncCheckpointer):
        return
    try:
        writer.wait_until_finished()
    except Exception as error:
        remove_partial(path)
        raise _write_error(path, error) from error


def _write_error(path: str, error: Exception) -> OSError:
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, OSError):
        return type(error)(error.errno, f"cannot write the checkpoint {path} ({reason})")
    return OSError(f"cannot write the checkpoint {path} ({reason})")


def remove_partial(path: str) -> None:
    """Remove what an unfinished write to ``path`` left (orbax's temporary directories)."""
    parent, base = os.path.split(path)
    if not os.path.isdir(parent):
        return
    for entry in os.listdir(parent):
        if entry.startswith(base + ".orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def restore(state_dict: dict, path: str, api: str) -> None:
    """Fill ``state_dict`` in place from the checkpoint ``path``: all of it, or (on any error)
    none of it."""
    refuse_in_replica(api)
    if not isinstance(state_dict, dict):
        raise TypeError(f"{api}: state_dict must be a dict, got {type(state_dict).__name__}")
    skeleton = _orbax.read_skeleton(path)
    _barrier.barrier()  # the target's values are data: their layouts are known
    plan = _tree.Restore(state_dict, skeleton, path)
    arrays = _orbax.read_arrays(path, plan.reads)
    plan.apply(arrays)
