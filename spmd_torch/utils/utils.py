"""torch_xla.utils.utils: the small helpers PyTorch/XLA scripts and tests import as ``xu``.

Synthetic data (:class:`SampleGenerator`, :class:`FnDataGenerator`), typed environment reads
(:func:`getenv_as`, :func:`check_env_flag`), walking nested data (:func:`for_each_instance`,
:func:`for_each_instance_rewrite`, :class:`DataWrapper`), timing and printing helpers, temporary
folders and free TCP ports. Nothing here touches the device: these are plain Python utilities.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import socket
import sys
import tempfile
import time
import types
import weakref
from collections.abc import Callable
from concurrent import futures
from typing import Any

import torch

from spmd_torch import config

__all__ = [
    "Cleaner",
    "DataWrapper",
    "FnDataGenerator",
    "LazyProperty",
    "SampleGenerator",
    "TimedScope",
    "TmpFolder",
    "as_list",
    "check_env_flag",
    "eprint",
    "flatten_nested_tuple",
    "for_each_instance",
    "for_each_instance_rewrite",
    "get_free_tcp_ports",
    "get_print_fn",
    "getenv_as",
    "list_copy_append",
    "null_print",
    "parallel_work",
    "shape",
    "timed",
]


class Cleaner:
    """Calls ``func`` once when the Cleaner is garbage collected (or the interpreter exits).

    Args:
        func: What to run, with no arguments.

    Example:
        >>> cleaner = xu.Cleaner(lambda: print('cleaned'))
        >>> del cleaner
        cleaned
    """

    def __init__(self, func: Callable[[], Any]) -> None:
        self.func = func
        self._finalizer = weakref.finalize(self, func)


class LazyProperty:
    """A value computed by ``gen_fn`` the first time :attr:`value` is read, then kept.

    Args:
        gen_fn: Computes the value, with no arguments.

    Example:
        >>> devices = xu.LazyProperty(lambda: jax.devices())
        >>> devices.value  # computed now, once
    """

    def __init__(self, gen_fn: Callable[[], Any]) -> None:
        self._gen_fn: Callable[[], Any] | None = gen_fn
        self._value: Any = None

    @property
    def value(self) -> Any:
        if self._gen_fn is not None:
            self._value = self._gen_fn()
            self._gen_fn = None
        return self._value


class TmpFolder:
    """A new temporary directory (:attr:`name`), deleted with its contents when the object is
    garbage collected.

    Example:
        >>> folder = xu.TmpFolder()
        >>> torch.save(state, os.path.join(folder.name, 'state.pt'))
    """

    def __init__(self) -> None:
        self.name = tempfile.mkdtemp()
        self.cleaner = Cleaner(lambda name=self.name: shutil.rmtree(name, ignore_errors=True))


class SampleGenerator:
    """Yields the same ``data`` ``sample_count`` times: a stand-in for a DataLoader of fake data.

    Each ``iter()`` starts over, so it serves several epochs, and ``len()`` is ``sample_count``.

    Args:
        data: What every step yields (for instance a ``(inputs, targets)`` pair).
        sample_count: How many times an iteration yields it.

    Example:
        >>> loader = xu.SampleGenerator((torch.zeros(8, 3), torch.zeros(8, dtype=torch.long)), 100)
        >>> for data, target in loader:
        ...     ...
    """

    def __init__(self, data: Any, sample_count: int) -> None:
        self._data = data
        self._sample_count = sample_count
        self._count = 0

    def __iter__(self) -> SampleGenerator:
        return SampleGenerator(self._data, self._sample_count)

    def __len__(self) -> int:
        return self._sample_count

    def __next__(self) -> Any:
        if self._count >= self._sample_count:
            raise StopIteration
        self._count += 1
        return self._data

    def next(self) -> Any:
        """The next sample (``next(self)``)."""
        return self.__next__()


class FnDataGenerator:
    """Yields ``count`` fresh ``(data, func(data))`` pairs, ``data = gen_tensor(batch_size, *dims)``.

    Args:
        func: Computes the target of a batch.
        batch_size: The first argument of ``gen_tensor``.
        gen_tensor: Makes a batch, e.g. ``torch.randn``.
        dims: The other dimensions of a batch (default ``[1]``).
        count: How many pairs an iteration yields.

    Example:
        >>> loader = xu.FnDataGenerator(lambda x: x.sum(1), 8, torch.randn, dims=[4], count=10)
        >>> data, target = next(iter(loader))
    """

    def __init__(
        self,
        func: Callable[[Any], Any],
        batch_size: int,
        gen_tensor: Callable[..., Any],
        dims: list[int] | None = None,
        count: int = 1,
    ) -> None:
        self._func = func
        self._batch_size = batch_size
        self._gen_tensor = gen_tensor
        self._dims = list(dims) if dims else [1]
        self._count = count
        self._emitted = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> FnDataGenerator:
        return FnDataGenerator(
            self._func, self._batch_size, self._gen_tensor, dims=self._dims, count=self._count
        )

    def __next__(self) -> tuple[Any, Any]:
        if self._emitted >= self._count:
            raise StopIteration
        data = self._gen_tensor(self._batch_size, *self._dims)
        self._emitted += 1
        return data, self._func(data)

    def next(self) -> tuple[Any, Any]:
        """The next pair (``next(self)``)."""
        return self.__next__()


class DataWrapper:
    """Base class for objects that hold tensors in a form the data walkers cannot see into.

    :func:`for_each_instance` visits what :meth:`get_tensors` returns;
    :func:`for_each_instance_rewrite` (and so ``xm.send_cpu_data_to_device``, ``xm.save``)
    rebuilds the object with :meth:`from_tensors` from the rewritten tensors.

    Example:
        >>> class Pair(xu.DataWrapper):
        ...     def __init__(self, a, b):
        ...         self.a, self.b = a, b
        ...     def get_tensors(self):
        ...         return [self.a, self.b]
        ...     def from_tensors(self, tensors):
        ...         return Pair(*tensors)
        >>> on_device = xm.send_cpu_data_to_device(Pair(x, y), device)
    """

    def get_tensors(self) -> list:
        """The tensors this object holds, in the order :meth:`from_tensors` takes them."""
        raise NotImplementedError(f"{type(self).__name__} must define get_tensors()")

    def from_tensors(self, tensors: list) -> Any:
        """A new object like this one holding ``tensors`` (``tensors[i]`` replaces
        ``get_tensors()[i]``)."""
        raise NotImplementedError(f"{type(self).__name__} must define from_tensors()")


def as_list(t: Any) -> list | tuple:
    """``t`` itself if it is a list or tuple, else ``[t]``.

    Example:
        >>> xu.as_list(3), xu.as_list((1, 2))
        ([3], (1, 2))
    """
    return t if isinstance(t, (tuple, list)) else [t]


def getenv_as(name: str, type: type, defval: Any = None) -> Any:
    """The environment variable ``name`` converted to ``type``, or ``defval`` when it is unset.

    For ``bool``, integers read as their truth (``'0'`` False, ``'1'`` True) as in PyTorch/XLA,
    and so do the words ``true/false``, ``yes/no``, ``on/off`` (PyTorch/XLA refuses words).

    Args:
        name: The variable.
        type: ``int``, ``float``, ``str``, ``bool`` or any one-argument constructor.
        defval: The value when the variable is not set.

    Raises:
        ValueError: The value does not parse as ``type``; the message names the variable.

    Example:
        >>> os.environ['BATCH'] = '64'
        >>> xu.getenv_as('BATCH', int, 32)
        64
    """
    env = os.environ.get(name)
    return defval if env is None else config.parse(env, type, name)


def check_env_flag(name: str, default: str = "") -> bool:
    """Whether the environment variable ``name`` (or ``default`` when unset) reads as on:
    ``1``, ``ON``, ``YES``, ``TRUE`` or ``Y`` in any case, or another nonzero integer, as every
    switch spmd_torch reads (text that is neither reads as off).

    Example:
        >>> os.environ['XLA_USE_SPMD'] = '1'
        >>> xu.check_env_flag('XLA_USE_SPMD')
        True
    """
    try:
        return bool(config.parse(os.environ.get(name, default), bool, name))
    except ValueError:
        return False


_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.Tensor)
_OPAQUE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)
_WALKING = object()  # the memo's mark of a container whose walk is under way


def _fillable(item: Any) -> bool:
    """Whether a rewrite can copy ``item`` before walking it and fill the copy in afterwards
    (what a cycle back to it needs): dicts, lists and plain objects."""
    if isinstance(item, (dict, list)):
        return True
    return hasattr(item, "__dict__") and not isinstance(item, (tuple, set, frozenset, DataWrapper))


def for_each_instance(value: Any, select_fn: Callable[[Any], bool], fn: Callable[[Any], Any]):
    """Call ``fn(v)`` on every ``v`` inside ``value`` for which ``select_fn(v)`` is true.

    Walks dicts (keys and values), lists, tuples, sets, :class:`DataWrapper` objects (their
    ``get_tensors()``) and other objects' ``__dict__``. Each object is visited once, so a tensor
    held twice gets one call. Unselected tensors, strings, numbers, classes, functions and
    modules are not looked into.

    Args:
        value: Any nesting of containers and objects.
        select_fn: Picks the values to call ``fn`` on.
        fn: Called on each picked value, in order of first appearance.

    Example:
        >>> sizes = []
        >>> xu.for_each_instance({'a': [x, y]}, torch.is_tensor, lambda t: sizes.append(t.numel()))
    """
    seen: dict[int, Any] = {}  # id -> the object: holding it keeps the ids unique

    def visit(item: Any) -> None:
        if id(item) in seen:
            return
        seen[id(item)] = item
        if select_fn(item):
            fn(item)
        elif isinstance(item, _ATOMS) or isinstance(item, _OPAQUE):
            return
        elif isinstance(item, dict):
            for key, entry in item.items():
                visit(key)
                visit(entry)
        elif isinstance(item, (list, tuple, set, frozenset)):
            for entry in item:
                visit(entry)
        elif isinstance(item, DataWrapper):
            for entry in item.get_tensors():
                visit(entry)
        elif hasattr(item, "__dict__"):
            for entry in list(vars(item).values()):
                visit(entry)

    visit(value)


def for_each_instance_rewrite(
    value: Any, select_fn: Callable[[Any], bool], fn: Callable[[Any], Any]
) -> Any:
    """``value`` with every ``v`` where ``select_fn(v)`` replaced by ``fn(v)``.

    Walks what :func:`for_each_instance` walks. A value held twice is converted once and both
    places get the same result, so aliasing survives. Containers and objects holding nothing
    selected are returned as they are; the others are copied (shallowly), never mutated. Tuples
    stay tuples and namedtuples keep their type (PyTorch/XLA turns tuples into lists). Objects
    are walked through their attribute values. Cycles are followed once: a reference back to a
    dict, list or object being copied points at its copy.

    Args:
        value: Any nesting of containers and objects.
        select_fn: Picks the values to replace.
        fn: Makes the replacement of a picked value.

    Example:
        >>> cpu = xu.for_each_instance_rewrite(batch, xm.is_xla_tensor, lambda t: t.cpu())
    """
    memo: dict[int, tuple[Any, Any]] = {}  # id -> (result, original): originals keep ids unique
    early: dict[int, Any] = {}  # id -> the copy a cycle back to a container being walked got

    def rewrite(item: Any) -> Any:
        key = id(item)
        if key in memo:
            result = memo[key][0]
            if result is not _WALKING:
                return result
            if key not in early:  # a cycle: it gets the copy this item will be filled into
                early[key] = copy.copy(item) if _fillable(item) else item
            return early[key]
        memo[key] = (_WALKING, item)
        result = _rewritten(item)
        memo[key] = (result, item)
        return result

    def _copy(item: Any) -> Any:
        return early.pop(id(item)) if id(item) in early else copy.copy(item)

    def _rewritten(item: Any) -> Any:
        if select_fn(item):
            return fn(item)
        if isinstance(item, _ATOMS) or isinstance(item, _OPAQUE):
            return item
        if isinstance(item, dict):
            pairs = [(rewrite(k), rewrite(v)) for k, v in item.items()]
            same = all(nk is k and nv is v for (nk, nv), (k, v) in zip(pairs, item.items()))
            if same and id(item) not in early:
                return item
            result = _copy(item)
            result.clear()
            result.update(pairs)
            return result
        if isinstance(item, (list, tuple, set, frozenset)):
            entries = [rewrite(entry) for entry in item]
            if all(new is old for new, old in zip(entries, item)) and id(item) not in early:
                return item
            if isinstance(item, tuple) and hasattr(item, "_fields"):
                return type(item)(*entries)
            if isinstance(item, list):
                result = _copy(item)
                result[:] = entries
                return result
            return type(item)(entries)
        if isinstance(item, DataWrapper):
            tensors = item.get_tensors()
            entries = [rewrite(entry) for entry in tensors]
            if all(new is old for new, old in zip(entries, tensors)):
                return item
            return item.from_tensors(entries)
        if hasattr(item, "__dict__"):  # attribute values only, as PyTorch/XLA (not their names)
            state = {name: rewrite(v) for name, v in vars(item).items()}
            changed = {n: v for n, v in state.items() if v is not vars(item)[n]}
            if not changed and id(item) not in early:
                return item
            result = _copy(item)
            result.__dict__.update(changed)
            return result
        return item

    return rewrite(value)


def shape(inputs: Any) -> list[int]:
    """The shape of a nesting of lists/tuples: ``[len(outer), len(inner), ...]``; ``[]`` for a
    non-sequence.

    Raises:
        ValueError: Two elements of one level have different shapes.

    Example:
        >>> xu.shape([[1, 2, 3], [4, 5, 6]])
        [2, 3]
    """
    if not isinstance(inputs, (list, tuple)):
        return []
    shapes = [shape(item) for item in inputs]
    for index, item_shape in enumerate(shapes[1:], start=1):
        if item_shape != shapes[0]:
            raise ValueError(
                f"shape: element {index} has shape {item_shape}, element 0 has {shapes[0]}"
            )
    return [len(inputs)] + (shapes[0] if shapes else [])


def flatten_nested_tuple(inputs: Any) -> tuple:
    """The leaves of a nesting of lists/tuples, in order, as one flat tuple.

    Example:
        >>> xu.flatten_nested_tuple((1, (2, [3, 4]), 5))
        (1, 2, 3, 4, 5)
    """
    if not isinstance(inputs, (list, tuple)):
        return (inputs,)
    return tuple(leaf for item in inputs for leaf in flatten_nested_tuple(item))


def list_copy_append(ilist: list, item: Any) -> list:
    """A new list: ``ilist``'s items followed by ``item`` (``ilist`` is left unchanged).

    Example:
        >>> xu.list_copy_append([1, 2], 3)
        [1, 2, 3]
    """
    return [*ilist, item]


def null_print(*args: Any, **kwargs: Any) -> None:
    """Prints nothing: the print function of :func:`get_print_fn` when debugging is off.

    Example:
        >>> xu.null_print('not shown')
    """


def eprint(*args: Any, **kwargs: Any) -> None:
    """``print`` to standard error.

    Example:
        >>> xu.eprint('step', 3)
    """
    print(*args, file=sys.stderr, **kwargs)


def get_print_fn(debug: bool | int | None = None) -> Callable[..., None]:
    """:func:`eprint` when debugging, else :func:`null_print`.

    Args:
        debug: Whether to print; default: the ``DEBUG`` environment variable (an integer).

    Example:
        >>> log = xu.get_print_fn()
        >>> log('shown only with DEBUG=1')
    """
    if debug is None:
        debug = config.PRINT_DEBUG.read()
    return eprint if debug else null_print


def timed(fn: Callable[[], Any], msg: str = "", printfn: Callable[..., None] | None = eprint):
    """Run ``fn()`` and print ``msg`` followed by its wall time, ``'{msg}12.345ms'``.

    Args:
        fn: What to run, with no arguments.
        msg: Printed before the time.
        printfn: Prints the line; ``None``: :func:`get_print_fn`'s choice.

    Returns:
        What ``fn()`` returned.

    Example:
        >>> loss = xu.timed(lambda: train_step(batch), msg='step: ')
        step: 12.345ms
    """
    with TimedScope(msg, printfn):
        return fn()


class TimedScope:
    """Prints ``msg`` followed by the block's wall time at its end, unless an error was set.

    Args:
        msg: Printed before the time.
        printfn: Prints the line; ``None``: :func:`get_print_fn`'s choice.

    Example:
        >>> with xu.TimedScope('epoch: '):
        ...     train_epoch()
        epoch: 1234.567ms
    """

    def __init__(self, msg: str = "", printfn: Callable[..., None] | None = eprint) -> None:
        self._msg = msg
        self._printfn = get_print_fn() if printfn is None else printfn
        self._error: BaseException | None = None
        self._start = 0.0

    def __enter__(self) -> TimedScope:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self._error is None:
            elapsed_ms = 1000.0 * (time.perf_counter() - self._start)
            self._printfn(f"{self._msg}{elapsed_ms:.3f}ms")

    def set_error(self, error: BaseException) -> None:
        """Suppress the timing line (the block failed)."""
        self._error = error


def get_free_tcp_ports(n: int = 1) -> list[int]:
    """``n`` distinct TCP ports that were free on this host a moment ago (for rendezvous
    addresses of launchers).

    Each port is bound (to pick it) and released before returning; all ``n`` are held together
    while picking, so they differ.

    Example:
        >>> (port,) = xu.get_free_tcp_ports()
        >>> os.environ['MASTER_PORT'] = str(port)
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("", 0))
            ports.append(sock.getsockname()[1])
        return ports


def parallel_work(num_workers: int, fn: Callable[..., Any], *args: Any) -> list:
    """``list(map(fn, *args))`` computed by ``num_workers`` threads; results in input order.

    Raises:
        Exception: The first error a call raised, re-raised here.

    Example:
        >>> xu.parallel_work(4, lambda path: os.path.getsize(path), paths)
    """
    with futures.ThreadPoolExecutor(max_workers=num_workers) as executor:
        return list(executor.map(fn, *args))
