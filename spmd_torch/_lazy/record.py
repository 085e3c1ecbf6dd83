"""Recording one op call as a Node: tensors become sources, output shapes come from meta kernels.

This is the hot path of tracing (every op pays for it), so the argument walk builds the node's
static arguments and the meta-cache key in one pass, and meta kernels run once per distinct
signature: a training step traced again never calls them.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
import sys
import warnings
from typing import Any

import torch
from jax._src.lib import xla_client  # Traceback: JAX's own capture of the Python stack

from spmd_torch import config

from . import counters
from .engine import current
from .graph import SCALAR, Arg, Aval, Node, Ref, Value
from .lowering.checks import AFTER_META, BEFORE_META, IndexCheckError
from .lowering.dtypes import to_jax_dtype
from .tensor import DEVICE, SEVERAL_DEVICES, XLA_DEVICES, LazyTensor, wrap_data
from .transfer import UPLOAD_WHEN_READ, to_device_array, upload_read

_traceback = xla_client.Traceback.get_traceback

_META_DEVICE = torch.device("meta")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__))

_ARGS = [Arg(i) for i in range(4096)]  # shared placeholders: no allocation per traced argument

_OPS = counters.OPS  # cleared in place, never replaced
# (op, argument signature) -> (output avals, output structure, its static part's number)
_META_CACHE: dict[tuple, tuple] = {}
# A signature less its tensors' avals (the op, its static values and their types) -> a number
# from 1 (0: a node built otherwise): ``Node.signature``. Drawn from a counter, so that replica
# threads meeting two new signatures at once never give them one number.
_STATIC_NUMBERS: dict[tuple, int] = {}
_NEXT_NUMBER = itertools.count(1)


NESTED = "nested"  # an op's output structure that is lists of tensors, by their lengths
TENSOR = object()  # a tensor result in an op's output structure (other results are kept as is)


class DeviceMismatchError(RuntimeError):
    pass


class Lifted:
    """A Python number that an op not tagged pointwise takes as a program input (the fill value
    of ``full``, dropout's p: ``dispatch._LIFTED_AT``), so a new value each step is one program;
    its meta kernel sees the number itself."""

    __slots__ = ("value",)

    def __init__(self, value: float | int):
        self.value = value


class NoStaticShape(Exception):
    """The op's output shape depends on data (boolean masks, nonzero): it cannot be traced."""


def emit(
    func,
    args: tuple,
    kwargs: dict,
    lift_floats: bool = False,
    key: Ref | None = None,
    lift_ints: bool = False,
) -> tuple[Node, Any]:
    """Record ``func(*args, **kwargs)``; returns the node and its output structure.

    Tensor arguments are LazyTensors or ``Value``s (graph references the engine passes around);
    with ``lift_floats`` Python floats, and with ``lift_ints`` Python ints, become program inputs
    instead of constants. A random op gets its PRNG ``key`` as first source and first argument.
    """
    src: list = [key] if key is not None else []
    signature: list = [id(func)]  # OpOverload.__hash__ is Python code; overloads live forever
    static: list = []
    for a in args:  # _walk inlined for tensors and lifted floats: this loop runs for every op
        cls = type(a)
        if cls is LazyTensor:
            ref = a._storage.ref if a._view is None else a._ref()
            signature.append(ref[0].avals[ref[1]])
            static.append(_ARGS[len(src)])
            src.append(ref)
        elif cls is float and lift_floats:
            static.append(_ARGS[len(src)])
            src.append((Node.scalar(a), 0))
            signature.append(float)
        else:
            static.append(_walk(a, src, signature, lift_floats, lift_ints))
    static_args = tuple(static)
    static_kwargs = {}
    if kwargs:
        static_kwargs = {
            k: _walk(v, src, signature, lift_floats, lift_ints) for k, v in kwargs.items()
        }
        signature.append(tuple(kwargs))
    if UPLOAD_WHEN_READ.data:  # the torch_xla face's SPMD uploads (transfer.py)
        upload_read(src)
    signature = tuple(signature)
    meta = _META_CACHE.get(signature)
    if meta is None:
        static = tuple(entry for entry in signature if type(entry) is not Aval)
        number = _STATIC_NUMBERS.setdefault(static, next(_NEXT_NUMBER))
        meta = _META_CACHE[signature] = (*_infer(func, args, kwargs), number)
        counters.OP_NAMES[signature[0]] = f"xla::{func.overloadpacket.__name__}"
    _OPS[signature[0]] += 1
    avals, structure, signature_number = meta
    if key is not None:
        static_args = (Arg(0),) + static_args
    node = Node(func, tuple(src), static_args, static_kwargs, avals, signature_number)
    if SEVERAL_DEVICES:
        node.device = _device_of(func, src[0 if key is None else 1 :], kwargs)
    if config.IR_DEBUG.value:  # a traceback costs ~0.1 us: only when debugging
        node.where = Where(_traceback())
    return node, structure


def _device_of(func, sources: list, kwargs: dict) -> int:
    """The xla:N an op runs on: the one it is given (a factory, ``.to('xla:1')``), else its
    tensors' (a copy's: its destination's), which must agree, as on CUDA."""
    device = kwargs.get("device")
    if type(device) is torch.device and device.type == DEVICE.type:
        return current().mode.index_of(device.index)
    # Lifted scalars and 0-dim CPU tensors go with any device.
    found = [n.device for n, _ in sources if n.device is not None and n.op != SCALAR]
    other = next((d for d in found if d != found[0]), None) if func is not _COPY else None
    if other is not None:
        raise DeviceMismatchError(
            f"{func}: Expected all tensors to be on the same device, but found at least two "
            f"devices, {XLA_DEVICES[found[0]]} and {XLA_DEVICES[other]}!"
        )
    return found[0] if found else 0


_COPY = torch.ops.aten.copy.default


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's: not spmd_torch's, torch's or the importer's."""
    return not filename.startswith((_PACKAGE_ROOT, _TORCH_ROOT)) and "importlib" not in filename


def user_frames() -> list:
    """The user's frames on the calling thread's stack, innermost first."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            frames.append(frame)
        frame = frame.f_back
    return frames


def user_frame() -> str:
    """file:line of the innermost frame outside spmd_torch and torch."""
    frame = sys._getframe(1)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller name the user's line."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back
    return level if frame is not None else 1


class Where:
    """Where user code recorded a node (``XLA_IR_DEBUG``): its Python traceback, which reads as
    the user's innermost file:line; ``XLA_HLO_DEBUG`` makes it its HLO ops' source metadata."""

    __slots__ = ("traceback",)

    def __init__(self, traceback):
        self.traceback = traceback

    def __str__(self) -> str:
        for frame in self.traceback.frames:  # innermost first
            if is_user_file(frame.file_name):
                return f"{os.path.basename(frame.file_name)}:{frame.line_num}"
        return "<unknown>"


_NANS: dict[bytes, float] = {}  # a static NaN's bits -> the one object standing for it
LIFTED_INTS = range(-(2**53), 2**53 + 1)  # exact in the float64 vector scalars travel in


def _walk(x: Any, src: list, key: list, lift_floats: bool, lift_ints: bool = False) -> Any:
    cls = type(x)
    if cls is LazyTensor:
        ref = x._ref()
        src.append(ref)
        key.append(ref[0].avals[ref[1]])
        return Arg(len(src) - 1)
    if cls is Value:
        src.append(x.ref)
        key.append(x.aval)
        return Arg(len(src) - 1)
    if cls is float and lift_floats:
        src.append((Node.scalar(x), 0))
        key.append(float)
        return Arg(len(src) - 1)
    if cls is int and lift_ints and x in LIFTED_INTS:
        src.append((Node.scalar(x), 0))
        key.append(int)
        return Arg(len(src) - 1)
    if cls is Lifted:
        src.append((Node.scalar(x.value), 0))
        key.append(type(x.value))
        return Arg(len(src) - 1)
    if cls is list or cls is tuple:
        if x and lift_floats and _lifted_as_one(x, lift_ints):  # a foreach op's Scalar[]
            if x.count(x[0]) == len(x):  # one value (AdamW's bias corrections): one scalar,
                # so every element's computation is alike and XLA compiles its kernel once
                src.append((Node.scalar(x[0]), 0))
                key.append((type(x[0]), len(x), "one value"))
                return (Arg(len(src) - 1),) * len(x)
            src.append((Node.scalar(tuple(x)), 0))
            key.append((type(x[0]), len(x)))
            return Arg(len(src) - 1)
        if not lift_ints and all([type(v) is int for v in x]):  # a shape, dims: one key entry
            static = tuple(x)
            key.append((int, static))
            return static
        key.append(len(x))
        walked = []
        for v in x:  # tensors inlined: a foreach op's lists hold one per parameter
            if type(v) is LazyTensor:
                ref = v._storage.ref if v._view is None else v._ref()
                key.append(ref[0].avals[ref[1]])
                walked.append(_ARGS[len(src)] if len(src) < len(_ARGS) else Arg(len(src)))
                src.append(ref)
            else:
                walked.append(_walk(v, src, key, lift_floats, lift_ints))
        return tuple(walked)
    if isinstance(x, torch.Tensor):
        return _walk(_upload_cpu_tensor(x), src, key, lift_floats)
    if cls is torch.device and x.type == DEVICE.type:
        # The device as the graph knows it: a replica's is 0 whatever its name (CPU's replicas
        # on xla:0..N-1 under the torch_xla face), so replicas trace one program.
        x = XLA_DEVICES[current().mode.index_of(x.index)]
    if cls is float and x != x:  # NaN: one object per bit pattern, else no key holding it
        x = _NANS.setdefault(struct.pack("<d", x), x)  # equals another (its hash is its id)
    key.append(x)
    # 1, 1.0 and True are equal keys but give different result dtypes; 0.0 and -0.0 are equal
    # keys but give different signs (where(mask, x, -0.0))
    key.append(cls if cls is not float or x != 0.0 else math.copysign(1.0, x))
    return x


def _lifted_as_one(values, lift_ints: bool) -> bool:
    """Whether a list of Python numbers becomes one lifted vector: all floats, or all ints
    (exact in float64) where ints are lifted."""
    kind = type(values[0])
    if kind is float:
        return all(type(v) is float for v in values)
    return kind is int and lift_ints and all(type(v) is int and v in LIFTED_INTS for v in values)


def _upload_cpu_tensor(t: torch.Tensor) -> LazyTensor:
    """A 0-dim CPU tensor may join a device op, as in PyTorch; any other CPU tensor only under
    the ``torch_xla`` face, where PyTorch/XLA uploads it silently (here with a warning: it is a
    host-to-device copy at every step)."""
    if t.device.type != "cpu" or (t.dim() != 0 and not config.FACE.on):
        raise DeviceMismatchError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{DEVICE} and {t.device}! (a {tuple(t.shape)} {t.dtype} tensor on {t.device})"
        )
    if t.dim() != 0:
        warnings.warn(
            f"a {tuple(t.shape)} {t.dtype} CPU tensor joined an op on {DEVICE}: it is uploaded "
            "each time, as PyTorch/XLA does; move it to the device once instead",
            stacklevel=user_stacklevel(),
        )
    return wrap_data(to_device_array(t), Aval(tuple(t.shape), t.dtype), device=None)


def _infer(func, args: tuple, kwargs: dict) -> tuple:
    """Output avals and structure from PyTorch's meta kernel; validates dtypes once per signature."""
    counters.bump("MetaInference")
    check = BEFORE_META.get(func)
    if check is not None:
        check(args)
    try:
        out = func(*_to_meta(args), **_to_meta(kwargs))
    except (
        NotImplementedError,
        torch._subclasses.fake_tensor.DynamicOutputShapeException,
        torch._subclasses.fake_tensor.DataDependentOutputException,
    ) as error:
        raise NoStaticShape(f"{func}: {error}") from None
    except IndexError as error:
        raise IndexCheckError(f"{func}: {error}") from None
    check = AFTER_META.get(func)
    if check is not None:
        check(args)
    if isinstance(out, torch.Tensor):
        structure, tensors = None, [out]
    elif isinstance(out, (tuple, list)) and any(type(o) is list for o in out):
        # lists of tensors (fused optimizer steps, the scaler's check): each list's length
        structure = (NESTED, tuple(len(o) if type(o) is list else TENSOR for o in out))
        tensors = [t for o in out for t in (o if type(o) is list else [o])]
    elif isinstance(out, (tuple, list)):  # non-tensor results (SymInts from shapes) kept
        structure = (type(out), tuple(TENSOR if isinstance(o, torch.Tensor) else o for o in out))
        tensors = [o for o in out if isinstance(o, torch.Tensor)]
    else:
        raise NotImplementedError(f"{func} returned {type(out).__name__}, not tensors")
    avals = tuple(Aval(tuple(t.shape), t.dtype) for t in tensors)
    for aval in avals:
        to_jax_dtype(aval.dtype, func)
    return avals, structure


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):  # LazyTensors and 0-dim CPU tensors alike
        return torch.empty(x.shape, dtype=x.dtype, device=_META_DEVICE)
    if type(x) is Value:
        return torch.empty(x.aval.shape, dtype=x.aval.dtype, device=_META_DEVICE)
    if type(x) is Lifted:
        return x.value
    if isinstance(x, torch.device):
        return _META_DEVICE if x.type == DEVICE.type else x
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def emit_value(func, *args: Any, **kwargs: Any) -> Value:
    """Record a single-output op on graph values; the engine's own building block."""
    node, _ = emit(func, args, kwargs)
    return Value((node, 0))
