"""A state dict as a checkpoint holds it: tensors as a tree of arrays, everything else as JSON.

Saving splits a state dict (nested dicts, lists and tuples of tensors, Python scalars and
strings) in two: its tensors as a nested dict of arrays keyed by strings (what orbax writes; an
xla tensor is its device array, so each device's shard is written from where it lives), and a
JSON *skeleton* of the whole structure with every non-tensor value and each tensor's device,
dtype, shape and saved layout. A tensor's name is its key path joined by dots
(``optim.state.0.exp_avg``), as orbax names arrays.

Restoring walks the target state dict against the skeleton twice: the first walk checks every
key, shape and dtype and lists the arrays to read, laid out as each target tensor is now; only
when all of them are read does the second walk write them in place. A bad checkpoint or a
mismatch therefore leaves the target untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from spmd_torch._lazy import execute, placement, transfer
from spmd_torch._lazy.lowering.dtypes import to_jax_dtype
from spmd_torch._lazy.tensor import LazyTensor
from spmd_torch.distributed.spmd.xla_sharded_tensor import XLAShardedTensor

SEP = "."
_SCALARS = (type(None), bool, int, float, str)


def name_of(path: tuple) -> str:
    return SEP.join(str(key) for key in path)


def _torch_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, XLAShardedTensor):
        return value.global_tensor
    return value if isinstance(value, torch.Tensor) else None


@dataclasses.dataclass
class Saved:
    """What :func:`split` makes of a state dict: the JSON skeleton and the tree of arrays."""

    skeleton: dict
    arrays: dict  # nested dicts of str keys, leaves jax.Array (xla) or np.ndarray (cpu)
    nbytes: int


def split(state_dict: dict) -> Saved:
    """``state_dict`` as a skeleton and a tree of arrays, xla tensors computed first (one program)."""
    found: list = []
    skeleton = _describe(state_dict, (), found)
    xla = [t for _, t in found if isinstance(t, LazyTensor)]
    computed = dict(zip(map(id, xla), execute.materialize(xla))) if xla else {}
    arrays: dict = {}
    nbytes = 0
    for path, t in found:
        if isinstance(t, LazyTensor):
            array = placement.logical(computed[id(t)], tuple(t.shape))
        else:
            array = transfer.host_array(t)
        nbytes += array.nbytes
        branch = arrays
        for key in path[:-1]:
            branch = branch.setdefault(str(key), {})
        branch[str(path[-1])] = array
    return Saved(skeleton, arrays, nbytes)


def _describe(value: Any, path: tuple, found: list) -> dict:
    tensor = _torch_tensor(value)
    if tensor is not None:
        found.append((path, tensor))
        return _tensor_entry(tensor, path)
    if isinstance(value, dict):
        keys = [str(k) for k in value]
        for key in value:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(
                    f"checkpoint: key {key!r} of type {type(key).__name__} at "
                    f"'{name_of(path) or '<root>'}'; state dict keys must be str or int"
                )
        if len(set(keys)) != len(keys):
            raise ValueError(
                f"checkpoint: the dict at '{name_of(path) or '<root>'}' has keys that are equal "
                f"as strings ({sorted(keys)}); they would share one name in the checkpoint"
            )
        return {"dict": [[k, _describe(v, (*path, k), found)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_describe(v, (*path, i), found) for i, v in enumerate(value)]}
    if isinstance(value, _SCALARS):
        return {"value": value}
    raise TypeError(
        f"checkpoint: cannot save the {type(value).__name__} at '{name_of(path)}'; a state dict "
        "holds tensors, Python scalars, strings, None, and dicts, lists and tuples of them"
    )


def _tensor_entry(t: torch.Tensor, path: tuple) -> dict:
    if isinstance(t, LazyTensor):
        device = "xla"
    elif t.device.type == "cpu":
        device = "cpu"
    else:
        raise TypeError(
            f"checkpoint: the tensor at '{name_of(path)}' is on {t.device}; save xla or CPU tensors"
        )
    entry = {"tensor": device, "dtype": str(t.dtype).removeprefix("torch."), "shape": [*t.shape]}
    if device == "xla":
        spec = getattr(placement.layout_of(t), "spec", None)
        entry["spec"] = None if spec is None else [_spec_entry(e) for e in spec]
    return entry


def _spec_entry(entry):
    return list(entry) if isinstance(entry, tuple) else entry


def _dtype(entry: dict) -> torch.dtype:
    return getattr(torch, entry["dtype"])


class Mismatch(ValueError):
    """The target state dict does not fit the checkpoint (keys, shapes, dtypes)."""


class Restore:
    """A checkpoint's skeleton restored into a target state dict, in two walks (module doc)."""

    def __init__(self, target: dict, skeleton: dict, path: str):
        self.target = target
        self.saved: dict = {}  # name -> skeleton entry
        _index(skeleton, (), self.saved)
        self.reads: dict = {}  # name -> (path, skeleton entry, layout to read into; None: host)
        self.created: dict = {}  # name of an optimizer state map -> keys restore adds to it
        self.problems: list[str] = []
        self._twins: dict = {}  # (shape, saved spec) -> the layout of a target tensor saved so
        self._check(target, (), None)
        if self.problems:
            shown = "\n  ".join(self.problems[:20])
            more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
            raise Mismatch(
                f"checkpoint {path} does not fit the state dict (nothing was restored):\n  "
                f"{shown}{more}"
            )

    def apply(self, arrays: dict) -> None:
        """Write the read ``arrays`` (by name) into the target; nothing here can fail half-way."""
        self._apply(self.target, (), arrays)

    def _problem(self, path: tuple, text: str) -> None:
        self.problems.append(f"'{name_of(path) or '<root>'}': {text}")

    def _check(self, value: Any, path: tuple, parent: Any) -> None:
        saved = self.saved[name_of(path)]
        tensor = _torch_tensor(value)
        if tensor is not None:
            self._check_tensor(tensor, saved, path)
        elif isinstance(value, dict):
            self._check_dict(value, saved, path, parent)
        elif isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            items = saved.get("list", saved.get("tuple"))
            if items is None or len(items) != len(value):
                got = _kind(saved) if items is None else f"{_kind(saved)} of {len(items)}"
                self._problem(path, f"a {kind} of {len(value)} here, a {got} in the checkpoint")
                return
            for i, item in enumerate(value):
                self._check(item, (*path, i), value)
        elif "value" not in saved:
            self._problem(
                path, f"a {type(value).__name__} here, a {_kind(saved)} in the checkpoint"
            )

    def _check_tensor(self, tensor: torch.Tensor, saved: dict, path: tuple) -> None:
        if "tensor" not in saved:
            self._problem(path, f"a tensor here, a {_kind(saved)} in the checkpoint")
            return
        shape, dtype = [*tensor.shape], str(tensor.dtype).removeprefix("torch.")
        if shape != saved["shape"] or dtype != saved["dtype"]:
            self._problem(
                path,
                f"shape {tuple(shape)} {dtype} here, {tuple(saved['shape'])} {saved['dtype']} "
                "in the checkpoint",
            )
            return
        layout = None
        if isinstance(tensor, LazyTensor):
            layout = placement.layout_of(tensor) or transfer.landing(tensor.device.index or 0)
            self._twins.setdefault(_layout_key(saved), layout)
        elif tensor.device.type != "cpu":
            self._problem(path, f"a tensor on {tensor.device}; restore into xla or CPU tensors")
            return
        self.reads[name_of(path)] = (path, saved, layout)

    def _check_dict(self, value: dict, saved: dict, path: tuple, parent: Any) -> None:
        if "dict" not in saved:
            self._problem(path, f"a dict here, a {_kind(saved)} in the checkpoint")
            return
        keys = {str(k): k for k, _ in saved["dict"]}
        for key, item in value.items():
            if str(key) in keys:
                self._check(item, (*path, key), value)
            else:
                self._problem((*path, key), "missing from the checkpoint")
        present = {str(k) for k in value}
        extra = [k for text, k in keys.items() if text not in present]
        if not extra or not path:  # top-level items left out are simply not restored
            return
        if not _is_optimizer_state(path, parent):
            for key in extra:
                self._problem((*path, key), "in the checkpoint, not in the state dict")
            return
        self.created[name_of(path)] = extra  # a fresh optimizer's empty state: restore makes it
        for key in extra:
            self._plan_new((*path, key))

    def _plan_new(self, path: tuple) -> None:
        """Reads for a value restore creates; an xla tensor is laid out as a target tensor that
        was saved with the same shape and layout (its parameter), else where new data lands."""
        entry = self.saved[name_of(path)]
        if "tensor" in entry:
            layout = None
            if entry["tensor"] == "xla":
                layout = self._twins.get(_layout_key(entry)) or transfer.landing()
            self.reads[name_of(path)] = (path, entry, layout)
        for key, _ in _children(entry):
            self._plan_new((*path, key))

    def _apply(self, value: Any, path: tuple, arrays: dict) -> Any:
        """``value`` restored: tensors filled in place, containers filled in place (a tuple is
        rebuilt), Python values replaced by the saved ones."""
        name = name_of(path)
        tensor = _torch_tensor(value)
        if tensor is not None:
            _fill(tensor, arrays[name])
            return value
        if isinstance(value, dict):
            for key in list(value):
                value[key] = self._apply(value[key], (*path, key), arrays)
            for key in self.created.get(name, ()):
                value[key] = _build(self.saved, (*path, key), arrays)
            return value
        if isinstance(value, (list, tuple)):
            items = [self._apply(v, (*path, i), arrays) for i, v in enumerate(value)]
            if isinstance(value, list):
                value[:] = items
                return value
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return self.saved[name]["value"]


def _index(entry: dict, path: tuple, out: dict) -> None:
    out[name_of(path)] = entry
    for key, child in _children(entry):
        _index(child, (*path, key), out)


def _children(entry: dict) -> list:
    if "dict" in entry:
        return [(k, v) for k, v in entry["dict"]]
    items = entry.get("list", entry.get("tuple"))
    return list(enumerate(items)) if items is not None else []


def _kind(entry: dict) -> str:
    if "tensor" in entry:
        return "tensor"
    if "value" in entry:
        return type(entry["value"]).__name__
    return next(iter(entry))


def _layout_key(entry: dict) -> tuple:
    return (tuple(entry["shape"]), repr(entry.get("spec")))


def _is_optimizer_state(path: tuple, parent) -> bool:
    """An optimizer's per-parameter state map (``optimizer.state_dict()['state']``), which is
    empty until the first step: restore creates its entries (no ``prime_optimizer`` needed)."""
    return (
        bool(path)
        and path[-1] == "state"
        and isinstance(parent, dict)
        and ("param_groups" in parent)
    )


def _build(saved: dict, path: tuple, arrays: dict):
    """A value restore creates, from its skeleton entry."""
    entry = saved[name_of(path)]
    if "tensor" in entry:
        return _new_tensor(entry, arrays[name_of(path)])
    if "value" in entry:
        return entry["value"]
    if "dict" in entry:
        return {k: _build(saved, (*path, k), arrays) for k, _ in entry["dict"]}
    items = [_build(saved, (*path, i), arrays) for i, _ in _children(entry)]
    return items if "list" in entry else tuple(items)


def _new_tensor(entry: dict, array) -> torch.Tensor:
    dtype = _dtype(entry)
    if entry["tensor"] == "cpu":
        return transfer.to_torch(array, dtype)
    return placement.adopt(array, tuple(entry["shape"]), dtype)


def _fill(t: torch.Tensor, array) -> None:
    if isinstance(t, LazyTensor):
        placement.assign(t, array)
    else:
        with torch.no_grad():
            t.copy_(transfer.to_torch(array, t.dtype))


def read_dtype(entry: dict) -> np.dtype | None:
    """The dtype an xla tensor's array is read as: its device dtype (bf16 switches applied, as
    the target has them now); None for a CPU tensor, read as saved."""
    return to_jax_dtype(_dtype(entry)) if entry["tensor"] == "xla" else None
