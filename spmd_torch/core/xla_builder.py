"""torch_xla.core.xla_builder: XLA computations built op by op in Python, run on xla tensors.

PyTorch/XLA wraps the C++ ``XlaBuilder``: each ``Op`` method appends an HLO instruction and
``build`` freezes the graph into an ``XlaComputation``. Here a builder records the same ops
(their names, operands and attributes, with the output shape of each checked when it is made)
as a small graph of :class:`XlaOp` nodes, and each op means the ``jax.lax`` function of XLA's
operation semantics (their table, ``_lazy/lowering/xla_ops.py``, sits beside the aten lowerings).
A built :class:`Computation` is a pure function of JAX arrays; called on xla tensors
(``xla_op_registry.Op``, :func:`xla_computation_as_func`) it becomes one node of the lazy graph,
lowered inside the step's program like any aten op, and cached by its structure (an identical
computation built again reuses the compiled program). :func:`call_jax` records a JAX function on
xla tensors the same way. :func:`create_placeholder_tensor` makes a tensor of a shape and dtype
with no data, to trace a function on and stage out its HLO.

What differs from PyTorch/XLA: shapes are static (``DynamicReshape``, ``SetDimensionSize`` raise
NotImplementedError); ``Sort`` takes the ascending ``Lt(p0, p1)`` comparator, ``Scatter`` a
combiner that adds, multiplies, takes the max or min, or replaces; ``SelectAndScatter`` has no
JAX counterpart; a computation read from an HLO module proto (``computation_from_module_proto``)
is printed, not run; results carry no autograd history, as in PyTorch/XLA.
"""

from __future__ import annotations

import abc
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree

from spmd_torch._lazy import engine
from spmd_torch._lazy.execute import sync
from spmd_torch._lazy.graph import Arg, Aval
from spmd_torch._lazy.graph import Node as _GraphNode
from spmd_torch._lazy.lowering import LOWERINGS, EngineOp, lowers
from spmd_torch._lazy.lowering.dtypes import to_jax_dtype, to_torch_dtype
from spmd_torch._lazy.lowering.xla_ops import JAX_DTYPES, OPS, jax_dtype
from spmd_torch._lazy.tensor import LazyTensor, on_xla, wrap, wrap_data
from spmd_torch._lazy.transfer import Placeholder
from spmd_torch.debug import hlo_proto
from spmd_torch.debug.graph import hlo_text, module_text

__all__ = [
    "Builder",
    "CompiledCallableWithCache",
    "Computation",
    "FlattenedInputFunc",
    "Op",
    "Shape",
    "Type",
    "XlaCallable",
    "XlaOp",
    "call_jax",
    "create_builder",
    "create_computation",
    "create_placeholder_tensor",
    "get_computation_hlo",
    "mkleaf",
    "mkop",
    "mkparam",
    "mkshape",
    "tensor_shape",
    "xla_computation_as_func",
]


class Type:
    """XLA's element type names, as shapes spell them."""

    F32 = "f32"
    F64 = "f64"
    BF16 = "bf16"
    F16 = "f16"
    U8 = "u8"
    S8 = "s8"
    U16 = "u16"
    S16 = "s16"
    U32 = "u32"
    S32 = "s32"
    U64 = "u64"
    S64 = "s64"
    C64 = "c64"
    C128 = "c128"
    PRED = "pred"


_XLA_PT_TYPE_MAP = {
    Type.F32: torch.float32,
    Type.F64: torch.float64,
    Type.BF16: torch.bfloat16,
    Type.F16: torch.float16,
    Type.U8: torch.uint8,
    Type.S8: torch.int8,
    Type.U16: torch.uint16,
    Type.S16: torch.int16,
    Type.U32: torch.uint32,
    Type.S32: torch.int32,
    Type.U64: torch.uint64,
    Type.S64: torch.int64,
    Type.C64: torch.complex64,
    Type.C128: torch.complex128,
    Type.PRED: torch.bool,
}
_PT_XLA_TYPE_MAP = {pt: xla for xla, pt in _XLA_PT_TYPE_MAP.items()}
_JAX_XLA_TYPE_MAP = {jax_type: xla for xla, jax_type in JAX_DTYPES.items()}


def _xla_type(dtype: Any) -> str:
    try:
        return _JAX_XLA_TYPE_MAP[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"JAX dtype {dtype} has no XLA element type name here") from None


def _to_pyshape(aval: Any) -> Any:
    """An abstract value (or a tuple of them) as PyTorch/XLA's Python shape: a dict
    ``{'type': 'f32', 'sizes': (2, 3)}``, or a tuple of such for a tuple shape."""
    if isinstance(aval, (tuple, list)):
        return tuple(_to_pyshape(a) for a in aval)
    return {"type": _xla_type(aval.dtype), "sizes": tuple(aval.shape)}


def _to_aval(pyshape: Any) -> Any:
    if isinstance(pyshape, Shape):
        pyshape = pyshape.shape
    if isinstance(pyshape, (tuple, list)):
        return tuple(_to_aval(s) for s in pyshape)
    if pyshape.get("dynamic_dimensions") and any(pyshape["dynamic_dimensions"]):
        raise NotImplementedError(f"dynamic dimensions are not supported: shape {pyshape}")
    return jax.ShapeDtypeStruct(tuple(pyshape["sizes"]), jax_dtype(pyshape["type"]))


class Shape:
    """An XLA shape: an element type and sizes, or a tuple of shapes.

    Wraps PyTorch/XLA's Python form of a shape, ``{'type': 'f32', 'sizes': (2, 3)}`` (a tuple of
    such for a tuple shape).

    Args:
        shape: The dict, or a tuple of dicts.

    Example:
        >>> s = Shape.create(Type.F32, (2, 3))
        >>> s.dtype, s.sizes, s.rank
        ('f32', (2, 3), 2)
    """

    def __init__(self, shape: Any):
        self._shape = shape

    @classmethod
    def create(cls, dtype: str, sizes: Sequence[int], dynamic_dimensions=None) -> Shape:
        """A shape of element type ``dtype`` (a :class:`Type` name) and ``sizes``."""
        if dynamic_dimensions is None:
            return Shape({"type": str(dtype), "sizes": tuple(sizes)})
        return Shape(
            {
                "type": str(dtype),
                "sizes": tuple(sizes),
                "dynamic_dimensions": tuple(dynamic_dimensions),
            }
        )

    @property
    def shape(self) -> Any:
        """The Python form: a dict, or a tuple of dicts."""
        return self._shape

    def is_tuple(self) -> bool:
        return isinstance(self._shape, (list, tuple))

    def tuple_size(self) -> int:
        self._require_tuple("tuple_size")
        return len(self._shape)

    def tuple_shape(self, index: int) -> Any:
        """The Python form of element ``index`` of a tuple shape."""
        self._require_tuple("tuple_shape")
        return self._shape[index]

    def is_dynamic(self) -> bool:
        self._require_array("is_dynamic")
        return "dynamic_dimensions" in self._shape

    def as_scalar(self) -> Shape:
        """The rank-0 shape of the same element type."""
        return Shape.create(self.dtype, ())

    @property
    def rank(self) -> int:
        self._require_array("rank")
        return len(self._shape["sizes"])

    @property
    def sizes(self) -> tuple:
        self._require_array("sizes")
        return self._shape["sizes"]

    @property
    def dynamic_dimensions(self) -> tuple | None:
        self._require_array("dynamic_dimensions")
        return self._shape.get("dynamic_dimensions", None)

    @property
    def dtype(self) -> str:
        self._require_array("dtype")
        return self._shape["type"]

    def _require_tuple(self, what: str) -> None:
        if not self.is_tuple():
            raise ValueError(f"Shape.{what}: {self._shape} is not a tuple shape")

    def _require_array(self, what: str) -> None:
        if self.is_tuple():
            raise ValueError(f"Shape.{what}: {self._shape} is a tuple shape")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and self._shape == other._shape

    def __hash__(self) -> int:
        return hash(_freeze(self._shape))

    def __repr__(self) -> str:
        return f"Shape({self._shape!r})"


class Builder:
    """Collects the ops of one computation; ``create_builder(name)`` makes one.

    Example:
        >>> b = create_builder('add')
        >>> x = mkparam(b, 0, Shape.create(Type.F32, (2,)))
        >>> computation = (x + x).build('add')
    """

    def __init__(self, name: str):
        self.name = name
        self.params: dict[int, XlaOp] = {}

    def __repr__(self) -> str:
        return f"Builder({self.name!r})"


class XlaOp:
    """One recorded operation: its kind (XLA's op name), operands, attributes and the abstract
    value it produces (``jax.ShapeDtypeStruct``, or a tuple of them). What ``Op.op`` holds."""

    __slots__ = ("aval", "builder", "kind", "operands", "params")

    def __init__(self, builder: Builder, kind: str, operands: tuple, params: dict, aval: Any):
        self.builder = builder
        self.kind = kind
        self.operands = operands
        self.params = params
        self.aval = aval

    def __repr__(self) -> str:
        return f"XlaOp({self.kind}, {_to_pyshape(self.aval)})"


class Computation:
    """A built computation: parameters, ops and a root, as one pure function of JAX arrays.

    Not callable on purpose (``Op.make_computation`` passes built computations through and
    builds callables); call it on xla tensors with :func:`xla_computation_as_func` or through
    ``xla_op_registry``. Two computations with the same parameters, ops, attributes and root
    are equal, so the programs they enter compile once.

    Example:
        >>> comp = create_computation('double', lambda x: x + x, [Shape.create(Type.F32, (3,))])
        >>> comp.result_shape.sizes
        (3,)
    """

    def __init__(self, name: str, builder: Builder, root: XlaOp):
        self.name = name
        self.root = root
        count = max(builder.params, default=-1) + 1
        missing = [k for k in range(count) if k not in builder.params]
        if missing:
            raise ValueError(f"computation {name!r}: parameters {missing} were never created")
        self.params = [builder.params[k] for k in range(count)]
        self.order = _topological(root, builder, name)
        self.param_shapes = [Shape(_to_pyshape(p.aval)) for p in self.params]
        self.result_shape = Shape(_to_pyshape(root.aval))
        position = {id(node): i for i, node in enumerate(self.order)}
        rows = tuple(
            (
                node.kind,
                tuple(position[id(o)] for o in node.operands),
                _freeze(node.params),
                _freeze(_to_pyshape(node.aval)),
            )
            for node in self.order
        )
        self._key = (rows, position[id(root)], tuple(position.get(id(p), -1) for p in self.params))
        self._hash = hash(self._key)

    def apply(self, *args: Any) -> Any:
        """Evaluate on JAX values (arrays or tracers; tuples for tuple-shaped parameters)."""
        if len(args) != len(self.params):
            raise TypeError(
                f"computation {self.name!r} takes {len(self.params)} parameters, got {len(args)}"
            )
        values: dict[int, Any] = {id(p): a for p, a in zip(self.params, args)}
        for node in self.order:
            if node.kind == "Parameter":
                continue
            operands = [values[id(o)] for o in node.operands]
            values[id(node)] = OPS[node.kind].impl(*operands, **node.params)
        return values[id(self.root)]

    def lower(self, inputs: tuple) -> list:
        """As a graph node: the outputs on the inputs' arrays, cast first to the parameters'
        element types where the device holds another (``XLA_USE_BF16``)."""
        values = [
            x if x.dtype == p.aval.dtype else x.astype(p.aval.dtype)
            for x, p in zip(inputs, self.params)
        ]
        out = self.apply(*values)
        return list(out) if isinstance(out, tuple) else [out]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Computation) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        params = ", ".join(_shape_text(s.shape) for s in self.param_shapes)
        return f"Computation({self.name!r}, ({params}) -> {_shape_text(self.result_shape.shape)})"


def _shape_text(pyshape: Any) -> str:
    if isinstance(pyshape, (tuple, list)):
        return "(" + ", ".join(_shape_text(s) for s in pyshape) + ")"
    return f"{pyshape['type']}[{','.join(str(d) for d in pyshape['sizes'])}]"


def _topological(root: XlaOp, builder: Builder, name: str) -> list[XlaOp]:
    """The ops ``root`` depends on, operands first (iterative: graphs may be deep)."""
    order: list[XlaOp] = []
    done: set[int] = set()
    stack: list[tuple[XlaOp, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in done:
            continue
        if node.builder is not builder:
            raise ValueError(
                f"computation {name!r}: op {node.kind} belongs to {node.builder!r}, not "
                f"{builder!r} (a computation may only use its own builder's ops)"
            )
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((o, False) for o in reversed(node.operands) if id(o) not in done)
    return order


def _freeze(value: Any) -> Any:
    """A hashable stand-in for an op attribute (structural keys of computations)."""
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Shape):
        return _freeze(value.shape)
    if isinstance(value, np.dtype):
        return str(value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _create(builder: Builder, kind: str, operands: Sequence[XlaOp], params: dict) -> XlaOp:
    """Record one op; its output shape is computed (and its operands checked) here, as XLA's
    builder does."""
    definition = OPS.get(kind)
    if definition is None:
        raise ValueError(f"Unknown XLA op name: {kind!r}")
    if definition.prepare is not None:
        params = definition.prepare(params)
    operands = tuple(operands)
    for k, operand in enumerate(operands):
        if not isinstance(operand, XlaOp):
            raise TypeError(f"{kind}: operand {k} is a {type(operand).__name__}, not an XlaOp")
        if operand.builder is not builder:
            raise ValueError(f"{kind}: operand {k} belongs to {operand.builder!r}, not {builder!r}")
    impl = functools.partial(definition.impl, **params)
    try:
        aval = jax.eval_shape(impl, *[o.aval for o in operands])
    except NotImplementedError:
        raise
    except Exception as error:
        shapes = ", ".join(_shape_text(_to_pyshape(o.aval)) for o in operands)
        raise RuntimeError(f"XLA op {kind}({shapes}): {error}") from error
    return XlaOp(builder, kind, operands, params, aval)


def _attributes(arguments: dict, *operands: str) -> dict:
    """A builder method's arguments (its ``locals()``) less ``self`` and its operands: the op's
    attributes, by name."""
    return {k: v for k, v in arguments.items() if k not in ("self", *operands)}


# --- the Python builder API ------------------------------------------------------------------


class Op:
    """An operation of a computation being built, with XLA's operation semantics as methods.

    Python operators build element-wise ops (``a + b``, ``a < b``); methods build the rest
    (``reshape``, ``dot`` via ``@``, ``conditional``, ``while_loop``...), following
    https://openxla.org/xla/operation_semantics.

    Args:
        op: The recorded :class:`XlaOp`.

    Example:
        >>> b = create_builder('axpy')
        >>> x = mkparam(b, 0, Shape.create(Type.F32, (4,)))
        >>> y = mkparam(b, 1, Shape.create(Type.F32, (4,)))
        >>> two = Op.scalar(b, 2.0, dtype=Type.F32)
        >>> comp = (two.broadcast((4,)) * x + y).build('axpy')
    """

    def __init__(self, op: XlaOp):
        self.op = op

    def shape(self) -> Shape:
        return Shape(_to_pyshape(self.op.aval))

    def builder(self) -> Builder:
        return self.op.builder

    def build(self, name: str) -> Computation:
        """The computation of this op's builder whose root is this op."""
        return Computation(name, self.op.builder, self.op)

    def __add__(self, rhs: Op) -> Op:
        return mkop("Add", (self.op, rhs.op))

    def __sub__(self, rhs: Op) -> Op:
        return mkop("Sub", (self.op, rhs.op))

    def __mul__(self, rhs: Op) -> Op:
        return mkop("Mul", (self.op, rhs.op))

    def __matmul__(self, rhs: Op) -> Op:
        return mkop("Dot", (self.op, rhs.op))

    def __truediv__(self, rhs: Op) -> Op:
        return mkop("Div", (self.op, rhs.op))

    def __pow__(self, rhs: Op) -> Op:
        return mkop("Pow", (self.op, rhs.op))

    def __mod__(self, rhs: Op) -> Op:
        return mkop("Rem", (self.op, rhs.op))

    def __neg__(self) -> Op:
        return mkop("Neg", (self.op,))

    def __not__(self) -> Op:
        return mkop("Not", (self.op,))

    def __invert__(self) -> Op:
        return mkop("Not", (self.op,))

    def __and__(self, rhs: Op) -> Op:
        return mkop("And", (self.op, rhs.op))

    def __or__(self, rhs: Op) -> Op:
        return mkop("Or", (self.op, rhs.op))

    def __xor__(self, rhs: Op) -> Op:
        return mkop("Xor", (self.op, rhs.op))

    def __eq__(self, rhs: Op) -> Op:  # type: ignore[override]
        return mkop("Eq", (self.op, rhs.op))

    def __ne__(self, rhs: Op) -> Op:  # type: ignore[override]
        return mkop("Ne", (self.op, rhs.op))

    def __le__(self, rhs: Op) -> Op:
        return mkop("Le", (self.op, rhs.op))

    def __lt__(self, rhs: Op) -> Op:
        return mkop("Lt", (self.op, rhs.op))

    def __ge__(self, rhs: Op) -> Op:
        return mkop("Ge", (self.op, rhs.op))

    def __gt__(self, rhs: Op) -> Op:
        return mkop("Gt", (self.op, rhs.op))

    def __lshift__(self, rhs: Op) -> Op:
        return mkop("ShiftLeft", (self.op, rhs.op))

    def __rshift__(self, rhs: Op) -> Op:
        return mkop("ShiftRight", (self.op, rhs.op))

    __hash__ = None  # type: ignore[assignment]  # == builds an op

    def reshape(self, sizes, dimensions=None, inferred_dimension=None) -> Op:
        return mkop(
            "Reshape",
            (self.op,),
            sizes=sizes,
            dimensions=dimensions,
            inferred_dimension=inferred_dimension,
        )

    def dynamic_reshape(self, sizes) -> Op:
        return mkop("DynamicReshape", (self.op,), sizes=sizes)

    def broadcast(self, sizes) -> Op:
        return mkop("Broadcast", (self.op,), sizes=sizes)

    def broadcast_in_dim(self, sizes, dimensions) -> Op:
        return mkop("BroadcastInDim", (self.op,), sizes=sizes, dimensions=dimensions)

    def slice(self, start_indices, limit_indices, strides=None) -> Op:
        if strides is None:
            strides = [1] * len(start_indices)
        return mkop(
            "Slice",
            (self.op,),
            start_indices=start_indices,
            limit_indices=limit_indices,
            strides=strides,
        )

    def slice_in_dim(self, start_index, limit_index, dimno, stride=1) -> Op:
        return mkop(
            "SliceInDim",
            (self.op,),
            start_index=start_index,
            limit_index=limit_index,
            dimno=dimno,
            stride=stride,
        )

    def dynamic_slice(self, start_indices, slice_sizes) -> Op:
        operands = (self.op, *Op._extract_xla_ops(start_indices))
        return mkop("DynamicSlice", operands, slice_sizes=slice_sizes)

    def dynamic_update_slice(self, update, start_indices) -> Op:
        operands = (self.op, update.op, *Op._extract_xla_ops(start_indices))
        return mkop("DynamicUpdateSlice", operands)

    def gather(
        self,
        start_indices,
        offset_dims,
        collapsed_slice_dims,
        start_index_map,
        index_vector_dim,
        indices_are_sorted=None,
        slice_sizes=None,
    ) -> Op:
        """XLA's Gather; ``slice_sizes`` (one per operand dimension) is required, as XLA's
        builder requires it (PyTorch/XLA's method has no parameter for it)."""
        if slice_sizes is None:
            raise ValueError("gather: slice_sizes (one size per operand dimension) is required")
        return mkop(
            "Gather",
            (self.op, start_indices.op),
            offset_dims=offset_dims,
            collapsed_slice_dims=collapsed_slice_dims,
            start_index_map=start_index_map,
            index_vector_dim=index_vector_dim,
            slice_sizes=slice_sizes,
            indices_are_sorted=indices_are_sorted,
        )

    def scatter(
        self,
        scatter_indices,
        updates,
        computation,
        update_window_dims,
        inserted_window_dims,
        scatter_dims_to_operand_dims,
        index_vector_dim,
        indices_are_sorted=None,
        unique_indices=None,
    ) -> Op:
        scalar = self.shape().as_scalar()
        computation = Op.make_computation("Scatter", computation, (scalar, scalar))
        return mkop(
            "Scatter",
            (self.op, scatter_indices.op, updates.op),
            computation=computation,
            update_window_dims=update_window_dims,
            inserted_window_dims=inserted_window_dims,
            scatter_dims_to_operand_dims=scatter_dims_to_operand_dims,
            index_vector_dim=index_vector_dim,
            indices_are_sorted=indices_are_sorted,
            unique_indices=unique_indices,
        )

    def conv(
        self,
        kernel,
        window_strides,
        feature_group_count=1,
        batch_group_count=1,
        padding="valid",
        precision_config=None,
    ) -> Op:
        return mkop("Conv", (self.op, kernel.op), **_attributes(locals(), "kernel"))

    def conv_with_general_padding(
        self,
        kernel,
        window_strides,
        padding,
        feature_group_count=1,
        batch_group_count=1,
        precision_config=None,
    ) -> Op:
        return mkop(
            "ConvWithGeneralPadding", (self.op, kernel.op), **_attributes(locals(), "kernel")
        )

    def conv_with_general_dimensions(
        self,
        kernel,
        window_strides,
        input_batch_dimension,
        input_feature_dimension,
        kernel_input_feature_dimension,
        kernel_output_feature_dimension,
        output_batch_dimension,
        output_feature_dimension,
        input_spatial_dimensions,
        kernel_spatial_dimensions,
        output_spatial_dimensions,
        padding="valid",
        feature_group_count=1,
        batch_group_count=1,
        precision_config=None,
    ) -> Op:
        return mkop(
            "ConvWithGeneralDimensions", (self.op, kernel.op), **_attributes(locals(), "kernel")
        )

    def conv_general(
        self,
        kernel,
        window_strides,
        padding,
        input_batch_dimension,
        input_feature_dimension,
        kernel_input_feature_dimension,
        kernel_output_feature_dimension,
        output_batch_dimension,
        output_feature_dimension,
        input_spatial_dimensions,
        kernel_spatial_dimensions,
        output_spatial_dimensions,
        feature_group_count=1,
        batch_group_count=1,
        precision_config=None,
    ) -> Op:
        return mkop("ConvGeneral", (self.op, kernel.op), **_attributes(locals(), "kernel"))

    def conv_general_dilated(
        self,
        kernel,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        input_batch_dimension,
        input_feature_dimension,
        kernel_input_feature_dimension,
        kernel_output_feature_dimension,
        output_batch_dimension,
        output_feature_dimension,
        input_spatial_dimensions,
        kernel_spatial_dimensions,
        output_spatial_dimensions,
        feature_group_count=1,
        batch_group_count=1,
        precision_config=None,
    ) -> Op:
        return mkop("ConvGeneralDilated", (self.op, kernel.op), **_attributes(locals(), "kernel"))

    def cast(self, to_type: str) -> Op:
        return mkop("Convert", (self.op,), to_type=to_type)

    def bitcast(self, to_type: str) -> Op:
        return mkop("BitcastConvert", (self.op,), to_type=to_type)

    def pad(self, value, config) -> Op:
        return mkop("Pad", (self.op, value.op), config=config)

    def select_and_scatter(
        self,
        source,
        init_value,
        window_dimensions,
        window_strides,
        select_computation,
        scatter_computation,
        padding="valid",
    ) -> Op:
        return mkop(
            "SelectAndScatter",
            (self.op, source.op, init_value.op),
            window_dimensions=window_dimensions,
            window_strides=window_strides,
            select_computation=select_computation,
            scatter_computation=scatter_computation,
            padding=padding,
        )

    def select_and_scatter_with_general_padding(
        self,
        source,
        init_value,
        window_dimensions,
        window_strides,
        select_computation,
        scatter_computation,
        padding,
    ) -> Op:
        return mkop(
            "SelectAndScatterWithGeneralPadding",
            (self.op, source.op, init_value.op),
            window_dimensions=window_dimensions,
            window_strides=window_strides,
            select_computation=select_computation,
            scatter_computation=scatter_computation,
            padding=padding,
        )

    def max_pool(
        self,
        kernel_size,
        stride,
        batch_dimension,
        feature_dimension,
        spatial_dimensions,
        padding="valid",
    ) -> Op:
        return mkop(
            "MaxPool",
            (self.op,),
            kernel_size=kernel_size,
            stride=stride,
            batch_dimension=batch_dimension,
            feature_dimension=feature_dimension,
            spatial_dimensions=spatial_dimensions,
            padding=padding,
        )

    def reduce(self, init_value, computation, dimensions) -> Op:
        scalar = self.shape().as_scalar()
        computation = Op.make_computation("Reduce", computation, (scalar, scalar))
        return mkop(
            "Reduce", (self.op, init_value.op), computation=computation, dimensions=dimensions
        )

    def reduce_all(self, init_value, computation) -> Op:
        scalar = self.shape().as_scalar()
        computation = Op.make_computation("ReduceAll", computation, (scalar, scalar))
        return mkop("ReduceAll", (self.op, init_value.op), computation=computation)

    def reduce_window(
        self, init_value, computation, window_dimensions, window_strides, padding="valid"
    ) -> Op:
        scalar = self.shape().as_scalar()
        computation = Op.make_computation("ReduceWindow", computation, (scalar, scalar))
        return mkop(
            "ReduceWindow",
            (self.op, init_value.op),
            computation=computation,
            window_dimensions=window_dimensions,
            window_strides=window_strides,
            padding=padding,
        )

    def select(self, true_value, false_value) -> Op:
        return mkop("Select", (self.op, true_value.op, false_value.op))

    def transpose(self, permutation) -> Op:
        return mkop("Transpose", (self.op,), permutation=permutation)

    def triangualr_solve(
        self, b, left_side=None, lower=None, unit_diagonal=None, transpose_a=None
    ) -> Op:
        """XLA's TriangularSolve of ``self`` (the triangular ``a``) and ``b``; the name keeps
        PyTorch/XLA's spelling (:meth:`triangular_solve` is the same)."""
        return mkop(
            "TriangularSolve",
            (self.op, b.op),
            left_side=left_side,
            lower=lower,
            unit_diagonal=unit_diagonal,
            transpose_a=transpose_a,
        )

    triangular_solve = triangualr_solve

    def clamp(self, min_value, max_value) -> Op:
        return mkop("Clamp", (self.op, min_value.op, max_value.op))

    def get_tuple_element(self, index: int) -> Op:
        return mkop("GetTupleElement", (self.op,), index=index)

    def conditional(self, true_operand, false_operand, true_computation, false_computation) -> Op:
        true_computation = Op.make_computation("CondTrue", true_computation, (true_operand,))
        false_computation = Op.make_computation("CondFalse", false_computation, (false_operand,))
        return mkop(
            "Conditional",
            (self.op, true_operand.op, false_operand.op),
            true_computation=true_computation,
            false_computation=false_computation,
        )

    @classmethod
    def wrap_function(cls, fn: Callable) -> Callable:
        """``fn`` taking a tuple parameter's elements as separate arguments, and returning a
        tuple op for a returned list or tuple."""

        def wrapper(*args, **kwargs):
            if len(args) == 1:
                shape = args[0].shape()
                if shape.is_tuple():
                    args = [args[0].get_tuple_element(i) for i in range(shape.tuple_size())]
            result = fn(*args, **kwargs)
            return Op.tuple(result) if isinstance(result, (tuple, list)) else result

        return wrapper

    @classmethod
    def make_computation(cls, name, computation, args_or_shapes, **kwargs) -> Computation:
        """A built computation passes through; a callable is built over parameters of the
        given shapes (or the shapes of the given ops)."""
        if not callable(computation):
            return computation
        shapes = [a if isinstance(a, Shape) else a.shape() for a in args_or_shapes]
        return create_computation(name, Op.wrap_function(computation), shapes, **kwargs)

    def mkconditional(self, ops, true_fn, false_fn, **kwargs) -> Op:
        """``true_fn(*ops)`` if this pred is true, else ``false_fn(*ops)``."""
        operands = Op.tuple(ops)
        return self.conditional(operands, operands, true_fn, false_fn)

    def while_loop(self, condition_computation, body_computation) -> Op:
        condition_computation = Op.make_computation("Condition", condition_computation, (self,))
        body_computation = Op.make_computation("Body", body_computation, (self,))
        return mkop(
            "While",
            (self.op,),
            condition_computation=condition_computation,
            body_computation=body_computation,
        )

    @classmethod
    def mkwhile(cls, ops, condition_fn, body_fn, **kwargs) -> Op:
        """Loop ``ops = body_fn(*ops)`` while ``condition_fn(*ops)``; the result is the tuple."""
        return Op.tuple(ops).while_loop(
            condition_computation=condition_fn, body_computation=body_fn
        )

    def get_dimension_size(self, dimension: int) -> Op:
        return mkop("GetDimensionSize", (self.op,), dimension=dimension)

    def set_dimension_size(self, size, dimension: int) -> Op:
        return mkop("SetDimensionSize", (self.op, size.op), dimension=dimension)

    def rev(self, dimensions) -> Op:
        return mkop("Rev", (self.op,), dimensions=dimensions)

    def acos(self) -> Op:
        return mkop("Acos", (self.op,))

    def asin(self) -> Op:
        return mkop("Asin", (self.op,))

    def atan(self) -> Op:
        return mkop("Atan", (self.op,))

    def ceil(self) -> Op:
        return mkop("Ceil", (self.op,))

    def cos(self) -> Op:
        return mkop("Cos", (self.op,))

    def cosh(self) -> Op:
        return mkop("Cosh", (self.op,))

    def erf(self) -> Op:
        return mkop("Erf", (self.op,))

    def erfc(self) -> Op:
        return mkop("Erfc", (self.op,))

    def erfinf(self) -> Op:
        return mkop("ErfInv", (self.op,))

    def exp(self) -> Op:
        return mkop("Exp", (self.op,))

    def expm1(self) -> Op:
        return mkop("Expm1", (self.op,))

    def floor(self) -> Op:
        return mkop("Floor", (self.op,))

    def log(self) -> Op:
        return mkop("Log", (self.op,))

    def log1p(self) -> Op:
        return mkop("Log1p", (self.op,))

    def sqrt(self) -> Op:
        return mkop("Sqrt", (self.op,))

    def real(self) -> Op:
        return mkop("Real", (self.op,))

    def imag(self) -> Op:
        return mkop("Imag", (self.op,))

    def clz(self) -> Op:
        return mkop("Clz", (self.op,))

    def conj(self) -> Op:
        return mkop("Conj", (self.op,))

    def rsqrt(self) -> Op:
        return mkop("Rsqrt", (self.op,))

    def sin(self) -> Op:
        return mkop("Sin", (self.op,))

    def sinh(self) -> Op:
        return mkop("Sinh", (self.op,))

    def tan(self) -> Op:
        return mkop("Tan", (self.op,))

    def tanh(self) -> Op:
        return mkop("Tanh", (self.op,))

    def atan2(self, other) -> Op:
        return mkop("Atan2", (self.op, other.op))

    def max(self, other) -> Op:
        return mkop("Max", (self.op, other.op))

    def min(self, other) -> Op:
        return mkop("Min", (self.op, other.op))

    def scalar_like(self, value) -> Op:
        """``value`` broadcast to this op's shape and element type."""
        shape = self.shape()
        return Op.scalar(self.builder(), value, dtype=shape.dtype).broadcast(shape.sizes)

    def zeros_like(self) -> Op:
        return self.scalar_like(0)

    def ones_like(self) -> Op:
        return self.scalar_like(1)

    @classmethod
    def _extract_xla_ops(cls, ops) -> list[XlaOp]:
        return [x.op for x in ops]

    @classmethod
    def tuple(cls, ops, builder=None) -> Op:
        return mkop("Tuple", Op._extract_xla_ops(ops), builder=builder)

    @classmethod
    def concat_in_dim(cls, ops, dimension, builder=None) -> Op:
        return mkop("ConcatInDim", Op._extract_xla_ops(ops), builder=builder, dimension=dimension)

    @classmethod
    def call(cls, computation, ops, builder=None) -> Op:
        computation = Op.make_computation("Call", computation, ops)
        return mkop("Call", Op._extract_xla_ops(ops), computation=computation, builder=builder)

    @classmethod
    def constant(cls, builder, value) -> Op:
        """A constant of ``value``, a tensor (its dtype and shape)."""
        return mkleaf("Constant", builder, value=value)

    @classmethod
    def scalar(cls, builder, value, dtype=None) -> Op:
        """A rank-0 constant of element type ``dtype`` (default f32)."""
        return mkleaf(
            "Constant", builder, value=torch.tensor(value, dtype=cls.to_torch_type(dtype))
        )

    @classmethod
    def zero(cls, builder, dtype=None) -> Op:
        return cls.scalar(builder, 0, dtype=dtype)

    @classmethod
    def one(cls, builder, dtype=None) -> Op:
        return cls.scalar(builder, 1, dtype=dtype)

    @classmethod
    def iota(cls, builder, shape, iota_dimension) -> Op:
        return mkleaf("Iota", builder, shape=shape.shape, iota_dimension=iota_dimension)

    @classmethod
    def sort(cls, ops, comparator, dimension=None, is_stable=None) -> Op:
        return mkop(
            "Sort",
            Op._extract_xla_ops(ops),
            comparator=comparator,
            dimension=dimension,
            is_stable=is_stable,
        )

    @classmethod
    def map(cls, ops, computation, dimensions, static_operands=(), builder=None) -> Op:
        return mkop(
            "Map",
            Op._extract_xla_ops(ops),
            builder=builder,
            computation=computation,
            dimensions=dimensions,
            static_operands=Op._extract_xla_ops(static_operands),
        )

    @classmethod
    def to_torch_type(cls, dtype: str | None) -> torch.dtype:
        """The torch dtype of an XLA element type name (None: float32)."""
        return _XLA_PT_TYPE_MAP[dtype] if dtype else torch.float32

    @classmethod
    def from_torch_type(cls, dtype: torch.dtype) -> str:
        """The XLA element type name of a torch dtype."""
        return _PT_XLA_TYPE_MAP[dtype]


def create_builder(name: str) -> Builder:
    """A new builder, for the ops of one computation.

    Args:
        name: The computation's name.

    Example:
        >>> b = create_builder('my_computation')
    """
    return Builder(name)


def mkshape(dtype: str, sizes: Sequence[int], dynamic_dimensions=None) -> Shape:
    """``Shape.create(dtype, sizes)``.

    Example:
        >>> mkshape(Type.S32, (2, 2)).sizes
        (2, 2)
    """
    return Shape.create(dtype, sizes, dynamic_dimensions=dynamic_dimensions)


def mkop(name: str, ops: Sequence[XlaOp], **kwargs: Any) -> Op:
    """Record the op named ``name`` (XLA's name: ``'Add'``, ``'Reshape'``...) on ``ops``.

    Args:
        name: The op.
        ops: Its operands, :class:`XlaOp` s (``Op.op``) of one builder.
        **kwargs: Its attributes; ``builder`` names the builder when there are no operands.

    Example:
        >>> total = mkop('Add', (x.op, y.op))
    """
    builder = kwargs.pop("builder", None)
    if builder is None:
        if not ops:
            raise ValueError(f"mkop({name!r}): an op without operands needs builder=")
        builder = ops[0].builder
    return Op(_create(builder, name, ops, kwargs))


def mkleaf(name: str, builder: Builder, **kwargs: Any) -> Op:
    """Record an op without operands (``'Constant'``, ``'Iota'``) on ``builder``.

    Example:
        >>> one = mkleaf('Constant', b, value=torch.tensor(1.0))
    """
    return Op(_create(builder, name, (), kwargs))


def mkparam(builder: Builder, param_no: int, shape: Shape) -> Op:
    """Parameter ``param_no`` of ``builder``'s computation, of ``shape``.

    Example:
        >>> x = mkparam(b, 0, mkshape(Type.F32, (3,)))
    """
    if param_no in builder.params:
        raise ValueError(f"{builder!r} already has parameter {param_no}")
    node = XlaOp(builder, "Parameter", (), {"number": param_no}, _to_aval(shape))
    builder.params[param_no] = node
    return Op(node)


def tensor_shape(tensor: torch.Tensor | Sequence[torch.Tensor], device: str = "") -> Any:
    """The XLA shape of a tensor (a list of shapes for a list of tensors).

    Args:
        tensor: A tensor or a list or tuple of tensors.
        device: Ignored (PyTorch/XLA's device-specific layouts do not exist here).

    Example:
        >>> tensor_shape(torch.zeros(2, 3, device='xla')).shape
        {'type': 'f32', 'sizes': (2, 3)}
    """
    if isinstance(tensor, (list, tuple)):
        return [tensor_shape(t) for t in tensor]
    return Shape.create(Op.from_torch_type(tensor.dtype), tuple(tensor.shape))


def create_placeholder_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An xla tensor of ``shape`` and ``dtype`` that holds no data and allocates nothing: a
    function traced on it records a graph whose HLO can be staged out (``_get_xla_tensors_hlo``,
    ``LoweringContext``, where it is a parameter), but reading it, or running a program that
    reads it, raises. ``_XLAC._is_placecholder`` is True for it.

    Example:
        >>> p = create_placeholder_tensor((2, 3), torch.bfloat16)
        >>> hlo = torch_xla._XLAC._get_xla_tensors_hlo([p.sin()])
    """
    aval = Aval(tuple(shape), dtype)
    return wrap_data(
        Placeholder(aval.shape, to_jax_dtype(dtype, "create_placeholder_tensor")), aval
    )


def create_computation(name: str, fn: Callable, shapes: Sequence[Shape], **kwargs: Any):
    """Build ``fn(*params, **kwargs)`` over parameters of ``shapes`` into a computation.

    Args:
        name: The computation's name.
        fn: Takes one :class:`Op` per shape (and ``kwargs``), returns the root op.
        shapes: The parameters' shapes.
        **kwargs: Passed to ``fn``.

    Example:
        >>> comp = create_computation('sum2', lambda a, b: a + b, [mkshape(Type.F32, (2,))] * 2)
    """
    builder = create_builder(name)
    params = [mkparam(builder, k, shape) for k, shape in enumerate(shapes)]
    root = fn(*params, **kwargs)
    if not isinstance(root, Op):
        raise TypeError(f"create_computation({name!r}): fn returned {type(root).__name__}, not Op")
    return root.build(name)


class ModuleComputation:
    """A computation read from a serialized ``HloModuleProto`` (``LoweringContext.hlo()``'s):
    printed by :func:`get_computation_hlo`, never run. Programs here are built from the lazy
    graph and JAX functions, not from HLO; build what should run with :func:`create_computation`
    or :func:`call_jax`."""

    def __init__(self, name: str, proto: bytes):
        module = hlo_proto.parse(proto)
        module.name = name
        self.name = name
        self.proto = module.SerializeToString(deterministic=True)

    def apply(self, *args: Any) -> Any:
        raise NotImplementedError(
            f"computation {self.name!r} was read from an HLO module proto: it can be printed "
            "(get_computation_hlo), not run; build it with create_computation or call_jax"
        )


def computation_from_module_proto(name: str, proto: bytes) -> ModuleComputation:
    """The HLO module ``proto`` (serialized ``HloModuleProto``) as a computation named ``name``.

    Example:
        >>> ctx = torch_xla._XLAC.lowering.LoweringContext()
        >>> ctx.build([y])
        >>> print(get_computation_hlo(computation_from_module_proto('step', ctx.hlo())))
    """
    return ModuleComputation(name, proto)


def get_computation_hlo(computation: Computation | ModuleComputation) -> str:
    """The computation as HLO text, in PyTorch/XLA's print style.

    Example:
        >>> print(get_computation_hlo(comp))
    """
    if isinstance(computation, ModuleComputation):
        from jax._src.lib import xla_client  # jaxlib's HLO module type: no public API

        return module_text(xla_client.XlaComputation(computation.proto))
    avals = [_to_aval(s) for s in computation.param_shapes]
    return hlo_text(jax.jit(computation.apply).lower(*avals))


# --- running computations on xla tensors -----------------------------------------------------

_ENGINE_OPS: dict[str, EngineOp] = {}
_ENGINE_OPS_LOCK = threading.Lock()


def _engine_op(name: str) -> EngineOp:
    """The graph op for calls under ``name`` (one per name: HLO op names and profiles carry
    it); its one static argument, a :class:`Computation` or a JAX call, lowers itself."""
    with _ENGINE_OPS_LOCK:
        op = _ENGINE_OPS.get(name)
        if op is None:
            op = _ENGINE_OPS[name] = EngineOp(name)
            if op not in LOWERINGS:
                lowers(op)(_lower_call)
        return op


def _lower_call(inputs: tuple, callee: Any) -> list:
    return callee.lower(inputs)


def _record(opname: str, tensors: Sequence[LazyTensor], callee: Any, avals: list) -> list:
    """One graph node running ``callee`` on ``tensors``; its outputs, as new xla tensors."""
    args = (tuple(Arg(k) for k in range(len(tensors))), callee)
    node = _GraphNode(_engine_op(opname), tuple(t._ref() for t in tensors), args, {}, tuple(avals))
    out = [wrap((node, k), aval) for k, aval in enumerate(avals)]
    own = engine.current()
    if own.eager and own.eager_depth == 0:
        sync()
    return out


def _user_computation(
    opname: str, tensors: Sequence[torch.Tensor], computation: Computation
) -> list[torch.Tensor]:
    """Record ``computation`` on xla ``tensors`` as one node; its outputs, as new tensors."""
    tensors = list(tensors)
    if len(tensors) != len(computation.params):
        raise ValueError(
            f"{opname}: {computation!r} takes {len(computation.params)} tensors, got {len(tensors)}"
        )
    for k, (t, shape) in enumerate(zip(tensors, computation.param_shapes)):
        on_xla(t, f"{opname} (input {k})", RuntimeError)
        given = tensor_shape(t).shape
        if shape.is_tuple() or given != shape.shape:
            raise ValueError(
                f"{opname}: input {k} is {_shape_text(given)}, the computation's parameter "
                f"{k} is {_shape_text(shape.shape)}"
            )
    result = computation.root.aval
    avals = []
    for aval in result if isinstance(result, tuple) else (result,):
        if isinstance(aval, tuple):
            raise ValueError(f"{opname}: {computation!r} returns a nested tuple")
        avals.append(Aval(tuple(aval.shape), _XLA_PT_TYPE_MAP[_xla_type(aval.dtype)]))
    return _record(opname, tensors, computation, avals)


def xla_computation_as_func(computation: Computation, name: str | None = None) -> Callable:
    """A function of a list of xla tensors running ``computation`` on them.

    Each call records one node of the lazy graph; it returns the computation's outputs as a
    list of new xla tensors (one per element of a tuple root).

    Args:
        computation: A built computation.
        name: The op's name in the graph and in HLO op names (``xla::`` prefixed if bare).

    Example:
        >>> fn = xla_computation_as_func(comp, 'sum2')
        >>> (total,) = fn([a, b])
    """
    name = name or "xla::computation"
    if "::" not in name:
        name = "xla::" + name

    def fn(input_tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return _user_computation(name, input_tensors, computation)

    return fn


# --- Python functions of flattened tensors ---------------------------------------------------


class FlattenedInputFunc:
    """A function of any pytree of arguments, called with its tensors as one flat tuple.

    ``preprocess(args, kwargs)`` splits the arguments into their tensors (returned) and the
    rest (kept, with the tree's structure); ``flat_call(tensors)`` puts them back together,
    calls the function and flattens its result; ``postprocess(flat)`` rebuilds the result's
    tree. So ``postprocess(flat_call(preprocess(args)))`` is ``func(*args)``.

    Args:
        orig_func: The function.

    Example:
        >>> flat = FlattenedInputFunc(lambda d, k: d['x'] * k)
        >>> tensors = flat.preprocess(({'x': torch.ones(2)}, 3))
        >>> flat.postprocess(flat.flat_call(tensors))
        tensor([3., 3.])
    """

    def __init__(self, orig_func: Callable):
        self.orig_func = orig_func
        self.non_tensors: tuple | None = None
        self.in_spec = None
        self.out_spec = None
        self._sentinel = object()  # marks where the tensors sit among the flattened leaves

    def preprocess(self, args: tuple, kwargs: dict | None = None) -> tuple:
        """The tensors among ``args`` and ``kwargs``, in flattening order."""
        leaves, self.in_spec = self.flatten((args, kwargs or {}))
        self.non_tensors = tuple(
            self._sentinel if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
        )
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    def flat_call(self, flat_input: Sequence[Any]) -> list:
        """Call the function with ``flat_input`` where the last preprocessed call had tensors;
        its result, flattened."""
        if self.in_spec is None:
            raise RuntimeError("FlattenedInputFunc.flat_call: call preprocess first")
        inputs = iter(flat_input)
        leaves = [next(inputs) if v is self._sentinel else v for v in self.non_tensors]
        args, kwargs = self.unflatten(leaves, self.in_spec)
        flat, self.out_spec = self.flatten(self.orig_func(*args, **kwargs))
        return flat

    def postprocess(self, res_flattened: Sequence[Any]) -> Any:
        """The result's tree around ``res_flattened``."""
        if self.out_spec is None:
            raise RuntimeError("FlattenedInputFunc.postprocess: call flat_call first")
        return self.unflatten(list(res_flattened), self.out_spec)

    def flatten(self, inputs: Any) -> tuple:
        return pytree.tree_flatten(inputs)

    def unflatten(self, flattened: list, spec: Any) -> Any:
        return pytree.tree_unflatten(flattened, spec)


class CompiledCallableWithCache(abc.ABC):
    """A function of pytrees of tensors, specialized once per input shapes, dtypes, tree and
    other leaves by :meth:`specialize` (subclasses say how), then called on the flat tensors."""

    def __init__(self, flat_input_func: FlattenedInputFunc):
        self._cache: dict = {}
        self._flat_input_func = flat_input_func

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._flat_input_func
        tensors = flat.preprocess(args, kwargs)
        abstract = tuple((tuple(t.shape), t.dtype) for t in tensors)
        key = (abstract, _freeze(flat.non_tensors), flat.in_spec)
        specialized = self._cache.get(key)
        if specialized is None:
            specialized = self._cache[key] = (self.specialize(tensors), flat.out_spec)
        function, flat.out_spec = specialized
        return flat.postprocess(function(tensors))

    @abc.abstractmethod
    def specialize(self, sample_flat_args: Sequence[torch.Tensor]) -> Callable:
        """A function of the flat tensors (shaped like ``sample_flat_args``) to a flat list."""


class XlaCallable(CompiledCallableWithCache):
    """A function written with the builder's ops, called on pytrees of xla tensors.

    ``xla_func`` receives an :class:`Op` parameter wherever its arguments hold a tensor and
    returns ops (any pytree of them); each distinct input signature builds one computation,
    which every call runs as one graph node.

    Args:
        xla_func: The builder function.

    Example:
        >>> add = XlaCallable(lambda a, b: a.sin() + b)
        >>> out = add(torch.ones(2, device='xla'), torch.ones(2, device='xla'))
    """

    def __init__(self, xla_func: Callable):
        super().__init__(FlattenedInputFunc(xla_func))

    def specialize(self, sample_flat_args: Sequence[torch.Tensor]) -> Callable:
        name = "xla::computation"
        builder = create_builder(name)
        params = [
            mkparam(builder, k, mkshape(Op.from_torch_type(t.dtype), tuple(t.shape)))
            for k, t in enumerate(sample_flat_args)
        ]
        computation = Op.tuple(self._flat_input_func.flat_call(params)).build(name)
        return xla_computation_as_func(computation, name)


# --- JAX functions on xla tensors ------------------------------------------------------------


class _JaxCall:
    """One specialization of a JAX function: where the tensors sit among the flattened
    arguments, the other leaves (static), and the output tree. Equal specializations of the
    same function (or ``override_hash``) are equal, so their programs compile once."""

    __slots__ = ("fn", "identity", "in_tree", "out_tree", "positions", "statics")

    def __init__(self, fn, identity, in_tree, positions: tuple, statics: tuple, out_tree):
        self.fn = fn
        self.identity = identity
        self.in_tree = in_tree
        self.positions = positions
        self.statics = statics
        self.out_tree = out_tree

    def call(self, arrays: Sequence[Any]) -> Any:
        """The function's result tree on the tensors' arrays."""
        leaves = list(self.statics)
        for position, array in zip(self.positions, arrays):
            leaves[position] = array
        args, kwargs = jax.tree.unflatten(self.in_tree, leaves)
        return self.fn(*args, **kwargs)

    def lower(self, inputs: tuple) -> list:
        return jax.tree.leaves(self.call(inputs))

    def _key(self) -> tuple:
        return (self.identity, self.in_tree, self.positions, _freeze(self.statics))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _JaxCall) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"jax:{getattr(self.fn, '__name__', type(self.fn).__name__)}"


class _JaxCallable:
    """A JAX function's specializations, one per input shapes, dtypes, tree and static leaves."""

    def __init__(self, fn: Callable, identity: Any):
        self.fn = fn
        self.identity = identity
        self._cache: dict = {}

    def specialize(self, flat: list, in_tree) -> tuple[_JaxCall, list]:
        positions = tuple(k for k, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor))
        statics = tuple(None if k in positions else leaf for k, leaf in enumerate(flat))
        avals = tuple(
            jax.ShapeDtypeStruct(tuple(flat[k].shape), to_jax_dtype(flat[k].dtype))
            for k in positions
        )
        key = (avals, in_tree, _freeze(statics))
        entry = self._cache.get(key)
        if entry is None:
            probe = _JaxCall(self.fn, self.identity, in_tree, positions, statics, None)
            leaves, out_tree = jax.tree.flatten(jax.eval_shape(lambda *a: probe.call(a), *avals))
            call = _JaxCall(self.fn, self.identity, in_tree, positions, statics, out_tree)
            entry = self._cache[key] = (call, leaves)
        return entry


_JAX_TO_XLA_COMPUTATION_CACHE: dict = {}


def _jax_to_xla_computation_cache_elements() -> int:
    """How many specializations of JAX functions :func:`call_jax` traced (all functions)."""
    return sum(len(callable_._cache) for callable_ in _JAX_TO_XLA_COMPUTATION_CACHE.values())


def call_jax(
    jax_func: Callable,
    args: tuple,
    kwargs: dict | None = None,
    name: str | None = None,
    override_hash: Any = None,
) -> Any:
    """Call a JAX function on xla tensors, as one op of the lazy graph.

    The xla tensors among ``args`` and ``kwargs`` (any pytree) reach ``jax_func`` as JAX
    arrays, the other leaves as they are; the result's arrays come back as xla tensors in the
    same tree. The function runs inside the step's program when it is compiled, so it must be
    traceable by ``jax.jit``. It is traced for its output shapes once per input shapes, tree and
    non-tensor leaves (which must be hashable). Results carry no autograd history.

    Args:
        jax_func: A pure function of JAX arrays.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        name: The op's name in the graph and HLO op names (``xla::`` prefixed); default
            ``xla::jax_func``.
        override_hash: Identifies the function in the cache instead of its ``id`` (for
            functions made anew on each call, such as closures).

    Returns:
        ``jax_func``'s result with xla tensors for its arrays.

    Example:
        >>> def f(a, b):
        ...     return a + jnp.sin(b)
        >>> a = torch.ones(3, 3, device='xla')
        >>> b = xb.call_jax(f, (a, a))
    """
    kwargs = kwargs or {}
    flat, in_tree = jax.tree.flatten((tuple(args), kwargs))
    opname = name if name and "::" in name else f"xla::{name or 'jax_func'}"
    for k, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor):
            on_xla(leaf, f"{opname} (tensor argument {k} (flattened))", RuntimeError)
    identity = (override_hash if override_hash is not None else id(jax_func),)
    identity += (jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64)
    callable_ = _JAX_TO_XLA_COMPUTATION_CACHE.get(identity)
    if callable_ is None:
        callable_ = _JAX_TO_XLA_COMPUTATION_CACHE[identity] = _JaxCallable(jax_func, identity)
    call, out_leaves = callable_.specialize(flat, in_tree)
    tensors = [flat[k] for k in call.positions]
    avals = [Aval(tuple(o.shape), to_torch_dtype(o.dtype)) for o in out_leaves]
    outputs = _record(opname, tensors, call, avals) if avals else []
    return jax.tree.unflatten(call.out_tree, outputs)
