"""LazyTensor: a PyTorch tensor on the ``xla`` device whose value is a node of the pending graph.

Tensors that alias (views, ``detach()``) share one ``Storage``; a view also carries the chain of
view ops that reads it from the storage and writes it back, so in-place updates through any alias
become functional updates of the storage's value (see views.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from . import counters
from .engine import current
from .graph import Aval, Node, Ref

DEVICE = torch.device("xla", 0)


class _Devices(dict):
    """``torch.device('xla', n)`` by n, made once each (None: a value any device may read)."""

    def __missing__(self, index: int) -> torch.device:
        self[index] = device = torch.device("xla", index)
        return device


XLA_DEVICES = _Devices({None: DEVICE})
# Non-empty once a tensor was put on a device other than xla:0: until then every op is on xla:0
# and tracing skips finding an op's device (a list: its truth test is the cheapest check).
SEVERAL_DEVICES: list = []


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided
_STORAGES = counters.STORAGES  # [made, freed]: not atomic across threads (a loader's upload
# racing a traced op may go uncounted), as a lock would cost every op more


class Storage:
    """The value shared by a tensor and all its aliases, with a version bumped on every write."""

    __slots__ = ("ref", "version", "views", "sharding", "from_host", "overwrote", "__weakref__")

    def __init__(self, ref: Ref):
        _STORAGES[0] += 1
        # ``set`` inlined for a first value: every traced op makes a storage
        node = ref[0]
        node.holders += 1
        self.ref = ref
        self.version = 1
        self.views = None  # weak refs to views caching a value read from this storage
        self.sharding = None  # jax Sharding every value written here gets (see placement.py)
        self.from_host = False  # an upload no program wrote since: no sharding spec of its own
        # (id(node), index) of the last computed value a write replaced: the program input whose
        # buffer the barrier's new value may take over (see compile.aliasing_of)
        self.overwrote = None
        if node.arrays is None or node.arrays[ref[1]] is None:  # pending: inlined is_leaf
            current().pending.append(weakref.ref(self))

    def set(self, ref: Ref) -> None:
        node = ref[0]
        node.holders += 1
        old = self.ref
        if old is not None:
            old[0].holders -= 1
            if old[0].arrays is not None:
                self.overwrote = (id(old[0]), old[1])
        self.ref = ref
        self.version += 1
        if self.views is not None:
            self._forget_view_caches()
        if node.arrays is None or node.arrays[ref[1]] is None:  # pending: inlined is_leaf
            current().pending.append(weakref.ref(self))

    def _forget_view_caches(self) -> None:
        """Stale view caches would keep the old graph (and its input arrays) alive."""
        for weak in self.views:
            view = weak()
            if view is not None:
                view._cache, view._cache_version = None, -1
        self.views = None

    @property
    def aval(self) -> Aval:
        node, index = self.ref
        return node.avals[index]

    def __del__(self, _storages=_STORAGES) -> None:  # bound here: at exit globals are None
        _storages[1] += 1
        if self.ref is not None:
            self.ref[0].holders -= 1


class LazyTensor(torch.Tensor):
    """A tensor on the xla device; ``_storage`` holds its value, ``_view`` how to read it from there."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    # Defaults every tensor starts with, read from the class: only the storage is set per tensor.
    # (No __slots__: torch.utils.swap_tensors, which Module.to uses for wrapper subclasses,
    # refuses tensors whose slots differ from the CPU parameter's.)
    _view: tuple | None = None
    _cache: Ref | None = None  # a view's value, valid while its storage's version is
    _cache_version = -1

    @staticmethod
    def __new__(cls, storage: Storage, aval: Aval, view: tuple | None = None) -> LazyTensor:
        device = current().mode.names[storage.ref[0].device] if SEVERAL_DEVICES else DEVICE
        # positionally (strides, storage offset, memory format, dtype, layout, device): parsing
        # keywords cost every traced op 0.28 µs more (1.10 against 0.81 µs)
        t = _make_wrapper(cls, aval.shape, None, None, None, aval.dtype, _STRIDED, device)
        t._storage = storage
        if view is not None:
            t._view = view
        return t

    def __init__(self, *args, **kwargs):
        pass

    def untyped_storage(self) -> torch.UntypedStorage:
        # No host memory (data pointer 0, as PyTorch/XLA's device storages): code looking for
        # tensors that share memory (safetensors) finds none, instead of an invalid storage.
        return torch.UntypedStorage(0)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if len(types) > 1 and not all(issubclass(t, LazyTensor) for t in types):
            return NotImplemented  # another subclass's (XLAShardedTensor): it unwraps, then here
        start = time.perf_counter_ns()
        out = _dispatch(func, args, kwargs or _NO_KWARGS)
        _traced(time.perf_counter_ns() - start)  # LazyTracing's sample, as PyTorch/XLA's
        return out

    def _ref(self) -> Ref:
        """The graph value of this tensor, read through its view chain when it is a view."""
        if self._view is None:
            return self._storage.ref
        if self._cache_version == self._storage.version:
            return self._cache
        ref = self._storage.ref
        for entry in self._view:
            ref = entry.read(ref)
        self._remember(ref)
        return ref

    def _remember(self, ref: Ref) -> None:
        """Cache a view's value until its storage is written again."""
        storage = self._storage
        self._cache, self._cache_version = ref, storage.version
        if storage.views is None:
            storage.views = []
        storage.views.append(weakref.ref(self))

    def _alias_of(self, other: LazyTensor) -> None:
        """Make this tensor another name for ``other``'s value (``set_``, ``.data =``)."""
        self._storage, self._view = other._storage, other._view
        self._cache, self._cache_version = None, -1

    def _write(self, ref: Ref) -> None:
        """Make ``ref`` this tensor's value, writing it back through the view chain to the storage."""
        if self._view is None:
            self._storage.set(ref)
            return
        if any(entry.overlapping for entry in self._view):  # copy on write: see views.OVERLAPPING
            self._storage, self._view = Storage(ref), None
            self._cache, self._cache_version = None, -1
            return
        bases = [self._storage.ref]
        for entry in self._view[:-1]:
            bases.append(entry.read(bases[-1]))
        new = ref
        for entry, base in zip(reversed(self._view), reversed(bases)):
            new = entry.write(base, new)
        self._storage.set(new)
        self._remember(ref)

    def __repr__(self, *, tensor_contents=None) -> str:
        text = repr(self.detach().cpu())
        suffix = f", device='{self.device}'"
        if text.endswith(")"):
            return text[:-1] + suffix + ")"
        return text

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """``p.data = t`` swaps the C++ metadata; the value lives on the Python side, so swap it too."""
        torch._C.TensorBase.data.__set__(self, new)
        if isinstance(new, LazyTensor):
            self._alias_of(new)

    def __tensor_flatten__(self) -> tuple[list, None]:
        """A traceable wrapper subclass, for two reasons. ``Module.to('xla')`` then swaps each
        parameter in place (tied parameters stay tied, as on CUDA). And ``torch.compile`` can
        trace it: Dynamo fakes its one inner tensor, ``_handle``, and the fake stands for the
        tensor itself (``__tensor_unflatten__``), so Dynamo's and AOTAutograd's graphs are over
        plain fake xla tensors, and compiled graphs get the LazyTensors themselves at run time
        (core/dynamo_bridge.py). No context: guards compare it, and it never changes."""
        return ["_handle"], None

    @property
    def _handle(self) -> TensorHandle:
        return TensorHandle(self)

    @staticmethod
    def __tensor_unflatten__(inner: dict, context: None, outer_size, outer_stride):
        """The fake of the handle, as the fake of this tensor; a handle, as its tensor."""
        handle = inner["_handle"]
        return handle.tensor if type(handle) is TensorHandle else handle

    def _is_view(self) -> bool:
        """Never an autograd view to Python code (torch.compile's fakes): a view's aliasing is the
        engine's (``_view``), and a fake of it must be as plain as the fakes of other tensors."""
        return False

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        """AOTAutograd traced the tangent as a plain tensor: pass the handle of this one."""
        return TensorHandle(self)

    def tolist(self) -> list:
        return self.detach().cpu().tolist()

    def __reduce_ex__(self, protocol):
        args = (self.detach().cpu(), self.requires_grad)  # xla:0's as before: older loaders read it
        return (_rebuild_on_device, args + ((self.device.index,) if self.device.index else ()))


_NO_KWARGS: dict = {}
_traced = counters.TRACING.append


class TensorHandle(torch.Tensor):
    """An xla tensor where torch.compile needs a tensor that is not a traceable subclass: the
    inner tensor Dynamo fakes, and a backward's tangent. Compiled graphs read the tensor back."""

    @staticmethod
    def __new__(cls, tensor: LazyTensor) -> TensorHandle:
        handle = torch.Tensor._make_wrapper_subclass(
            cls, tensor.shape, dtype=tensor.dtype, device=tensor.device, strides=tensor.stride()
        )
        handle.tensor = tensor
        return handle

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """An op on a handle is an op on its tensor (a graph another torch.compile backend made
        gets a backward's tangent as a handle)."""
        args, kwargs = pytree.tree_map_only(TensorHandle, lambda h: h.tensor, (args, kwargs or {}))
        return func(*args, **kwargs)


def _not_connected(func, args: tuple, kwargs: dict):
    raise RuntimeError(f"{func} on an xla tensor before spmd_torch's dispatcher was imported")


_dispatch: Callable = _not_connected


def connect(dispatcher: Callable) -> None:
    """Send every aten call on an xla tensor to ``dispatcher``: dispatch.py, which sits above this
    module (it records, reads values and falls back to the CPU), plugs itself in when imported."""
    global _dispatch
    _dispatch = dispatcher


def _rebuild_on_device(cpu: torch.Tensor, requires_grad: bool, index: int = 0) -> torch.Tensor:
    """An unpickled xla tensor, back on its xla device (``xla:0`` pickles as before)."""
    return cpu.to(XLA_DEVICES[index]).requires_grad_(requires_grad)


def live_pending() -> list[Storage]:
    """Live storages that were given a pending value, each once, in last-write order.

    Last, not first: a storage written before the step began (``.to()`` fills a fresh tensor)
    would otherwise order this step's outputs differently from the next step's.
    """
    seen: set = set()
    storages = []
    for weak in reversed(current().pending):
        storage = weak()
        if storage is not None and id(storage) not in seen:
            seen.add(id(storage))
            storages.append(storage)
    storages.reverse()
    return storages


_new_tensor = LazyTensor.__new__


def on_xla(t, what: str, error: type[Exception] = ValueError) -> LazyTensor:
    """``t`` if it is a tensor on the xla device; else ``error``, naming ``what`` (the API and
    argument) and what ``t`` is instead. The one check every API that needs device data makes."""
    if isinstance(t, torch.Tensor) and t.device.type == "xla":
        return t
    got = (
        f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
        if isinstance(t, torch.Tensor)
        else f"a {type(t).__name__}"
    )
    raise error(
        f"{what} needs a tensor on the xla device, got {got} (move it first with "
        ".to(spmd_torch.device()))"
    )


def wrap(ref: Ref, aval: Aval) -> LazyTensor:
    """A fresh tensor (its own storage) whose value is ``ref``."""
    return _new_tensor(LazyTensor, Storage(ref), aval)  # no ``__init__`` call: every op makes one


def wrap_data(array, aval: Aval, device: int | None = 0) -> LazyTensor:
    return wrap((Node.data(array, aval, device), 0), aval)
