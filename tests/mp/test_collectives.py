"""xm's collectives inside launch, on 8 replicas, against numpy references computed from every
replica's input: reduce types, groups, tensor and list inputs, output shapes, two uses in one step,
and the differentiable collectives of core.functions against the gradients worked out by hand."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.core.functions as xf
import spmd_torch.core.xla_model as xm
from spmd_torch.distributed import xla_multiprocessing as xmp
from tests.helpers import assert_close

WORLD = 8
BLOCKS = ((0, 1, 2, 3), (4, 5, 6, 7))
STRIDED = ((0, 2, 4, 6), (1, 3, 5, 7))
GROUPINGS = {"all": None, "blocks": BLOCKS, "strided": STRIDED}


def value(k: int, shape=(2, 4), dtype=np.float32) -> np.ndarray:
    """Replica k's input: distinct per replica, small enough that sums and products, scaled by
    powers of two, stay exact (floating results are compared bit for bit)."""
    base = (np.arange(int(np.prod(shape))) % 5).reshape(shape) - 2
    if dtype == np.bool_:
        return ((base + k) % 3) == 0
    return (
        ((base + k) % 4 + 1).astype(dtype) * (1 if k % 2 else -1)
        if dtype != np.int32
        else (base * (k + 1)).astype(dtype)
    )


def group_of(k: int, groups) -> tuple:
    return tuple(range(WORLD)) if groups is None else next(g for g in groups if k in g)


def launch_each(fn) -> dict:
    """{ordinal: numpy result(s)} of ``fn(index)`` run in every replica."""

    def body(index):
        out = fn(index)
        return (
            [o.cpu().numpy() for o in out] if isinstance(out, (list, tuple)) else out.cpu().numpy()
        )

    return spmd_torch.launch(body)


def to_device(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).to(xm.xla_device())


NUMPY_REDUCE = {
    "sum": lambda xs: np.sum(xs, axis=0),
    "mul": lambda xs: np.prod(xs, axis=0),
    "min": lambda xs: np.min(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
    "and": lambda xs: functools.reduce(np.bitwise_and, xs),
    "or": lambda xs: functools.reduce(np.bitwise_or, xs),
}
CASES = [(t, np.float32) for t in ("sum", "mul", "min", "max")] + [
    (t, d)
    for t in NUMPY_REDUCE
    for d in (np.int32, np.bool_)
    if not (d == np.bool_ and t in ("sum", "mul"))
]


def test_replicas_numbers_that_are_equal_in_some_replicas_only_keep_one_program():
    """Replica 1's ``x * 1.0 + 1.0`` holds two equal numbers where the others' do not: replicas'
    numbers never share an input, so all replicas still run one program (with a collective,
    parting them would be a mismatch error)."""

    def fn(index):
        return xm.all_reduce(xm.REDUCE_SUM, to_device(value(index)) * float(index) + 1.0)

    want = np.sum([value(j) * float(j) + 1.0 for j in range(WORLD)], axis=0)
    for got in launch_each(fn).values():
        assert_close(torch.from_numpy(got), torch.from_numpy(want), tol="exact")


@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_all_reduce_every_type_and_dtype_matches_numpy(grouping):
    groups = GROUPINGS[grouping]

    def fn(index):
        return [
            xm.all_reduce(kind, to_device(value(index, dtype=dtype)), groups=groups)
            for kind, dtype in CASES
        ]

    results = launch_each(fn)
    for k, outs in results.items():
        members = group_of(k, groups)
        for (kind, dtype), got in zip(CASES, outs):
            want = NUMPY_REDUCE[kind]([value(j, dtype=dtype) for j in members])
            np.testing.assert_array_equal(got, want, err_msg=f"{kind} {dtype} replica {k}")


def test_all_reduce_of_a_list_is_in_place_and_scaled():
    def fn(index):
        a = to_device(value(index))
        b = to_device(value(index, shape=(3,), dtype=np.int32))
        returned = xm.all_reduce(xm.REDUCE_SUM, [a, b], scale=0.5)
        assert returned[0] is a and returned[1] is b
        twice = xm.all_reduce(xm.REDUCE_MAX, a * 2, groups=BLOCKS)  # a second collective
        return [a, b, twice]

    for k, (a, b, twice) in launch_each(fn).items():
        total = np.sum([value(j) for j in range(WORLD)], axis=0)
        assert_close(torch.from_numpy(a), torch.from_numpy(total * 0.5), tol="exact")
        # PyTorch/XLA scales in the tensor's dtype: an int32 result times 0.5 is multiplied by 0
        np.testing.assert_array_equal(b, np.zeros(3, np.int32))
        want = np.max([total * 0.5 * 2 for _ in group_of(k, BLOCKS)], axis=0)
        assert_close(torch.from_numpy(twice), torch.from_numpy(want), tol="exact")


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_concatenates_the_group_in_order(grouping, dim):
    groups = GROUPINGS[grouping]
    results = launch_each(lambda index: xm.all_gather(to_device(value(index)), dim, groups))
    for k, got in results.items():
        want = np.concatenate([value(j) for j in group_of(k, groups)], axis=dim)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_all_gather_into_output_and_of_a_list():
    def fn(index):
        out = torch.zeros(16, 4, device=xm.xla_device())
        returned = xm.all_gather(to_device(value(index)), output=out)
        assert returned is out
        pair = xm.all_gather(
            [to_device(value(index)), to_device(value(index, (3,)))], groups=BLOCKS
        )
        return [out] + pair

    for k, (out, a, b) in launch_each(fn).items():
        np.testing.assert_array_equal(out, np.concatenate([value(j) for j in range(WORLD)]))
        members = group_of(k, BLOCKS)
        np.testing.assert_array_equal(a, np.concatenate([value(j) for j in members]))
        np.testing.assert_array_equal(b, np.concatenate([value(j, (3,)) for j in members]))


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_keeps_this_replicas_chunk(grouping, dim):
    groups = GROUPINGS[grouping]
    count = 4 if groups else WORLD
    shape = (8, 8)

    def fn(index):
        return xm.reduce_scatter(
            xm.REDUCE_SUM, to_device(value(index, shape)), 0.25, dim, count, groups=groups
        )

    for k, got in launch_each(fn).items():
        members = group_of(k, groups)
        total = np.sum([value(j, shape) for j in members], axis=0) * 0.25
        want = np.split(total, count, axis=dim)[members.index(k)]
        assert got.shape == want.shape
        assert_close(torch.from_numpy(got), torch.from_numpy(want), tol="exact")


@pytest.mark.parametrize("replicas", [4, 8])
def test_reduce_scatter_into_outputs_given_at_the_inputs_shape(replicas):
    """PyTorch/XLA's test_mp_reduce_scatter passes output tensors shaped like the inputs: they
    become the chunks, as an ``out=`` tensor is resized; the very list comes back."""
    shape = (4, 2 * replicas, 3)

    def body(index):
        inputs = [to_device(value(index + j, shape)) for j in range(3)]
        outputs = [torch.zeros(shape, device=xm.xla_device()) for _ in range(3)]
        got = xm.reduce_scatter(xm.REDUCE_SUM, inputs, 0.5, 1, replicas, output=outputs)
        assert got is outputs
        return [o.cpu().numpy() for o in outputs]

    results = xmp.spawn(body, nprocs=replicas)
    for k, got in results.items():
        for j, chunk in enumerate(got):
            total = np.sum([value(i + j, shape) for i in range(replicas)], axis=0) * 0.5
            want = np.split(total, replicas, axis=1)[k]
            assert_close(torch.from_numpy(chunk), torch.from_numpy(want), tol="exact")


@pytest.mark.parametrize("replicas", [4, 8])
def test_random_device_tensors_saved_by_the_master_replica(tmp_path, replicas):
    """Each replica draws on its own device (its PRNG key lives there); xm.save writes the master's
    values once, every replica waiting for it (PyTorch/XLA's test_mp_save pattern)."""
    path = tmp_path / "state.pt"

    def body(index):
        torch.manual_seed(0)
        spmd_torch.manual_seed(index)
        state = {"a": torch.randn(3, 4, device=xm.xla_device())}
        state["a+1"] = state["a"] + 1
        xm.save(state, str(path))
        return state["a"].cpu()

    drawn = xmp.spawn(body, nprocs=replicas)
    saved = torch.load(path)
    assert_close(saved["a"], drawn[0], tol="exact")
    assert_close(saved["a+1"], drawn[0] + 1)
    assert not torch.equal(drawn[0], drawn[1])  # each replica its own stream


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize(("split", "concat"), [(0, 0), (0, 1), (1, 0)])
def test_all_to_all_exchanges_chunks(grouping, split, concat):
    groups = GROUPINGS[grouping]
    count = 4 if groups else WORLD
    shape = (8, 8)
    results = launch_each(
        lambda index: xm.all_to_all(to_device(value(index, shape)), split, concat, count, groups)
    )
    for k, got in results.items():
        members = group_of(k, groups)
        rank = members.index(k)
        chunks = [np.split(value(j, shape), count, axis=split)[rank] for j in members]
        want = np.concatenate(chunks, axis=concat)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_collective_permute_ring_and_partial():
    ring = [[i, (i + 1) % WORLD] for i in range(WORLD)]

    def fn(index):
        x = to_device(value(index))
        return [xm.collective_permute(x, ring), xm.collective_permute(x, [[0, 5], [5, 0]])]

    for k, (around, partial) in launch_each(fn).items():
        np.testing.assert_array_equal(around, value((k - 1) % WORLD))
        want = value({0: 5, 5: 0}[k]) if k in (0, 5) else np.zeros((2, 4), np.float32)
        np.testing.assert_array_equal(partial, want)


def test_collective_broadcast_overwrites_with_the_roots_values():
    def fn(index):
        tensors = [to_device(value(index)), to_device(value(index, (3,), np.int32))]
        xm.collective_broadcast(tensors, root_ordinal=2)
        return tensors

    for _, (a, b) in launch_each(fn).items():
        np.testing.assert_array_equal(a, value(2))
        np.testing.assert_array_equal(b, value(2, (3,), np.int32))


def test_differentiable_all_reduce_and_all_gather():
    """loss = sum over replicas of sum(w_k * collective(x)_k): each replica's gradient is the
    sum over replicas of what its input contributed, worked out by hand."""
    weights = [np.arange(8, dtype=np.float32).reshape(2, 4) + k for k in range(WORLD)]

    def fn(index):
        x = to_device(value(index)).requires_grad_(True)
        w = to_device(weights[index])
        summed = xf.all_reduce(xm.REDUCE_SUM, x, scale=0.5)
        gathered = xf.all_gather(x * 3, dim=1, groups=BLOCKS)
        loss = (summed * w).sum() + (gathered * gathered).sum()
        loss.backward()
        return x.grad

    for k, grad in launch_each(fn).items():
        members = group_of(k, BLOCKS)
        want = 0.5 * np.sum(weights, axis=0)  # every replica's w reaches x_k through the sum
        want += len(members) * 2 * 9 * value(k)  # each member's gathered copy of 3*x_k, squared
        assert_close(torch.from_numpy(grad), torch.from_numpy(want), tol="exact")
