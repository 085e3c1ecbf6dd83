"""torch_xla.core.xla_builder and xla_op_registry: computations built op by op, run on xla tensors as
one graph node each, compared with numpy and torch on the CPU; shapes, types, caching, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_builder as xb
import spmd_torch.core.xla_op_registry as xor
import spmd_torch.debug.graph as graph
from spmd_torch._internal import pjrt
from spmd_torch.experimental import eager_mode_context
from tests.helpers import assert_close, assert_compiles


def _run(opfn, *tensors, **kwargs):
    """Register ``opfn`` under a fresh name and run it on the xla copies of ``tensors``."""
    op = xor.register(opfn.__name__, opfn)
    result = op(*(t.to(spmd_torch.device()) for t in tensors), **kwargs)
    return [r.cpu() for r in result] if isinstance(result, list) else result.cpu()


def _f32(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- element-wise ops ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("__add__", np.add),
        ("__sub__", np.subtract),
        ("__mul__", np.multiply),
        ("__truediv__", np.divide),
        ("max", np.maximum),
        ("min", np.minimum),
        ("atan2", np.arctan2),
    ],
)
def test_binary_float_ops_match_numpy(name, expected):
    a, b = _f32(3, 4, seed=1), _f32(3, 4, seed=2)

    def binary(x, y):
        return getattr(x, name)(y)

    assert_close(_run(binary, a, b), torch.from_numpy(expected(a.numpy(), b.numpy())))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("exp", np.exp),
        ("tanh", np.tanh),
        ("sin", np.sin),
        ("floor", np.floor),
        ("ceil", np.ceil),
        ("__neg__", np.negative),
    ],
)
def test_unary_float_ops_match_numpy(name, expected):
    a = _f32(5, seed=3)

    def unary(x):
        return getattr(x, name)()

    assert_close(_run(unary, a), torch.from_numpy(expected(a.numpy())))


def test_sqrt_log_rsqrt_of_positive_values():
    a = _f32(6, seed=4).abs() + 0.5

    def roots(x):
        return xb.Op.tuple((x.sqrt(), x.log(), x.rsqrt(), x.log1p(), x.expm1()))

    expected = [a.sqrt(), a.log(), a.rsqrt(), a.log1p(), a.expm1()]
    assert_close(_run(roots, a), expected)


def test_integer_division_truncates_and_remainder_takes_the_dividends_sign():
    a = torch.tensor([7, -7, 7, -7], dtype=torch.int32)
    b = torch.tensor([2, 2, -2, -2], dtype=torch.int32)

    def div_rem(x, y):
        return xb.Op.tuple((x / y, x % y))

    quotient, remainder = _run(div_rem, a, b)
    assert quotient.tolist() == [3, -3, -3, 3]
    assert remainder.tolist() == [1, -1, 1, -1]


def test_shift_right_is_arithmetic_for_signed_and_logical_for_unsigned():
    signed = torch.tensor([-16, 16], dtype=torch.int32)
    unsigned = torch.tensor([0xF0, 0x10], dtype=torch.uint8)

    def shifts(x, n, u, m):
        return xb.Op.tuple((x >> n, u >> m, x << n))

    right, logical, left = _run(
        shifts,
        signed,
        torch.tensor([2, 2], dtype=torch.int32),
        unsigned,
        torch.tensor([4, 4], dtype=torch.uint8),
    )
    assert right.tolist() == [-4, 4]
    assert logical.tolist() == [0x0F, 0x01]
    assert left.tolist() == [-64, 64]


def test_comparisons_give_pred_and_select_picks():
    a, b = _f32(6, seed=5), _f32(6, seed=6)

    def pick_larger(x, y):
        return (x > y).select(x, y)

    assert_close(_run(pick_larger, a, b), torch.maximum(a, b), tol="exact")


def test_scalar_operand_broadcasts():
    a = _f32(2, 3, seed=7)

    def plus_half(x):
        return x + xb.Op.scalar(x.builder(), 0.5, dtype=x.shape().dtype)

    assert_close(_run(plus_half, a), a + 0.5)


def test_bitwise_ops_on_pred_and_integers():
    a = torch.tensor([0b1100, 0b1010], dtype=torch.int64)
    b = torch.tensor([0b1010, 0b0110], dtype=torch.int64)

    def bits(x, y):
        return xb.Op.tuple((x & y, x | y, x ^ y, ~x))

    assert [t.tolist() for t in _run(bits, a, b)] == [
        [0b1000, 0b0010],
        [0b1110, 0b1110],
        [0b0110, 0b1100],
        [~0b1100, ~0b1010],
    ]


# --- shapes and data movement --------------------------------------------------------------------


def test_reshape_transpose_slice_and_concat():
    a = torch.arange(24, dtype=torch.float32)

    def shuffle(x):
        m = x.reshape((4, 6)).transpose((1, 0))
        head = m.slice((0, 0), (6, 4), (2, 1))
        tail = m.slice_in_dim(1, 3, dimno=0)
        return xb.Op.concat_in_dim((head, tail), 0)

    m = a.reshape(4, 6).t()
    assert_close(_run(shuffle, a), torch.cat([m[0:6:2], m[1:3]]), tol="exact")


def test_broadcast_and_broadcast_in_dim():
    a = torch.tensor([1.0, 2.0, 3.0])

    def widen(x):
        return xb.Op.tuple((x.broadcast((2,)), x.broadcast_in_dim((3, 2), (0,))))

    leading, column = _run(widen, a)
    assert leading.tolist() == [[1.0, 2.0, 3.0]] * 2
    assert column.tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_pad_with_interior_and_rev():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])

    def pad_rev(x):
        zero = xb.Op.scalar(x.builder(), 0.0)
        return x.pad(zero, ((1, 0, 0), (0, 1, 1))).rev((0,))

    expected = np.pad(np.array([[1, 0, 2], [3, 0, 4]], np.float32), ((1, 0), (0, 1)))[::-1]
    assert _run(pad_rev, a).tolist() == expected.tolist()


def test_dynamic_slice_and_update_slice_take_index_operands():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    start = torch.tensor(1, dtype=torch.int32)

    def window(x, i):
        piece = x.dynamic_slice((i, i), (2, 2))
        return x.dynamic_update_slice(piece * piece, (i, i))

    expected = a.clone()
    expected[1:3, 1:3] = a[1:3, 1:3] ** 2
    assert_close(_run(window, a, start), expected, tol="exact")


def test_iota_constant_and_dimension_size():
    a = torch.zeros(2, 5)

    def make(x):
        b = x.builder()
        iota = xb.Op.iota(b, xb.mkshape(xb.Type.S32, (2, 3)), iota_dimension=1)
        const = xb.Op.constant(b, torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32))
        return xb.Op.tuple((iota + const, x.get_dimension_size(1)))

    values, size = _run(make, a)
    assert values.tolist() == [[1, 3, 5], [4, 6, 8]]
    assert size.dtype == torch.int32 and size.item() == 5


def test_cast_and_bitcast():
    a = torch.tensor([1.75, -2.5])

    def convert(x):
        return xb.Op.tuple((x.cast(xb.Type.S32), x.bitcast(xb.Type.U32), x.cast(xb.Type.PRED)))

    integer, bits, pred = _run(convert, a)
    assert integer.tolist() == [1, -2]
    assert bits.dtype == torch.uint32
    assert bits.view(torch.float32).tolist() == [1.75, -2.5]
    assert pred.tolist() == [True, True]


def test_clamp():
    a = torch.tensor([-3.0, 0.5, 9.0])

    def clip(x):
        b = x.builder()
        return x.clamp(xb.Op.scalar(b, -1.0), xb.Op.scalar(b, 1.0))

    assert _run(clip, a).tolist() == [-1.0, 0.5, 1.0]


def test_gather_rows_with_index_vector_dim_at_the_end():
    a = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    rows = torch.tensor([2, 0, 3], dtype=torch.int32)

    def take(x, i):
        return x.gather(
            i,
            offset_dims=(1,),
            collapsed_slice_dims=(0,),
            start_index_map=(0,),
            index_vector_dim=1,
            slice_sizes=(1, 3),
        )

    assert_close(_run(take, a, rows), a[rows.long()], tol="exact")


def test_scatter_add_with_an_add_combiner():
    a = torch.zeros(4, 2)
    rows = torch.tensor([1, 3, 1], dtype=torch.int32)
    updates = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

    def accumulate(x, i, u):
        return x.scatter(
            i,
            u,
            lambda p, q: p + q,
            update_window_dims=(1,),
            inserted_window_dims=(0,),
            scatter_dims_to_operand_dims=(0,),
            index_vector_dim=1,
        )

    expected = torch.zeros(4, 2).index_add_(0, rows.long(), updates)
    assert_close(_run(accumulate, a, rows, updates), expected, tol="exact")


# --- matmul, convolution, reductions -------------------------------------------------------------


def test_dot_matches_matmul():
    a, b = _f32(3, 4, seed=8), _f32(4, 2, seed=9)

    def matmul(x, y):
        return x @ y

    assert_close(_run(matmul, a, b), a @ b)


def test_conv_matches_torch_conv2d():
    image, kernel = _f32(1, 2, 5, 5, seed=10), _f32(3, 2, 3, 3, seed=11)

    def convolve(x, k):
        return xb.Op.tuple((x.conv(k, (1, 1)), x.conv(k, (2, 2), padding="same")))

    valid, same = _run(convolve, image, kernel)
    assert_close(valid, torch.nn.functional.conv2d(image, kernel))
    assert_close(same, torch.nn.functional.conv2d(image, kernel, stride=2, padding=1))


def test_conv_general_dilated_with_nhwc_layout():
    image, kernel = _f32(1, 6, 6, 2, seed=12), _f32(3, 3, 2, 4, seed=13)  # NHWC, HWIO

    def convolve(x, k):
        return x.conv_general_dilated(
            k,
            window_strides=(1, 1),
            padding=((1, 1), (1, 1)),
            lhs_dilation=(1, 1),
            rhs_dilation=(2, 2),
            input_batch_dimension=0,
            input_feature_dimension=3,
            kernel_input_feature_dimension=2,
            kernel_output_feature_dimension=3,
            output_batch_dimension=0,
            output_feature_dimension=3,
            input_spatial_dimensions=(1, 2),
            kernel_spatial_dimensions=(0, 1),
            output_spatial_dimensions=(1, 2),
        )

    expected = torch.nn.functional.conv2d(
        image.permute(0, 3, 1, 2), kernel.permute(3, 2, 0, 1), padding=1, dilation=2
    ).permute(0, 2, 3, 1)
    assert_close(_run(convolve, image, kernel), expected)


def test_reduce_with_a_built_computation():
    a = _f32(3, 4, seed=14)

    def row_sums(x):
        zero = xb.Op.scalar(x.builder(), 0.0)
        return x.reduce(zero, lambda p, q: p + q, (1,))

    assert_close(_run(row_sums, a), a.sum(1))


def test_reduce_all_with_max():
    a = _f32(3, 4, seed=15)

    def largest(x):
        lowest = xb.Op.scalar(x.builder(), -float("inf"))
        return x.reduce_all(lowest, lambda p, q: p.max(q))

    assert _run(largest, a).item() == a.max().item()


def test_reduce_window_and_max_pool_match_torch():
    image = _f32(1, 1, 4, 6, seed=16)

    def pools(x):
        zero = xb.Op.scalar(x.builder(), 0.0)
        summed = x.reduce_window(zero, lambda p, q: p + q, (1, 1, 2, 2), (1, 1, 2, 2))
        biggest = x.max_pool((1, 1, 2, 2), (1, 1, 2, 2), 0, 1, (2, 3))
        return xb.Op.tuple((summed, biggest))

    summed, biggest = _run(pools, image)
    assert_close(summed, torch.nn.functional.avg_pool2d(image, 2) * 4)
    assert_close(biggest, torch.nn.functional.max_pool2d(image, 2), tol="exact")


def test_sort_ascending_carries_the_second_operand():
    keys = torch.tensor([3.0, 1.0, 2.0])
    values = torch.tensor([30, 10, 20], dtype=torch.int32)
    scalar = xb.mkshape(xb.Type.F32, ())
    index = xb.mkshape(xb.Type.S32, ())
    comparator = xb.create_computation(
        "lt", lambda a, b, c, d: a < b, [scalar, scalar, index, index]
    )

    def sort(k, v):
        return xb.Op.sort((k, v), comparator, dimension=0)

    sorted_keys, sorted_values = _run(sort, keys, values)
    assert sorted_keys.tolist() == [1.0, 2.0, 3.0]
    assert sorted_values.tolist() == [10, 20, 30]


def test_map_applies_a_scalar_computation_elementwise():
    a, b = _f32(2, 3, seed=17), _f32(2, 3, seed=18)
    scalar = xb.mkshape(xb.Type.F32, ())
    fma = xb.create_computation("fma", lambda p, q: p * q + p, [scalar, scalar])

    def mapped(x, y):
        return xb.Op.map((x, y), fma, (0, 1))

    assert_close(_run(mapped, a, b), a * b + a)


def test_call_a_computation():
    a = _f32(4, seed=19)

    def twice(x):
        return xb.Op.call(lambda v: v + v, (x,))

    assert_close(_run(twice, a), a * 2)


# --- PyTorch/XLA's TestOpBuilder cases -----------------------------------------------------------


def test_mixed_dtype_tuple_returns_two_tensors():
    def mixed(a):
        return xb.Op.tuple((a, a.cast(xb.Type.BF16)))

    a = _f32(2, 3, seed=20)
    same, cast = _run(mixed, a)
    assert same.dtype == torch.float32 and cast.dtype == torch.bfloat16
    assert_close(same, a, tol="exact")
    assert_close(cast, a.to(torch.bfloat16), tol="exact")


@pytest.mark.parametrize("k0, expected", [(0.1, "sum"), (0.9, "difference")])
def test_conditional_runs_the_branch_the_predicate_picks(k0, expected):
    def branch(k, a, b, k0=None):
        cond = k > xb.Op.scalar(k.builder(), k0, dtype=k.shape().dtype)
        return cond.mkconditional((a, b), lambda a, b: a + b, lambda a, b: a - b)

    k, a, b = torch.tensor(0.2), _f32(2, 2, seed=21), _f32(2, 2, seed=22)
    result = _run(branch, k, a, b, k0=k0)
    assert_close(result, a + b if expected == "sum" else a - b)


def test_while_loop_adds_b_limit_times():
    def loop(a, b, limit=None):
        def cond(counter, a, b):
            return counter < xb.Op.scalar(counter.builder(), limit, dtype=xb.Type.S32)

        def body(counter, a, b):
            one = xb.Op.scalar(counter.builder(), 1, dtype=xb.Type.S32)
            return xb.Op.tuple((counter + one, a + b, b))

        zero = xb.Op.scalar(a.builder(), 0, dtype=xb.Type.S32)
        return xb.Op.mkwhile((zero, a, b), cond, body).get_tuple_element(1)

    a, b = _f32(2, 2, seed=23), _f32(2, 2, seed=24)
    expected = a.clone()
    for _ in range(10):
        expected = expected + b
    assert_close(_run(loop, a, b, limit=10), expected)


@pytest.mark.parametrize("lower", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("unit_diagonal", [False, True])
def test_triangular_solve_matches_torch(lower, transpose_a, unit_diagonal):
    def solve(b, a, lower, unit_diagonal, transpose_a):
        return a.triangualr_solve(b, True, lower, unit_diagonal, transpose_a)

    a = _f32(3, 3, seed=25) + 3 * torch.eye(3)
    a = a.tril() if lower else a.triu()
    b = _f32(3, 2, seed=26)
    system = a.clone()
    if unit_diagonal:  # the diagonal is taken as ones, whatever it holds
        system.fill_diagonal_(1.0)
    expected = torch.linalg.solve(system.T if transpose_a else system, b)
    kwargs = dict(lower=lower, unit_diagonal=unit_diagonal, transpose_a=transpose_a)
    assert_close(_run(solve, b, a, **kwargs), expected)


def test_every_xla_type_maps_to_a_torch_dtype_and_back():
    for xla_type in xb._XLA_PT_TYPE_MAP:
        assert xb.Op.from_torch_type(xb.Op.to_torch_type(xla_type)) == xla_type
    assert xb.Op.to_torch_type(None) is torch.float32


# --- shapes --------------------------------------------------------------------------------------


def test_tensor_shape_and_op_shapes():
    t = torch.zeros(2, 3, dtype=torch.int64)
    assert xb.tensor_shape(t).shape == {"type": "s64", "sizes": (2, 3)}
    assert [s.dtype for s in xb.tensor_shape([t, t.bool()])] == ["s64", "pred"]
    b = xb.create_builder("shapes")
    x = xb.mkparam(b, 0, xb.mkshape(xb.Type.F32, (2, 3)))
    pair = xb.Op.tuple((x, x.cast(xb.Type.F16)))
    shape = pair.shape()
    assert shape.is_tuple() and shape.tuple_size() == 2
    assert shape.tuple_shape(1) == {"type": "f16", "sizes": (2, 3)}
    assert x.shape().rank == 2 and x.shape().as_scalar().sizes == ()
    assert (x < x).shape().dtype == "pred"
    with pytest.raises(ValueError, match="is a tuple shape"):
        shape.dtype


def test_built_computation_reports_parameter_and_result_shapes():
    comp = xb.create_computation(
        "halves", lambda x: xb.Op.tuple((x, x)), [xb.mkshape(xb.Type.BF16, (4,))]
    )
    assert [s.shape for s in comp.param_shapes] == [{"type": "bf16", "sizes": (4,)}]
    assert comp.result_shape.tuple_size() == 2
    assert repr(comp) == "Computation('halves', (bf16[4]) -> (bf16[4], bf16[4]))"


def test_get_computation_hlo_is_hlo_text():
    comp = xb.create_computation("sq", lambda x: x * x, [xb.mkshape(xb.Type.F32, (3,))])
    text = xb.get_computation_hlo(comp)
    assert "f32[3]{0} multiply(f32[3]{0} %" in text


# --- running on xla tensors ----------------------------------------------------------------------


def test_op_records_one_graph_node_run_at_the_barrier():
    op = xor.register("lazy_add", lambda a, b: a + b)
    dev = spmd_torch.device()
    a, b = _f32(3, seed=27), _f32(3, seed=28)
    out = op(a.to(dev), b.to(dev))
    assert "xla::_op_lazy_add" in graph.pending_text([out])
    assert graph.pending_count() == 1
    spmd_torch.sync()
    assert graph.pending_count() == 0
    assert_close(out.cpu(), a + b)
    assert out.requires_grad is False


def test_same_shapes_build_once_and_compile_once():
    calls = []

    def counted(a):
        calls.append(a.shape().sizes)
        return a * a

    op = xor.register("counted", counted)
    dev = spmd_torch.device()
    with assert_compiles(1):
        for step in range(3):
            out = op(torch.full((2,), float(step)).to(dev))
            spmd_torch.sync()
    assert calls == [(2,)]
    assert out.cpu().tolist() == [4.0, 4.0]
    op(torch.ones(5).to(dev)).cpu()
    assert calls == [(2,), (5,)]


def test_keyword_arguments_build_separate_computations():
    def scaled(a, factor=1.0):
        return a * xb.Op.scalar(a.builder(), factor)

    op = xor.register("scaled", scaled)
    x = torch.ones(2).to(spmd_torch.device())
    assert op(x, factor=2.0).cpu().tolist() == [2.0, 2.0]
    assert op(x, factor=3.0).cpu().tolist() == [3.0, 3.0]


def test_identical_computations_are_equal_and_share_a_program():
    shape = [xb.mkshape(xb.Type.F32, (4,))]
    first = xb.create_computation("inc", lambda x: x + xb.Op.scalar(x.builder(), 1.0), shape)
    again = xb.create_computation("inc", lambda x: x + xb.Op.scalar(x.builder(), 1.0), shape)
    other = xb.create_computation("inc", lambda x: x + xb.Op.scalar(x.builder(), 2.0), shape)
    assert first == again and hash(first) == hash(again)
    assert first != other
    x = torch.zeros(4).to(spmd_torch.device())
    xb.xla_computation_as_func(first, "inc")([x])[0].cpu()
    with assert_compiles(0):
        (result,) = xb.xla_computation_as_func(again, "inc")([x])
        assert result.cpu().tolist() == [1.0] * 4


def test_results_feed_ordinary_ops_in_the_same_program():
    op = xor.register("neg", lambda a: -a)
    a = _f32(4, seed=29)
    with assert_compiles(1):
        out = (op(a.to(spmd_torch.device()) * 2) + 1).cpu()
    assert_close(out, -(a * 2) + 1)


def test_eager_mode_runs_the_op_at_once():
    op = xor.register("eager_double", lambda a: a + a)
    x = torch.ones(3).to(spmd_torch.device())
    with eager_mode_context(True):
        out = op(x)
        assert graph.pending_count() == 0
    assert out.cpu().tolist() == [2.0] * 3


_SQUARE = xor.register("replica_square", lambda a: a * a)


def _square_ordinal() -> float:
    import spmd_torch.runtime as xr

    value = torch.tensor([float(xr.global_ordinal())]).to(spmd_torch.device())
    return _SQUARE(value).item()


def test_op_inside_replicas():
    assert pjrt.run_multiprocess(_square_ordinal) == {k: float(k * k) for k in range(8)}


# --- errors --------------------------------------------------------------------------------------


def test_mismatched_element_types_raise_naming_the_op():
    b = xb.create_builder("bad")
    x = xb.mkparam(b, 0, xb.mkshape(xb.Type.F32, (2,)))
    y = xb.mkparam(b, 1, xb.mkshape(xb.Type.S32, (2,)))
    with pytest.raises(RuntimeError, match=r"XLA op Add\(f32\[2\], s32\[2\]\).*element types"):
        x + y


def test_ranks_that_differ_raise():
    b = xb.create_builder("bad")
    x = xb.mkparam(b, 0, xb.mkshape(xb.Type.F32, (2,)))
    y = xb.mkparam(b, 1, xb.mkshape(xb.Type.F32, (2, 2)))
    with pytest.raises(RuntimeError, match=r"Mul\(f32\[2\], f32\[2,2\]\).*differ in rank"):
        x * y


def test_unknown_op_name_raises():
    b = xb.create_builder("bad")
    x = xb.mkparam(b, 0, xb.mkshape(xb.Type.F32, (2,)))
    with pytest.raises(ValueError, match="Unknown XLA op name: 'Frobnicate'"):
        xb.mkop("Frobnicate", (x.op,))


def test_ops_of_another_builder_raise():
    x = xb.mkparam(xb.create_builder("one"), 0, xb.mkshape(xb.Type.F32, (2,)))
    y = xb.mkparam(xb.create_builder("two"), 0, xb.mkshape(xb.Type.F32, (2,)))
    with pytest.raises(ValueError, match="operand 1 belongs to Builder\\('two'\\)"):
        x + y


def test_dynamic_shapes_raise_not_implemented():
    b = xb.create_builder("dynamic")
    x = xb.mkparam(b, 0, xb.mkshape(xb.Type.F32, (4,)))
    with pytest.raises(NotImplementedError, match="DynamicReshape"):
        x.dynamic_reshape((2, 2))


def test_cpu_tensor_input_raises():
    op = xor.register("cpu_input", lambda a: a + a)
    with pytest.raises(
        RuntimeError, match=r"xla::_op_cpu_input \(input 0\) needs a tensor on the xla device"
    ):
        op(torch.ones(2))


def test_wrong_input_shape_raises_naming_the_input():
    comp = xb.create_computation("fixed", lambda x: x + x, [xb.mkshape(xb.Type.F32, (3,))])
    fn = xb.xla_computation_as_func(comp, "fixed")
    with pytest.raises(ValueError, match=r"input 0 is f32\[4\].*parameter 0 is f32\[3\]"):
        fn([torch.ones(4).to(spmd_torch.device())])


# --- call_jax ------------------------------------------------------------------------------------


def _sin_plus(a, b):
    import jax.numpy as jnp

    return a + jnp.sin(b)


def test_call_jax_runs_a_jax_function_as_one_node():
    a, b = _f32(3, 3, seed=30), _f32(3, 3, seed=31)
    dev = spmd_torch.device()
    out = xb.call_jax(_sin_plus, (a.to(dev), b.to(dev)), {}, "sin_plus")
    assert "xla::sin_plus" in graph.pending_text([out])
    assert_close(out.cpu(), a + torch.sin(b))


def test_call_jax_trees_in_and_out_with_static_leaves():
    def f(inputs, scale, label, none=None):
        assert label == "ten" and none is None
        return {"sum": inputs["a"] * scale + inputs["b"], "pair": (inputs["a"], inputs["b"] * 2)}

    dev = spmd_torch.device()
    a, b = torch.ones(2, 2), torch.full((2, 2), 3.0)
    out = xb.call_jax(f, ({"a": a.to(dev), "b": b.to(dev)}, 10.0, "ten"), {"none": None})
    assert sorted(out) == ["pair", "sum"]
    assert_close(out["sum"].cpu(), a * 10 + b)
    assert_close([t.cpu() for t in out["pair"]], [a, b * 2])


def test_call_jax_of_a_gradient_with_an_unused_input():
    import jax
    import jax.numpy as jnp

    def loss(a, b):
        return jnp.sum(a + jnp.sin(b))

    a, b = _f32(3, seed=32), _f32(3, seed=33)
    dev = spmd_torch.device()
    grad_a, grad_b = xb.call_jax(jax.grad(loss, argnums=(0, 1)), (a.to(dev), b.to(dev)))
    assert_close([grad_a.cpu(), grad_b.cpu()], [torch.ones(3), torch.cos(b)])


def test_call_jax_traces_once_per_shapes_tree_and_static_leaves():
    def g(a, k):
        return a * k

    dev = spmd_torch.device()
    x, y = torch.ones(3).to(dev), torch.ones(2).to(dev)
    before = xb._jax_to_xla_computation_cache_elements()
    for _ in range(2):
        xb.call_jax(g, (x, 2.0))
    xb.call_jax(g, (y, 2.0))
    xb.call_jax(g, (x, 3.0))
    assert xb._jax_to_xla_computation_cache_elements() - before == 3
    spmd_torch.sync()


def test_call_jax_compiles_once_over_steps():
    dev = spmd_torch.device()
    a = torch.zeros(4).to(dev)
    with assert_compiles(1):
        for _ in range(3):
            a = xb.call_jax(_sin_plus, (a, a))
            spmd_torch.sync()
    assert a.cpu().tolist() == [0.0] * 4


def test_call_jax_refuses_cpu_tensors():
    with pytest.raises(
        RuntimeError,
        match=r"xla::jax_func \(tensor argument 1 .*\) needs a tensor on the xla device",
    ):
        xb.call_jax(_sin_plus, (torch.ones(2).to(spmd_torch.device()), torch.ones(2)))


# --- FlattenedInputFunc, XlaCallable -------------------------------------------------------------


def test_flattened_input_func_round_trips_nested_arguments():
    def pick(nested, items, scale=1):
        return {"sum": nested["a"]["b"] * scale + items[2][1], "first": items[0]}

    flat = xb.FlattenedInputFunc(pick)
    t = torch.tensor([1.0, 2.0])
    tensors = flat.preprocess(({"a": {"b": t}}, [5, 0, [0, t + 1]]), {"scale": 3})
    assert len(tensors) == 2
    result = flat.postprocess(flat.flat_call(tensors))
    assert result["first"] == 5
    assert_close(result["sum"], t * 3 + t + 1, tol="exact")


def test_xla_callable_builds_once_per_signature():
    built = []

    def sin_plus(inputs):
        built.append(inputs["a"].shape().sizes)
        return [inputs["a"].sin() + inputs["b"], inputs["b"]]

    fn = xb.XlaCallable(sin_plus)
    dev = spmd_torch.device()
    a, b = _f32(2, 2, seed=34), _f32(2, 2, seed=35)
    for _ in range(2):
        total, same = fn({"a": a.to(dev), "b": b.to(dev)})
    assert_close([total.cpu(), same.cpu()], [torch.sin(a) + b, b])
    fn({"a": torch.ones(3).to(dev), "b": torch.ones(3).to(dev)})[0].cpu()
    assert built == [(2, 2), (3,)]
