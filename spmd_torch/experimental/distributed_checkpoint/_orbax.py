"""Checkpoint directories as orbax writes them; no format of our own.

A checkpoint is one orbax composite checkpoint with two items: ``state``, the tensors' arrays as
a nested dict (``PyTreeCheckpointHandler``, TensorStore/OCDBT underneath, compression off: float
data barely compresses and zstd costs 4-5x the write time), and ``meta``, the JSON skeleton of the
state dict (``_tree``). Orbax writes into a temporary directory and renames it when complete, so
a checkpoint killed half-way is never mistaken for one. A JAX user restores the arrays with
orbax alone (docs/checkpointing.md).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from spmd_torch._lazy.layout import even_part

from . import _tree

STATE, META = "state", "meta"
FORMAT = 1  # the skeleton's layout, in case it ever changes


class CheckpointReadError(OSError):
    """A checkpoint that exists but cannot be read back (truncated, corrupted, not ours)."""


def _handler() -> ocp.CompositeCheckpointHandler:
    return ocp.CompositeCheckpointHandler(
        **{STATE: ocp.PyTreeCheckpointHandler(use_compression=False)},
        **{META: ocp.JsonCheckpointHandler()},
    )


def checkpointer(background: bool) -> ocp.AbstractCheckpointer:
    """An orbax checkpointer for our layout; ``background`` writes after ``save`` returns (the
    device-to-host copies are done before it returns, so later steps cannot change the data)."""
    return ocp.AsyncCheckpointer(_handler()) if background else ocp.Checkpointer(_handler())


def write(writer: ocp.AbstractCheckpointer, path: str, saved: _tree.Saved) -> None:
    """Start writing ``saved`` as the checkpoint ``path`` (absolute, not existing yet)."""
    items = {META: ocp.args.JsonSave({"format": FORMAT, "skeleton": saved.skeleton})}
    if saved.arrays:  # orbax refuses an empty tree: a state dict without tensors has none
        items[STATE] = ocp.args.PyTreeSave(saved.arrays)
    writer.save(path, args=ocp.args.Composite(**items))


def read_skeleton(path: str) -> dict:
    """The JSON skeleton of the checkpoint at ``path``."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist")
    try:
        reader = ocp.Checkpointer(
            ocp.CompositeCheckpointHandler(**{META: ocp.JsonCheckpointHandler()})
        )
        meta = reader.restore(path, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as error:
        raise CheckpointReadError(
            f"cannot read the checkpoint at {path}: its '{META}' item is missing or damaged "
            f"({type(error).__name__}: {error})"
        ) from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "skeleton" not in meta:
        raise CheckpointReadError(
            f"{path} is not a spmd_torch checkpoint (its '{META}' item has no skeleton of "
            f"format {FORMAT})"
        )
    return meta["skeleton"]


def read_arrays(path: str, reads: dict) -> dict:
    """The arrays ``reads`` names (name -> (key path, skeleton entry, layout)), each device
    reading only the chunks its shard of the layout needs; by name."""
    if not reads:
        return {}
    item: dict = {}
    restore_args: dict = {}
    for key_path, entry, layout in reads.values():
        arg = _restore_arg(entry, layout)
        *branch, leaf = (str(k) for k in key_path)
        _nest(item, branch)[leaf] = 0
        _nest(restore_args, branch)[leaf] = arg
    try:
        reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())  # the item alone: no composite
        restore = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        tree = reader.restore(os.path.join(path, STATE), args=restore)
    except Exception as error:
        raise CheckpointReadError(
            f"cannot read the tensors of the checkpoint at {path} (nothing was restored): "
            f"{type(error).__name__}: {error}"
        ) from error
    out = {}
    for name, (key_path, _, _) in reads.items():
        value = tree
        for key in key_path:
            value = value[str(key)]
        out[name] = value
    return out


def _restore_arg(entry: dict, layout) -> ocp.RestoreArgs:
    if entry["tensor"] == "cpu":
        return ocp.RestoreArgs(restore_type=np.ndarray)
    shape = tuple(entry["shape"])
    sharding = layout if layout is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return ocp.ArrayRestoreArgs(
        sharding=even_part(sharding, shape), global_shape=shape, dtype=_tree.read_dtype(entry)
    )


def _nest(tree: dict, keys: list) -> dict:
    for key in keys:
        tree = tree.setdefault(key, {})
    return tree
