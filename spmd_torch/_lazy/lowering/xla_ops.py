"""XLA's operations by name, each as the ``jax.lax`` function of XLA's operation semantics.

``torch_xla.core.xla_builder`` builds computations op by op under these names (``Add``,
``Gather``, ``While``...); this table says what each one computes, beside the aten lowerings.
Attributes arrive as the builder's keyword arguments; a computation attribute (a combiner, a
loop body) is anything with ``apply``, ``root`` and ``params``, as ``xla_builder.Computation``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

# XLA's element type names (``xla_builder.Type``), as JAX dtypes.
JAX_DTYPES = {
    name: np.dtype(dtype)
    for name, dtype in {
        "f32": jnp.float32,
        "f64": jnp.float64,
        "bf16": jnp.bfloat16,
        "f16": jnp.float16,
        "u8": jnp.uint8,
        "s8": jnp.int8,
        "u16": jnp.uint16,
        "s16": jnp.int16,
        "u32": jnp.uint32,
        "s32": jnp.int32,
        "u64": jnp.uint64,
        "s64": jnp.int64,
        "c64": jnp.complex64,
        "c128": jnp.complex128,
        "pred": jnp.bool_,
    }.items()
}


def jax_dtype(xla_type: str) -> np.dtype:
    try:
        return JAX_DTYPES[xla_type]
    except KeyError:
        raise ValueError(
            f"unknown XLA element type {xla_type!r}; known: {sorted(JAX_DTYPES)}"
        ) from None


class _OpDef:
    """What one XLA op name means: its JAX function, and how its attributes are normalised."""

    __slots__ = ("impl", "prepare")

    def __init__(self, impl: Callable, prepare: Callable | None = None):
        self.impl = impl
        self.prepare = prepare


OPS: dict[str, _OpDef] = {}


def _op(*names: str, prepare: Callable | None = None) -> Callable:
    def register(impl: Callable) -> Callable:
        for name in names:
            OPS[name] = _OpDef(impl, prepare)
        return impl

    return register


def _binary(fn: Callable) -> Callable:
    """XLA's element-wise binary op: equal element types; a scalar, or same-rank degenerate
    dimensions, broadcast."""

    def impl(a, b):
        if a.dtype != b.dtype:
            raise TypeError(f"operands have different element types: {a.dtype} and {b.dtype}")
        if a.shape != b.shape:
            if a.ndim and b.ndim and a.ndim != b.ndim:
                raise TypeError(
                    f"operand shapes {a.shape} and {b.shape} differ in rank (only a scalar "
                    "broadcasts implicitly)"
                )
            shape = jnp.broadcast_shapes(a.shape, b.shape)
            a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
        return fn(a, b)

    return impl


def _shift_right(a, b):
    if jnp.issubdtype(a.dtype, jnp.signedinteger):
        return lax.shift_right_arithmetic(a, b)
    return lax.shift_right_logical(a, b)


_BINARY = {
    "Add": lax.add,
    "Sub": lax.sub,
    "Mul": lax.mul,
    "Div": lax.div,
    "Rem": lax.rem,
    "Pow": lax.pow,
    "Max": lax.max,
    "Min": lax.min,
    "Atan2": lax.atan2,
    "And": lax.bitwise_and,
    "Or": lax.bitwise_or,
    "Xor": lax.bitwise_xor,
    "Eq": lax.eq,
    "Ne": lax.ne,
    "Lt": lax.lt,
    "Le": lax.le,
    "Gt": lax.gt,
    "Ge": lax.ge,
    "ShiftLeft": lax.shift_left,
    "ShiftRight": _shift_right,
    "ShifRight": _shift_right,  # PyTorch/XLA's C++ table spells it so
}
_UNARY = {
    "Abs": lax.abs,
    "Acos": lax.acos,
    "Asin": lax.asin,
    "Atan": lax.atan,
    "Ceil": lax.ceil,
    "Clz": lax.clz,
    "Conj": lax.conj,
    "Cos": lax.cos,
    "Cosh": lax.cosh,
    "Erf": lax.erf,
    "Erfc": lax.erfc,
    "ErfInv": lax.erf_inv,
    "Exp": lax.exp,
    "Expm1": lax.expm1,
    "Floor": lax.floor,
    "Imag": lax.imag,
    "Real": lax.real,
    "Log": lax.log,
    "Log1p": lax.log1p,
    "Neg": lax.neg,
    "Not": lax.bitwise_not,
    "Sqrt": lax.sqrt,
    "Rsqrt": lax.rsqrt,
    "Sin": lax.sin,
    "Sinh": lax.sinh,
    "Square": lax.square,
    "Tan": lax.tan,
    "Tanh": lax.tanh,
}
for _name, _fn in _BINARY.items():
    OPS[_name] = _OpDef(_binary(_fn))
for _name, _fn in _UNARY.items():
    OPS[_name] = _OpDef(_fn)


def _not_supported(kind: str, why: str) -> Callable:
    def impl(*operands, **params):
        raise NotImplementedError(f"XLA op {kind}: {why}")

    return impl


OPS["DynamicReshape"] = _OpDef(_not_supported("DynamicReshape", "dynamic shapes are static here"))
OPS["SetDimensionSize"] = _OpDef(
    _not_supported("SetDimensionSize", "dynamic shapes are static here")
)
for _name in ("SelectAndScatter", "SelectAndScatterWithGeneralPadding"):
    OPS[_name] = _OpDef(_not_supported(_name, "JAX has no select-and-scatter operation"))


def _tensor_value(value: Any) -> np.ndarray:
    """A constant's value on the host, as the numpy array JAX takes."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype is torch.bfloat16:
            return value.float().numpy().astype(jnp.bfloat16)
        return value.numpy().copy()
    return np.asarray(value)


def _prepare_constant(params: dict) -> dict:
    return {"value": _tensor_value(params["value"])}


@_op("Constant", prepare=_prepare_constant)
def _constant(value):
    return jnp.asarray(value)


def _prepare_iota(params: dict) -> dict:
    return {"shape": _freeze_shape(params["shape"]), "iota_dimension": params["iota_dimension"]}


def _freeze_shape(shape: Any) -> Any:
    shape = getattr(shape, "shape", shape)  # an xla_builder.Shape, or its dict
    return {"type": shape["type"], "sizes": tuple(shape["sizes"])}


@_op("Iota", prepare=_prepare_iota)
def _iota(shape, iota_dimension):
    return lax.broadcasted_iota(jax_dtype(shape["type"]), shape["sizes"], iota_dimension)


@_op("Tuple")
def _tuple(*values):
    return tuple(values)


@_op("GetTupleElement")
def _get_tuple_element(value, index):
    if not isinstance(value, tuple):
        raise TypeError("GetTupleElement of an operand that is not a tuple")
    return value[index]


@_op("Reshape")
def _reshape(x, sizes, dimensions=None, inferred_dimension=None):
    return lax.reshape(x, tuple(sizes), None if dimensions is None else tuple(dimensions))


@_op("Broadcast")
def _broadcast(x, sizes):
    return lax.broadcast(x, tuple(sizes))


@_op("BroadcastInDim")
def _broadcast_in_dim(x, sizes, dimensions):
    return lax.broadcast_in_dim(x, tuple(sizes), tuple(dimensions))


@_op("Slice")
def _slice(x, start_indices, limit_indices, strides):
    return lax.slice(x, tuple(start_indices), tuple(limit_indices), tuple(strides))


@_op("SliceInDim")
def _slice_in_dim(x, start_index, limit_index, dimno, stride=1):
    return lax.slice_in_dim(x, start_index, limit_index, stride, dimno)


@_op("DynamicSlice")
def _dynamic_slice(x, *start_indices, slice_sizes):
    return lax.dynamic_slice(x, start_indices, tuple(slice_sizes))


@_op("DynamicUpdateSlice")
def _dynamic_update_slice(x, update, *start_indices):
    return lax.dynamic_update_slice(x, update, start_indices)


def _index_vector_last(indices, index_vector_dim: int):
    """JAX's gather/scatter read the index vector from the last dimension; XLA from any."""
    if index_vector_dim == indices.ndim:
        return indices[..., None]
    return jnp.moveaxis(indices, index_vector_dim, -1)


@_op("Gather")
def _gather(
    x,
    indices,
    offset_dims,
    collapsed_slice_dims,
    start_index_map,
    index_vector_dim,
    slice_sizes,
    indices_are_sorted=None,
):
    numbers = lax.GatherDimensionNumbers(
        offset_dims=tuple(offset_dims),
        collapsed_slice_dims=tuple(collapsed_slice_dims),
        start_index_map=tuple(start_index_map),
    )
    return lax.gather(
        x,
        _index_vector_last(indices, index_vector_dim),
        numbers,
        tuple(slice_sizes),
        indices_are_sorted=bool(indices_are_sorted),
        mode=lax.GatherScatterMode.CLIP,  # XLA clamps start indices into range
    )


def _combiner(computation, what: str) -> str:
    """Which binary function a scalar combiner computation is: 'Add', 'Mul', 'Max', 'Min', or
    'Replace' (it returns its second parameter)."""
    root, params = computation.root, computation.params
    if len(params) == 2 and root is params[1]:
        return "Replace"
    if len(params) == 2 and root.kind in ("Add", "Mul", "Max", "Min"):
        if {id(o) for o in root.operands} == {id(p) for p in params}:
            return root.kind
    raise NotImplementedError(
        f"{what}: combiner {computation!r} with root {root.kind} is not supported; it must "
        "add, multiply, take the max or min of its two parameters, or return the second"
    )


_SCATTERS = {
    "Add": lax.scatter_add,
    "Mul": lax.scatter_mul,
    "Max": lax.scatter_max,
    "Min": lax.scatter_min,
    "Replace": lax.scatter,
}


@_op("Scatter")
def _scatter(
    x,
    indices,
    updates,
    computation,
    update_window_dims,
    inserted_window_dims,
    scatter_dims_to_operand_dims,
    index_vector_dim,
    indices_are_sorted=None,
    unique_indices=None,
):
    numbers = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(update_window_dims),
        inserted_window_dims=tuple(inserted_window_dims),
        scatter_dims_to_operand_dims=tuple(scatter_dims_to_operand_dims),
    )
    scatter = _SCATTERS[_combiner(computation, "Scatter")]
    return scatter(
        x,
        _index_vector_last(indices, index_vector_dim),
        updates,
        numbers,
        indices_are_sorted=bool(indices_are_sorted),
        unique_indices=bool(unique_indices),
        mode=lax.GatherScatterMode.FILL_OR_DROP,  # XLA skips out-of-range updates
    )


_PRECISIONS = {
    None: None,
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
}


def _precision(config: str | None):
    try:
        return _PRECISIONS[config]
    except KeyError:
        raise ValueError(
            f"Invalid precision config {config!r} (valid values: default, high, highest)"
        ) from None


def _padding(padding: Any) -> Any:
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"Invalid padding: {padding!r} (valid, same or (low, high) pairs)")
        return padding.upper()
    return [tuple(p) for p in padding]


@_op("Dot")
def _dot(a, b, precision_config=None):
    return lax.dot(a, b, precision=_precision(precision_config))


def _convolve(lhs, rhs, numbers=None, *, window_strides, padding, lhs_dilation=None, **kw):
    return lax.conv_general_dilated(
        lhs,
        rhs,
        window_strides=tuple(window_strides),
        padding=_padding(padding),
        lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
        rhs_dilation=None if kw.get("rhs_dilation") is None else tuple(kw["rhs_dilation"]),
        dimension_numbers=numbers,
        feature_group_count=kw.get("feature_group_count") or 1,
        batch_group_count=kw.get("batch_group_count") or 1,
        precision=_precision(kw.get("precision_config")),
    )


def _dimension_numbers(kw: dict) -> lax.ConvDimensionNumbers:
    return lax.ConvDimensionNumbers(
        lhs_spec=(
            kw.pop("input_batch_dimension"),
            kw.pop("input_feature_dimension"),
            *kw.pop("input_spatial_dimensions"),
        ),
        rhs_spec=(
            kw.pop("kernel_output_feature_dimension"),
            kw.pop("kernel_input_feature_dimension"),
            *kw.pop("kernel_spatial_dimensions"),
        ),
        out_spec=(
            kw.pop("output_batch_dimension"),
            kw.pop("output_feature_dimension"),
            *kw.pop("output_spatial_dimensions"),
        ),
    )


@_op("Conv", "ConvWithGeneralPadding")
def _conv(lhs, rhs, **kw):
    return _convolve(lhs, rhs, **kw)


@_op("ConvWithGeneralDimensions", "ConvGeneral", "ConvGeneralDilated")
def _conv_general(lhs, rhs, **kw):
    numbers = _dimension_numbers(dict(kw))
    rest = {k: v for k, v in kw.items() if not k.endswith(("_dimension", "_dimensions"))}
    return _convolve(lhs, rhs, numbers, **rest)


@_op("Convert")
def _convert(x, to_type):
    return lax.convert_element_type(x, jax_dtype(to_type))


@_op("BitcastConvert")
def _bitcast_convert(x, to_type):
    return lax.bitcast_convert_type(x, jax_dtype(to_type))


@_op("Pad")
def _pad(x, value, config):
    return lax.pad(x, value, [tuple(c) for c in config])


@_op("MaxPool")
def _max_pool(
    x, kernel_size, stride, batch_dimension, feature_dimension, spatial_dimensions, padding="valid"
):
    if len(kernel_size) != x.ndim or len(stride) != x.ndim:
        raise ValueError(
            f"MaxPool: kernel_size {kernel_size} and stride {stride} need one entry per "
            f"dimension of the {x.ndim}-d operand"
        )
    if jnp.issubdtype(x.dtype, jnp.floating):
        lowest = -jnp.inf
    else:
        lowest = jnp.iinfo(x.dtype).min
    init = jnp.asarray(lowest, x.dtype)
    return lax.reduce_window(x, init, lax.max, tuple(kernel_size), tuple(stride), _padding(padding))


def _scalar_fn(computation) -> Callable:
    return lambda a, b: computation.apply(a, b)


@_op("Reduce")
def _reduce(x, init, computation, dimensions):
    return lax.reduce(x, init, _scalar_fn(computation), tuple(dimensions))


@_op("ReduceAll")
def _reduce_all(x, init, computation):
    return lax.reduce(x, init, _scalar_fn(computation), tuple(range(x.ndim)))


@_op("ReduceWindow")
def _reduce_window(x, init, computation, window_dimensions, window_strides, padding="valid"):
    return lax.reduce_window(
        x,
        init,
        _scalar_fn(computation),
        tuple(window_dimensions),
        tuple(window_strides),
        _padding(padding),
    )


@_op("Select")
def _select(pred, on_true, on_false):
    if on_true.dtype != on_false.dtype:
        raise TypeError(f"Select: branches of {on_true.dtype} and {on_false.dtype}")
    if pred.ndim == 0 and on_true.ndim:
        pred = jnp.broadcast_to(pred, on_true.shape)
    return lax.select(pred, on_true, on_false)


@_op("Transpose")
def _transpose(x, permutation):
    return lax.transpose(x, tuple(permutation))


@_op("TriangularSolve")
def _triangular_solve(a, b, left_side=None, lower=None, unit_diagonal=None, transpose_a=None):
    return lax.linalg.triangular_solve(
        a,
        b,
        left_side=True if left_side is None else bool(left_side),
        lower=bool(lower),
        transpose_a=bool(transpose_a),
        unit_diagonal=bool(unit_diagonal),
    )


@_op("Clamp")
def _clamp(x, min_value, max_value):
    return lax.clamp(min_value, x, max_value)


@_op("Conditional")
def _conditional(pred, true_operand, false_operand, true_computation, false_computation):
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise TypeError(
            f"Conditional: the predicate must be a pred[], got {pred.dtype}{pred.shape}"
        )
    return lax.cond(
        pred,
        lambda operands: true_computation.apply(operands[0]),
        lambda operands: false_computation.apply(operands[1]),
        (true_operand, false_operand),
    )


@_op("While")
def _while(init, condition_computation, body_computation):
    return lax.while_loop(condition_computation.apply, body_computation.apply, init)


@_op("Call")
def _call(*operands, computation):
    return computation.apply(*operands)


@_op("ConcatInDim")
def _concat_in_dim(*operands, dimension):
    return lax.concatenate(operands, dimension)


@_op("Sort")
def _sort(*operands, comparator, dimension=None, is_stable=None):
    root, params = comparator.root, comparator.params
    ascending = (
        root.kind == "Lt"
        and len(params) == 2 * len(operands)
        and root.operands[0] is params[0]
        and root.operands[1] is params[1]
    )
    if not ascending:
        raise NotImplementedError(
            f"Sort: comparator {comparator!r} is not supported; sort by the first operand "
            "ascending with Lt(p0, p1)"
        )
    dimension = -1 if dimension is None else dimension
    result = lax.sort(operands, dimension=dimension, is_stable=bool(is_stable), num_keys=1)
    return tuple(result) if len(operands) > 1 else result[0]


@_op("Map")
def _map(*operands, computation, dimensions, static_operands=()):
    if static_operands:
        raise NotImplementedError("Map: static operands are not supported")
    if tuple(dimensions) != tuple(range(operands[0].ndim)):
        raise ValueError(f"Map: dimensions {dimensions} must be every dimension, in order")
    fn = computation.apply
    for _ in range(operands[0].ndim):
        fn = jax.vmap(fn)
    return fn(*operands)


@_op("GetDimensionSize")
def _get_dimension_size(x, dimension):
    return jnp.asarray(x.shape[dimension], jnp.int32)


@_op("Rev")
def _rev(x, dimensions):
    return lax.rev(x, tuple(dimensions))
