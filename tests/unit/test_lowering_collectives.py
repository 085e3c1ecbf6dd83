"""Replica collective lowerings run inside one shard_map over the replica axis (8 virtual CPU
devices, 4 for some cases), against numpy references written from torch_xla's definitions."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from spmd_torch._lazy.lowering import LOWERINGS
from spmd_torch._lazy.lowering.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_PERMUTE,
    REDUCE_SCATTER,
    REPLICA_AXIS,
)

BLOCKS = ((0, 1, 2, 3), (4, 5, 6, 7))
STRIDED = ((0, 2, 4, 6), (1, 3, 5, 7))
GROUPS = [
    pytest.param(None, id="all"),
    pytest.param(BLOCKS, id="blocks"),
    pytest.param(STRIDED, id="strided"),
]
_NP_REDUCE = {
    "sum": np.sum,
    "mul": np.prod,
    "min": np.min,
    "max": np.max,
    "and": np.bitwise_and.reduce,
    "or": np.bitwise_or.reduce,
}
_RNG = np.random.default_rng(0)


def _values(shape: tuple, dtype=np.float32, n: int = 8) -> np.ndarray:
    """Per-replica values stacked on axis 0: positive floats (sums stay well conditioned), small
    integers, coin-flip bools."""
    if dtype == np.bool_:
        return _RNG.random((n, *shape)) > 0.5
    if np.issubdtype(dtype, np.integer):
        return _RNG.integers(-3, 4, (n, *shape)).astype(dtype)
    return _RNG.uniform(0.5, 1.5, (n, *shape)).astype(dtype)


def _run(fn, *stacked: np.ndarray, n: int = 8):
    """fn on each replica's value inside one shard_map over ``n`` devices; results stacked."""
    mesh = Mesh(np.array(jax.devices()[:n]), (REPLICA_AXIS,))

    def body(*blocks):
        outputs = fn(*(block.reshape(block.shape[1:]) for block in blocks))
        return jax.tree.map(lambda out: out[None], outputs)

    spec = PartitionSpec(REPLICA_AXIS)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.tree.map(np.asarray, jax.jit(mapped)(*stacked))


def _lowering(op, axis=REPLICA_AXIS):
    """The lowering of ``op`` over ``axis`` (each collective node's last argument)."""
    return functools.partial(LOWERINGS[op].fn, axis=axis)


def _assert_matches(got: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype and shape; integers and bools exactly, floats within rtol 1e-6."""
    assert got.dtype == expected.dtype, f"dtype {got.dtype} != {expected.dtype}"
    assert got.shape == expected.shape, f"shape {got.shape} != {expected.shape}"
    if np.issubdtype(expected.dtype, np.floating):
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got, expected)


def _each_group(groups, n: int):
    return groups or (tuple(range(n)),)


def _ref_all_reduce(values: np.ndarray, reduce_type: str, scale: float, groups) -> np.ndarray:
    out = np.empty_like(values)
    for group in _each_group(groups, len(values)):
        reduced = _NP_REDUCE[reduce_type](values[list(group)], axis=0).astype(values.dtype)
        if scale != 1.0:
            reduced = reduced * np.asarray(scale).astype(values.dtype)
        out[list(group)] = reduced
    return out


def _ref_all_gather(values: np.ndarray, dim: int, groups) -> np.ndarray:
    out = [None] * len(values)
    for group in _each_group(groups, len(values)):
        for ordinal in group:
            out[ordinal] = np.concatenate([values[m] for m in group], axis=dim)
    return np.stack(out)


def _ref_reduce_scatter(values, reduce_type, scale, dim, groups) -> np.ndarray:
    reduced = _ref_all_reduce(values, reduce_type, scale, groups)
    out = [None] * len(values)
    for group in _each_group(groups, len(values)):
        for rank, ordinal in enumerate(group):
            out[ordinal] = np.split(reduced[ordinal], len(group), axis=dim)[rank]
    return np.stack(out)


def _ref_all_to_all(values: np.ndarray, split: int, concat: int, groups) -> np.ndarray:
    out = [None] * len(values)
    for group in _each_group(groups, len(values)):
        for rank, ordinal in enumerate(group):
            chunks = [np.split(values[m], len(group), axis=split)[rank] for m in group]
            out[ordinal] = np.concatenate(chunks, axis=concat)
    return np.stack(out)


def _ref_permute(values: np.ndarray, pairs) -> np.ndarray:
    out = np.zeros_like(values)
    for source, target in pairs:
        out[target] = values[source]
    return out


REDUCE_CASES = [
    pytest.param(dtype, reduce_type, id=f"{np.dtype(dtype).name}-{reduce_type}")
    for dtype, reduce_types in (
        (np.float32, ("sum", "mul", "min", "max")),
        (np.int32, ("sum", "mul", "min", "max", "and", "or")),
        (np.bool_, ("sum", "mul", "min", "max", "and", "or")),
    )
    for reduce_type in reduce_types
]


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("dtype, reduce_type", REDUCE_CASES)
def test_all_reduce_matches_reduction_over_group(dtype, reduce_type, groups):
    values = _values((3, 4), dtype)
    (got,) = _run(lambda x: _lowering(ALL_REDUCE)((x,), reduce_type, 1.0, groups), values)
    _assert_matches(got, _ref_all_reduce(values, reduce_type, 1.0, groups))


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize(
    "dtype, reduce_type, scale",
    [
        pytest.param(np.float32, "sum", 0.125, id="float32-sum"),
        pytest.param(np.float32, "max", 3.0, id="float32-max"),
        pytest.param(np.int32, "sum", 3.0, id="int32-sum"),
    ],
)
def test_all_reduce_scales_after_reduction(dtype, reduce_type, scale, groups):
    values = _values((5,), dtype)
    (got,) = _run(lambda x: _lowering(ALL_REDUCE)((x,), reduce_type, scale, groups), values)
    _assert_matches(got, _ref_all_reduce(values, reduce_type, scale, groups))


@pytest.mark.parametrize("groups", [GROUPS[0], GROUPS[2]])
@pytest.mark.parametrize("reduce_type", ["sum", "max"])
def test_all_reduce_list_of_mixed_shapes_and_dtypes(reduce_type, groups):
    values = (_values((3, 4)), _values((5,), np.int32), _values((2, 3), np.bool_))
    got = _run(lambda *xs: _lowering(ALL_REDUCE)(xs, reduce_type, 1.0, groups), *values)
    assert len(got) == len(values)
    for g, v in zip(got, values, strict=True):
        _assert_matches(g, _ref_all_reduce(v, reduce_type, 1.0, groups))


def test_all_reduce_on_four_replicas():
    values, groups = _values((6,), n=4), ((0, 3), (1, 2))
    (got,) = _run(lambda x: _lowering(ALL_REDUCE)((x,), "mul", 1.0, groups), values, n=4)
    _assert_matches(got, _ref_all_reduce(values, "mul", 1.0, groups))


def test_all_reduce_bitwise_on_floats_names_op_and_dtype():
    with pytest.raises(ValueError, match=r"all_reduce: reduce type 'and' .* float32\[3\]"):
        _run(lambda x: _lowering(ALL_REDUCE)((x,), "and", 1.0, None), _values((3,)))


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_concatenates_group_in_order(dim, groups):
    values = _values((2, 3))
    got = _run(lambda x: _lowering(ALL_GATHER)(x, dim, groups), values)
    _assert_matches(got, _ref_all_gather(values, dim, groups))


@pytest.mark.parametrize("groups", [None, ((0, 1), (2, 3))], ids=["all", "pairs"])
def test_all_gather_on_four_replicas(groups):
    values = _values((2, 3), np.int32, n=4)
    got = _run(lambda x: _lowering(ALL_GATHER)(x, 1, groups), values, n=4)
    _assert_matches(got, _ref_all_gather(values, 1, groups))


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize(
    "dtype, reduce_type, scale",
    [
        pytest.param(np.float32, "sum", 0.5, id="float32-sum-scaled"),
        pytest.param(np.int32, "sum", 1.0, id="int32-sum"),
        pytest.param(np.float32, "max", 1.0, id="float32-max"),
    ],
)
def test_reduce_scatter_keeps_rank_chunk(dtype, reduce_type, scale, dim, groups):
    values, shard_count = _values((8, 8), dtype), 4 if groups else 8
    args = (reduce_type, scale, dim, shard_count, groups)
    got = _run(lambda x: _lowering(REDUCE_SCATTER)(x, *args), values)
    _assert_matches(got, _ref_reduce_scatter(values, reduce_type, scale, dim, groups))


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("split, concat", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_all_to_all_sends_chunk_rank_to_each_member(split, concat, groups):
    values, split_count = _values((8, 16), np.int32), 4 if groups else 8
    got = _run(lambda x: _lowering(ALL_TO_ALL)(x, split, concat, split_count, groups), values)
    _assert_matches(got, _ref_all_to_all(values, split, concat, groups))


@pytest.mark.parametrize(
    "pairs",
    [
        pytest.param(tuple((i, (i + 1) % 8) for i in range(8)), id="ring"),
        pytest.param(((0, 3), (3, 0), (5, 6)), id="partial"),
    ],
)
def test_collective_permute_zero_fills_replicas_receiving_nothing(pairs):
    values = _values((2, 3))
    got = _run(lambda x: _lowering(COLLECTIVE_PERMUTE)(x, pairs), values)
    _assert_matches(got, _ref_permute(values, pairs))


def test_all_reduce_twice_in_one_body():
    values = _values((4,), np.int32)

    def body(x):
        (summed,) = _lowering(ALL_REDUCE)((x,), "sum", 1.0, BLOCKS)
        return summed, _lowering(ALL_REDUCE)((summed,), "max", 1.0, STRIDED)[0]

    summed, maxed = _run(body, values)
    expected = _ref_all_reduce(values, "sum", 1.0, BLOCKS)
    _assert_matches(summed, expected)
    _assert_matches(maxed, _ref_all_reduce(expected, "max", 1.0, STRIDED))


@pytest.mark.parametrize("groups", GROUPS)
def test_all_to_all_twice_in_one_body(groups):
    values, split_count = _values((8, 4), np.int32), 4 if groups else 8

    def body(x):
        once = _lowering(ALL_TO_ALL)(x, 0, 1, split_count, groups)
        return _lowering(ALL_TO_ALL)(once, 1, 0, split_count, groups)

    _assert_matches(_run(body, values), values)  # splitting back along the concat dim: a round trip


# --- a world of one: no axis, each collective is the value one replica alone gets ----------------


def test_world_of_one_all_reduce_scales_its_own_values():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (out,) = _lowering(ALL_REDUCE, None)((x,), "sum", 0.5, None)
    np.testing.assert_array_equal(np.asarray(out), x * 0.5)
    (out,) = _lowering(ALL_REDUCE, None)((x > 2,), "and", 1.0, ((0,),))
    np.testing.assert_array_equal(np.asarray(out), x > 2)


def test_world_of_one_gather_scatter_and_all_to_all_are_its_value():
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    np.testing.assert_array_equal(np.asarray(_lowering(ALL_GATHER, None)(x, 1, None)), x)
    scattered = _lowering(REDUCE_SCATTER, None)(x, "max", 1.0, 0, 1, None)
    np.testing.assert_array_equal(np.asarray(scattered), x)
    np.testing.assert_array_equal(np.asarray(_lowering(ALL_TO_ALL, None)(x, 0, 1, 1, None)), x)


def test_world_of_one_permute_keeps_only_what_it_sends_itself():
    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(np.asarray(_lowering(COLLECTIVE_PERMUTE, None)(x, ((0, 0),))), x)
    assert not np.asarray(_lowering(COLLECTIVE_PERMUTE, None)(x, ())).any()
