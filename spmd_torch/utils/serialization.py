"""torch_xla.utils.serialization: save and load that hold one tensor on the host at a time.

The format is PyTorch/XLA's: ``path`` holds the data with each xla tensor replaced by a
``TensorReference(tid)``, and the directory ``path + '.tensors'`` holds one ``torch.save`` file
per tensor, ``tensor_<tid>.pt``. Saving copies one tensor to the host, writes it and drops it
before the next, so peak host memory is the largest tensor, not the whole model.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from spmd_torch.core import xla_model as xm


class TensorReference:
    """Stands in the saved data for the tensor stored in ``tensor_<tid>.pt``."""

    def __init__(self, tid: int):
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference({self.tid})"


def _tensors_folder(path: str) -> str:
    return os.fspath(path) + ".tensors"


def _tensor_file(folder: str, tid: int) -> str:
    return os.path.join(folder, f"tensor_{tid}.pt")


def save(data: Any, path: str, master_only: bool = True, global_master: bool = False) -> None:
    """Save ``data`` to ``path``, streaming its xla tensors to files one at a time.

    All xla tensors are computed together in one program first (on every process, as a program
    over sharded tensors involves them all); then the writer copies each to the host, writes
    it to ``path + '.tensors/tensor_<i>.pt'`` and drops it. A tensor met twice is stored once
    and comes back shared. CPU tensors stay inline in ``path``. :func:`load` returns CPU
    tensors.

    Args:
        data: Any nesting of lists, tuples, dicts, sets and objects holding tensors.
        path: The destination file; the tensor directory is created next to it (replacing any
            previous one).
        master_only: Only the master ordinal writes. If ``False`` every process writes, so
            ``path`` must differ between processes.
        global_master: With ``master_only``, only the global master (ordinal 0) writes, instead
            of the master of each host.

    Example:
        >>> from spmd_torch.utils import serialization as xser
        >>> xser.save(model.state_dict(), 'model.pt')
        >>> state = xser.load('model.pt')
    """
    should_write = not master_only or xm.is_master_ordinal(local=not global_master)
    xm._compute_xla_tensors(data)
    if not should_write:
        return
    folder = _tensors_folder(path)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.mkdir(folder)

    def write(t: torch.Tensor, tid: int) -> TensorReference:
        torch.save(xm.to_cpu_tensor(t), _tensor_file(folder, tid))
        return TensorReference(tid)

    torch.save(xm.rewrite_instances(data, xm._is_xla_value, write), path)


def load(path: str, weights_only: bool = True) -> Any:
    """Load what :func:`save` wrote to ``path``, with CPU tensors in place of the xla ones.

    Args:
        path: The path given to :func:`save`.
        weights_only: Passed to ``torch.load``: ``True`` only unpickles tensors, containers
            and primitive types (and ``TensorReference``); set ``False`` for data holding other
            objects, from a trusted source only.

    Returns:
        The saved data.

    Example:
        >>> state = xser.load('model.pt')
        >>> model.load_state_dict(state)
    """
    with torch.serialization.safe_globals([TensorReference]):
        ref_data = torch.load(path, weights_only=weights_only)
    folder = _tensors_folder(path)

    def read(ref: TensorReference) -> torch.Tensor:
        return torch.load(_tensor_file(folder, ref.tid), weights_only=weights_only)

    loaded: dict[int, torch.Tensor] = {}  # by tid: references to one tensor load it once

    def resolve(ref: TensorReference, _index: int) -> torch.Tensor:
        if ref.tid not in loaded:
            loaded[ref.tid] = read(ref)
        return loaded[ref.tid]

    return xm.rewrite_instances(ref_data, lambda v: isinstance(v, TensorReference), resolve)
