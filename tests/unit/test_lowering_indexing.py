"""Indexing, view and shape lowerings against the same aten ops run eagerly on CPU torch."""

from __future__ import annotations

import pytest
import torch

from spmd_torch._lazy.lowering import LOWERINGS
from tests.unit._lowering_harness import check, named

aten = torch.ops.aten
_gen = torch.Generator().manual_seed(0)


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reproducible test tensor; integer dtypes get small values (signed ones both signs)."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=_gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=_gen) > 0.5
    low = -9 if dtype.is_signed else 0
    return torch.randint(low, 10, shape, generator=_gen, dtype=dtype)


def _i(*values: object) -> torch.Tensor:
    return torch.tensor(values)


def _perm_rows(rows: int, n: int, k: int) -> torch.Tensor:
    """k distinct indices below n per row: scatter.src without duplicates is deterministic."""
    return torch.stack([torch.randperm(n, generator=_gen)[:k] for _ in range(rows)])


def _case(op, *args: object, jit: bool = True, id: str, **kwargs: object):
    return pytest.param(op, args, kwargs, jit, id=id)


x234 = _t(2, 3, 4)
x56 = _t(5, 6)
x34 = _t(3, 4)
x45 = _t(4, 5)

VIEW_CASES = [
    _case(aten.view.default, x234, [6, -1], id="view-infer"),
    _case(aten._unsafe_view.default, x234, [4, 6], id="unsafe_view"),
    _case(aten.view_copy.default, x234, [24], id="view_copy"),
    _case(aten._reshape_alias.default, x234, [3, 8], [8, 1], id="reshape_alias"),
    _case(aten.view.dtype, x34, torch.int32, id="view_dtype-same-width"),
    _case(aten.view.dtype, x34, torch.int16, id="view_dtype-narrower"),
    _case(aten.view.dtype, _t(2, 4, dtype=torch.int16), torch.float32, id="view_dtype-wider"),
    _case(aten.alias.default, x34, id="alias"),
    _case(aten.alias_copy.default, x34, id="alias_copy"),
    _case(aten.permute.default, x234, [2, 0, 1], id="permute"),
    _case(aten.permute.default, x234, [-1, 0, 1], id="permute-negative"),
    _case(aten.permute_copy.default, x234, [1, 2, 0], id="permute_copy"),
    _case(aten.t.default, x34, id="t-2d"),
    _case(aten.t.default, _t(5), id="t-1d"),
    _case(aten.t_copy.default, x34, id="t_copy"),
    _case(aten.transpose.int, x234, 0, -1, id="transpose"),
    _case(aten.transpose_copy.int, x234, 1, 2, id="transpose_copy"),
    _case(aten.expand.default, _t(3, 1), [2, 3, 4], id="expand-new-axis"),
    _case(aten.expand.default, _t(3, 1), [-1, 5], id="expand-minus-one"),
    _case(aten.expand.default, _t(3, 1), [2, -1, -1], id="expand-minus-one-new-axis"),
    _case(aten.expand_copy.default, _t(1), [4], id="expand_copy"),
    _case(aten.select.int, x234, 1, -1, id="select-negative"),
    _case(aten.select.int, x234, 0, 1, id="select"),
    _case(aten.select_copy.int, x234, -1, 2, id="select_copy-negative-dim"),
    _case(aten.slice.Tensor, x56, 1, None, None, id="slice-none"),
    _case(aten.slice.Tensor, x56, 0, -3, None, id="slice-negative-start"),
    _case(aten.slice.Tensor, x56, 1, 1, 100, id="slice-clamped-end"),
    _case(aten.slice.Tensor, x56, 1, 0, 6, 2, id="slice-step"),
    _case(aten.slice.Tensor, x56, 0, -100, -2, id="slice-clamped-start"),
    _case(aten.slice.Tensor, x56, 1, 4, 2, id="slice-empty"),
    _case(aten.slice.Tensor, x56, -1, 1, 9223372036854775807, 3, id="slice-int64-max-end"),
    _case(aten.slice.Tensor, x56, id="slice-defaults"),
    _case(aten.slice_copy.Tensor, x56, 0, 1, 3, id="slice_copy"),
    _case(aten.unsqueeze.default, x34, -1, id="unsqueeze-negative"),
    _case(aten.unsqueeze.default, x34, 0, id="unsqueeze"),
    _case(aten.unsqueeze_copy.default, x34, 1, id="unsqueeze_copy"),
    _case(aten.squeeze.default, _t(1, 3, 1), id="squeeze-all"),
    _case(aten.squeeze.dim, _t(1, 3, 1), 1, id="squeeze-dim-not-one"),
    _case(aten.squeeze.dim, _t(1, 3, 1), -1, id="squeeze-dim-negative"),
    _case(aten.squeeze.dims, _t(1, 3, 1), [0, 1, 2], id="squeeze-dims"),
    _case(aten.squeeze.dim, torch.tensor(2.0), 0, id="squeeze-0d"),
    _case(aten.squeeze_copy.dims, _t(1, 3, 1), [-1], id="squeeze_copy-dims"),
    _case(aten.diagonal.default, x45, id="diagonal"),
    _case(aten.diagonal.default, x45, 1, id="diagonal-offset"),
    _case(aten.diagonal.default, x45, -2, id="diagonal-negative-offset"),
    _case(aten.diagonal.default, x234, 0, 2, 1, id="diagonal-dims"),
    _case(aten.diagonal.default, x234, 1, -1, 0, id="diagonal-negative-dim"),
    _case(aten.diagonal.default, x34, 5, id="diagonal-empty"),
    _case(aten.diagonal_copy.default, x34, -1, id="diagonal_copy"),
    _case(aten.as_strided.default, x45, [3, 3], [5, 1], id="as_strided"),
    _case(aten.as_strided.default, x45, [3, 3], [5, 1], 2, id="as_strided-offset"),
    _case(aten.as_strided.default, x45, [2, 4], [1, 5], id="as_strided-transposed"),
    _case(aten.as_strided.default, x45, [3, 3], [1, 1], id="as_strided-overlapping"),
    _case(aten.as_strided.default, x45, [], [], 7, id="as_strided-0d"),
    _case(aten.as_strided_copy.default, x45, [2, 2], [10, 2], 1, id="as_strided_copy"),
    _case(aten.unfold.default, _t(2, 7), 1, 3, 2, id="unfold"),
    _case(aten.unfold.default, _t(6), 0, 2, 2, id="unfold-1d"),
    _case(aten.unfold.default, x34, 0, 3, 1, id="unfold-whole"),
    _case(aten.unfold.default, _t(2, 7), -1, 3, 3, id="unfold-negative-dim"),
    _case(aten.unfold_copy.default, x234, 1, 2, 1, id="unfold_copy"),
    _case(aten.unfold.default, torch.tensor(2.0), 0, 1, 1, id="unfold-0d"),
    _case(aten.split.Tensor, _t(5, 2), 2, id="split-remainder"),
    _case(aten.split.Tensor, _t(2, 6), 3, 1, id="split-dim"),
    _case(aten.split.Tensor, _t(0), 2, id="split-empty"),
    _case(aten.split_copy.Tensor, _t(5, 2), 4, id="split_copy"),
    _case(aten.unsafe_split.Tensor, _t(5, 2), 3, id="unsafe_split"),
    _case(aten.split_with_sizes.default, _t(5, 2), [2, 3], id="split_with_sizes"),
    _case(aten.split_with_sizes.default, _t(2, 5), [1, 0, 4], -1, id="split_with_sizes-zero"),
    _case(aten.split_with_sizes_copy.default, _t(5, 2), [4, 1], id="split_with_sizes_copy"),
    _case(aten.unbind.int, _t(3, 2), id="unbind"),
    _case(aten.unbind.int, _t(2, 3), -1, id="unbind-negative-dim"),
    _case(aten.unbind_copy.int, _t(2, 3), 1, id="unbind_copy"),
]

SCATTER_BACK_CASES = [
    _case(aten.slice_scatter.default, x56, _t(5, 2), 1, 1, 5, 2, id="slice_scatter-step"),
    _case(aten.slice_scatter.default, x56, _t(2, 6), 0, -2, None, id="slice_scatter-negative"),
    _case(aten.slice_scatter.default, x56, _t(5, 6), id="slice_scatter-defaults"),
    _case(aten.slice_scatter.default, x56, _t(5, 4), 1, 2, 100, id="slice_scatter-clamped"),
    _case(aten.select_scatter.default, x34, _t(4), 0, -1, id="select_scatter-negative"),
    _case(aten.select_scatter.default, x34, _t(3), 1, 2, id="select_scatter"),
    _case(aten.diagonal_scatter.default, x34, _t(3), id="diagonal_scatter"),
    _case(aten.diagonal_scatter.default, x34, _t(3), 1, id="diagonal_scatter-offset"),
    _case(aten.diagonal_scatter.default, x34, _t(2), -1, id="diagonal_scatter-negative-offset"),
    _case(aten.diagonal_scatter.default, x234, _t(2, 3), 0, 1, 2, id="diagonal_scatter-batched"),
    _case(aten.diagonal_scatter.default, x234, _t(3, 1), 1, 2, 0, id="diagonal_scatter-dims"),
    _case(aten.diagonal_scatter.default, x34, _t(3), 0, 1, 0, id="diagonal_scatter-swapped"),
    _case(
        aten.as_strided_scatter.default, x45, _t(3, 3), [3, 3], [5, 1], 1, id="as_strided_scatter"
    ),
    _case(
        aten.as_strided_scatter.default,
        x45,
        _t(2, 2),
        [2, 2],
        [1, 5],
        id="as_strided_scatter-transposed",
    ),
]

x54 = _t(5, 4)
x456 = _t(4, 5, 6)
x0, s0 = torch.tensor(2.0), torch.tensor(5.0)  # 0-d self and src: index ops treat them as 1-d
INDEX_CASES = [
    _case(aten.index.Tensor, x54, [_i(0, 3, 3)], id="index"),
    _case(aten.index.Tensor, x54, [None, _i(1, -1)], id="index-none-negative"),
    _case(aten.index.Tensor, x54, [_i([0], [4]), _i(1, 2, 3)], id="index-broadcast"),
    _case(aten.index.Tensor, x456, [_i(0, 1), None, _i(2, 5)], id="index-separated"),
    _case(aten.index.Tensor, x456, [None, _i(0, 1), _i(2, 5)], id="index-adjacent"),
    _case(aten.index.Tensor, x54, [torch.tensor(2)], id="index-0d"),
    _case(aten.index.Tensor, _t(5, 4, dtype=torch.int64), [_i(4, 0)], id="index-int64"),
    _case(aten.index.Tensor, x54, [_t(5, dtype=torch.bool)], jit=False, id="index-mask-eager"),
    _case(aten.index_put.default, x54, [_i(0, 3, 1)], _t(3, 4), id="index_put"),
    _case(aten.index_put.default, x54, [_i(0, 0, 2)], _t(3, 4), True, id="index_put-accumulate"),
    _case(aten.index_put.default, x54, [None, _i(-1, 1)], _t(5, 2), id="index_put-none"),
    _case(
        aten.index_put.default, x54, [_i(1, 2), _i(3, 0)], torch.tensor(7.0), id="index_put-pairs"
    ),
    _case(aten.index_put.default, x456, [_i(0, 1), None, _i(2, 5)], _t(2, 5), id="index_put-split"),
    _case(
        aten.index_put.default,
        x54,
        [_i(1, 1), _i(3, 3)],
        _i(1.0, 2.0),
        True,
        id="index_put-pairs-accumulate-duplicates",
    ),
    _case(aten.index_put.default, x54, [x54 > 0], torch.tensor(0.0), id="index_put-mask"),
    _case(aten.index_put.default, x54, [x54 > 0], torch.tensor(1.5), True, id="index_put-mask-add"),
    _case(
        aten.index_put.default, x54, [x54[:, 0] > 0], _t(4), id="index_put-row-mask-broadcast-row"
    ),
    _case(
        aten.index_put.default,
        x54,
        [torch.tensor([True, False, True, True, False])],
        _t(3, 4),
        id="index_put-row-mask-values",
    ),
    _case(
        aten.index_put.default,
        x456,
        [None, x456[0] > 0],
        _t(4, int((x456[0] > 0).sum())),
        id="index_put-inner-mask-values",
    ),
    _case(
        aten.index_put.default,
        x54,
        [torch.tensor([True, False, False, True, False])],
        _t(2, 4),
        True,
        id="index_put-row-mask-accumulate",
    ),
    _case(aten.index_select.default, x54, 1, _i(3, 0, 3), id="index_select"),
    _case(aten.index_select.default, x54, 0, torch.tensor(2), id="index_select-0d-index"),
    _case(aten.index_select.default, x456, -1, _i(5, 1), id="index_select-negative-dim"),
    _case(aten.gather.default, x34, 1, _i([0, 3], [1, 1], [2, 0]), id="gather"),
    _case(aten.gather.default, x34, 0, _i([0, 2, 1, 0], [2, 2, 0, 1]), id="gather-dim0"),
    _case(aten.gather.default, x34, 1, _i([3, 0], [1, 2]), id="gather-smaller-index"),
    _case(aten.gather.default, x234, -1, _i([[1], [3]]), id="gather-negative-dim"),
    _case(aten.scatter.src, x45, 1, _perm_rows(4, 5, 2), _t(4, 5), id="scatter-src"),
    _case(aten.scatter.src, x45, 1, _perm_rows(3, 5, 2), _t(4, 5), id="scatter-src-smaller-index"),
    _case(aten.scatter.value, x45, 1, _perm_rows(4, 5, 3), 2.5, id="scatter-value"),
    _case(aten.scatter_add.default, x45, 0, _i([0, 0, 3], [1, 1, 1]), _t(2, 4), id="scatter_add"),
    _case(
        aten.scatter.reduce,
        x45,
        1,
        _i([0, 0], [4, 4]),
        _t(2, 3),
        reduce="add",
        id="scatter-reduce-add",
    ),
    _case(
        aten.scatter.reduce,
        x45,
        1,
        _i([0, 0], [4, 4]),
        _t(2, 3),
        reduce="multiply",
        id="scatter-mul",
    ),
    _case(aten.scatter.value_reduce, x45, 0, _i([1, 1]), 3.0, reduce="add", id="scatter-value-add"),
    _case(
        aten.scatter.value_reduce,
        x45,
        0,
        _i([1, 1]),
        3.0,
        reduce="multiply",
        id="scatter-value-mul",
    ),
    _case(aten.index_add.default, _t(5, 3), 0, _i(0, 4, 0, 2), _t(4, 3), id="index_add"),
    _case(aten.index_add.default, _t(3, 5), 1, _i(1, 1), _t(3, 2), alpha=2, id="index_add-alpha"),
    _case(aten.index_copy.default, _t(5, 3), 0, _i(4, 0, 2), _t(3, 3), id="index_copy"),
    _case(aten.index_copy.default, _t(3, 5), -1, _i(3, 1), _t(3, 2), id="index_copy-negative-dim"),
    _case(aten.index_fill.int_Scalar, x45, 1, _i(0, 3), -1.0, id="index_fill-scalar"),
    _case(aten.index_fill.int_Tensor, x45, 0, _i(2), torch.tensor(5.0), id="index_fill-tensor"),
    _case(aten.index_select.default, x0, 0, _i(0), id="index_select-0d"),
    _case(aten.gather.default, x0, 0, _i(0, 0), id="gather-0d-self"),
    _case(aten.gather.default, _t(5), 0, _i([], []).long(), id="gather-empty-index"),
    _case(aten.scatter.src, x0, -1, torch.tensor(0), s0, id="scatter-0d"),
    _case(aten.scatter_add.default, x0, 0, torch.tensor(0), s0, id="scatter_add-0d"),
    _case(aten.index_add.default, x0, 0, _i(0), s0, alpha=2, id="index_add-0d"),
    _case(aten.index_copy.default, x0, 0, _i(0), s0, id="index_copy-0d"),
    _case(aten.index_fill.int_Scalar, x0, -1, _i(0), 7.0, id="index_fill-0d"),
    _case(aten.masked_scatter.default, x34, x34 > 0, _t(12), id="masked_scatter"),
    _case(aten.masked_scatter.default, x34, x34[0] > 0, _t(15), id="masked_scatter-broadcast"),
    _case(aten.masked_scatter.default, x34, x34 > 99, _t(0), id="masked_scatter-empty-source"),
]


def _scatter_reduce_cases() -> list:
    index = _i([0, 0, 2], [1, 3, 1])
    cases = []
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            name = f"scatter_reduce-{reduce}-{'self' if include_self else 'noself'}"
            cases.append(
                _case(
                    aten.scatter_reduce.two,
                    x45,
                    1,
                    index,
                    _t(2, 3),
                    reduce,
                    include_self=include_self,
                    id=name,
                )
            )
    int_self = _t(4, 5, dtype=torch.int64)
    int_src = _t(2, 3, dtype=torch.int64)
    for include_self in (True, False):
        cases.append(
            _case(
                aten.scatter_reduce.two,
                int_self,
                1,
                index,
                int_src,
                "mean",
                include_self=include_self,
                id=f"scatter_reduce-mean-int64-{include_self}",
            )
        )
    return cases


SHAPE_CASES = [
    _case(aten.cat.default, [_t(2, 3), _t(1, 3)], id="cat"),
    _case(aten.cat.default, [_t(2, 3), _t(2, 1)], -1, id="cat-negative-dim"),
    _case(aten.cat.default, [_t(2, 3), _t(0), _t(1, 3)], id="cat-skips-empty-1d"),
    _case(aten.cat.default, [_t(0), _t(0)], id="cat-all-empty"),
    _case(aten.cat.default, [_t(2, dtype=torch.int64), _t(3)], id="cat-promotes"),
    _case(
        aten.cat.default,
        [_t(2, dtype=torch.int32), _t(0, dtype=torch.float64)],
        id="cat-empty-promotes",
    ),
    _case(aten.stack.default, [_t(2, 3), _t(2, 3)], id="stack"),
    _case(aten.stack.default, [_t(2, 3), _t(2, 3)], -1, id="stack-negative-dim"),
    _case(
        aten.stack.default, [_t(2, dtype=torch.int8), _t(2, dtype=torch.uint8)], id="stack-promotes"
    ),
    _case(aten.constant_pad_nd.default, x34, [1, 2], id="constant_pad"),
    _case(aten.constant_pad_nd.default, x34, [1, 1, 2, 0], 3.5, id="constant_pad-value"),
    _case(aten.constant_pad_nd.default, x34, [-1, 2], id="constant_pad-crop"),
    _case(aten.constant_pad_nd.default, x234, [0, 0, -1, -1, 1, 0], id="constant_pad-3d-crop"),
    _case(aten.constant_pad_nd.default, _t(3, dtype=torch.int64), [2, 1], 7, id="constant_pad-int"),
    _case(aten.reflection_pad1d.default, _t(2, 3, 5), [2, 1], id="reflection_pad1d"),
    _case(aten.reflection_pad1d.default, _t(3, 5), [2, 2], id="reflection_pad1d-unbatched"),
    _case(aten.reflection_pad2d.default, _t(1, 2, 4, 5), [1, 2, 3, 1], id="reflection_pad2d"),
    _case(
        aten.reflection_pad3d.default, _t(1, 1, 3, 4, 5), [1, 1, 2, 0, 1, 2], id="reflection_pad3d"
    ),
    _case(aten.replication_pad1d.default, _t(2, 3, 5), [2, 1], id="replication_pad1d"),
    _case(aten.replication_pad1d.default, _t(2, 3, 5), [-2, 1], id="replication_pad1d-crop"),
    _case(
        aten.replication_pad2d.default, _t(2, 4, 4), [-4, 5, 2, -1], id="replication_pad2d-crop-all"
    ),
    _case(
        aten.replication_pad2d_backward.default,
        _t(2, 5, 5),
        _t(2, 4, 4),
        [-4, 5, 2, -1],
        id="replication_pad2d_backward-crop-all",
    ),
    _case(aten.replication_pad2d.default, _t(2, 4, 5), [3, 0, 1, 4], id="replication_pad2d"),
    _case(
        aten.replication_pad3d.default,
        _t(1, 1, 3, 4, 5),
        [1, 1, 2, 0, 1, 2],
        id="replication_pad3d",
    ),
    _case(aten.flip.default, x234, [0], id="flip"),
    _case(aten.flip.default, x234, [0, -1], id="flip-two"),
    _case(aten.flip.default, x234, [], id="flip-none"),
    _case(aten.roll.default, x34, [2], id="roll-flattened"),
    _case(aten.roll.default, x34, [1, -2], [0, 1], id="roll-dims"),
    _case(aten.roll.default, x34, [5], [-1], id="roll-wraps"),
    _case(aten.repeat.default, _t(2, 3), [2, 1, 3], id="repeat-new-axis"),
    _case(aten.repeat.default, _t(2, 3), [1, 1], id="repeat-identity"),
    _case(aten.repeat.default, _t(2, 3), [0, 2], id="repeat-zero"),
    _case(aten.tril.default, x45, id="tril"),
    _case(aten.tril.default, x234, -1, id="tril-batched-negative"),
    _case(aten.triu.default, x45, 1, id="triu"),
    _case(aten.triu.default, _t(4, 4, dtype=torch.int64), -2, id="triu-int"),
]

CASES = VIEW_CASES + SCATTER_BACK_CASES + INDEX_CASES + _scatter_reduce_cases() + SHAPE_CASES


@pytest.mark.parametrize(("op", "args", "kwargs", "jit"), CASES)
def test_lowering_matches_eager_torch(op, args, kwargs, jit):
    check(op, *args, cast=True, tol=named("data_movement"), jit=jit, **kwargs)


def test_nonzero_is_not_lowered():
    """nonzero's output shape depends on the data: the engine must fall back, not trace it."""
    assert aten.nonzero.default not in LOWERINGS
