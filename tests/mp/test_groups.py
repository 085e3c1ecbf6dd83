"""Process groups over some of the replicas (``dist.new_group(ranks)``): each collective reaches
only its group's members, every replica calling it on its own group; DistributedDataParallel over
subgroups; and the replication helpers ``xm.set_replication`` and ``xmp.MpModelWrapper``."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.xla_backend  # noqa: F401  (registers 'xla' and 'xla://')
import spmd_torch.distributed.xla_multiprocessing as xmp
from spmd_torch._lazy.replicas import CollectiveMismatchError
from tests.helpers import assert_close
from tests.mp._training import averaged_gradient_reference, net, train_replica

DEPRECATED_ALIASES = pytest.mark.filterwarnings("ignore:`torch.distributed.*:FutureWarning")

# Partitions of the replicas into groups, by name: each replica calls the collective on its own.
PARTITIONS = {
    "pairs-4": (4, [[0, 1], [2, 3]]),
    "strided-8": (8, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    "quarters-8": (8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
}
UNEVEN = {"three-and-one-4": (4, [[0, 1, 2], [3]]), "uneven-8": (8, [[0, 5], [1, 2, 3, 4, 6, 7]])}


def _launch(replicas: int, partition: list, fn, *args) -> list:
    """``fn(index, group, *args)`` in each of ``replicas`` replicas, ``group`` the replica's own
    group of ``partition`` (every replica creates every group, in the same order, as
    torch.distributed requires); results in ordinal order."""

    def replica(index, *args):
        dist.init_process_group("xla", init_method="xla://")
        try:
            mine = None
            for ranks in partition:
                group = dist.new_group(ranks)
                if index in ranks:
                    mine = group
            return fn(index, mine, *args)
        finally:
            dist.destroy_process_group()

    results = xmp.spawn(replica, args=args, nprocs=replicas)
    return [results[i] for i in range(replicas)]


def _per_replica(index: int, shape=(5,)) -> np.ndarray:
    rng = np.random.default_rng(200 + index)
    return (rng.standard_normal(shape) * 3).astype(np.float32)


def _on_device(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).to(xm.xla_device())


def _group_of(index: int, partition: list) -> list:
    return next(ranks for ranks in partition if index in ranks)


_REDUCTIONS = {
    "SUM": (dist.ReduceOp.SUM, lambda x: x.sum(0)),
    "AVG": (dist.ReduceOp.AVG, lambda x: x.mean(0)),
    "MAX": (dist.ReduceOp.MAX, lambda x: x.max(0)),
    "MIN": (dist.ReduceOp.MIN, lambda x: x.min(0)),
}


@pytest.mark.parametrize("name", [*PARTITIONS, *UNEVEN])
@pytest.mark.parametrize("op", list(_REDUCTIONS))
def test_all_reduce_on_a_subgroup_reduces_only_its_members(name, op):
    replicas, partition = {**PARTITIONS, **UNEVEN}[name]
    reduce_op, reference = _REDUCTIONS[op]

    def fn(index, group):
        tensor = _on_device(_per_replica(index))
        dist.all_reduce(tensor, op=reduce_op, group=group)
        return tensor.cpu()

    for index, result in enumerate(_launch(replicas, partition, fn)):
        members = np.stack([_per_replica(k) for k in _group_of(index, partition)])
        assert_close(result, torch.from_numpy(reference(members)), tol="single_op")


@pytest.mark.parametrize("name", list(PARTITIONS))
def test_all_gather_on_a_subgroup_gathers_its_members_in_group_order(name):
    replicas, partition = PARTITIONS[name]
    size = len(partition[0])

    def fn(index, group):
        outputs = [torch.zeros(2, 3, device=xm.xla_device()) for _ in range(size)]
        dist.all_gather(outputs, _on_device(_per_replica(index, shape=(2, 3))), group=group)
        return torch.stack(outputs).cpu(), dist.get_rank(group), dist.get_world_size(group)

    for index, (result, rank, world) in enumerate(_launch(replicas, partition, fn)):
        members = _group_of(index, partition)
        assert (rank, world) == (members.index(index), size)
        expected = np.stack([_per_replica(k, shape=(2, 3)) for k in members])
        assert_close(result, torch.from_numpy(expected), tol="exact")


@DEPRECATED_ALIASES
@pytest.mark.parametrize("name", list(PARTITIONS))
def test_all_gather_into_tensor_on_a_subgroup(name):
    replicas, partition = PARTITIONS[name]
    size = len(partition[0])

    def fn(index, group):
        output = torch.zeros(size * 2, 3, device=xm.xla_device())
        value = _on_device(_per_replica(index, shape=(2, 3)))
        dist.all_gather_into_tensor(output, value, group=group)
        return output.cpu()

    for index, result in enumerate(_launch(replicas, partition, fn)):
        members = _group_of(index, partition)
        expected = np.concatenate([_per_replica(k, shape=(2, 3)) for k in members])
        assert_close(result, torch.from_numpy(expected), tol="exact")


@DEPRECATED_ALIASES
@pytest.mark.parametrize("name", list(PARTITIONS))
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_reduce_scatter_tensor_on_a_subgroup_gives_each_member_its_chunk(name, op):
    replicas, partition = PARTITIONS[name]
    size = len(partition[0])
    reduce_op, reference = _REDUCTIONS[op]

    def fn(index, group):
        output = torch.zeros(2, 3, device=xm.xla_device())
        value = _on_device(_per_replica(index, shape=(size * 2, 3)))
        dist.reduce_scatter_tensor(output, value, op=reduce_op, group=group)
        return output.cpu()

    for index, result in enumerate(_launch(replicas, partition, fn)):
        members = _group_of(index, partition)
        reduced = reference(np.stack([_per_replica(k, shape=(size * 2, 3)) for k in members]))
        chunk = reduced.reshape(size, 2, 3)[members.index(index)]
        assert_close(result, torch.from_numpy(chunk), tol="single_op")


@pytest.mark.parametrize("name", list(PARTITIONS))
def test_broadcast_on_a_subgroup_copies_its_roots_tensor(name):
    replicas, partition = PARTITIONS[name]

    def fn(index, group):
        tensor = _on_device(_per_replica(index))
        root = dist.get_global_rank(group, 1)  # each group's second member
        dist.broadcast(tensor, src=root, group=group)
        return tensor.cpu()

    for index, result in enumerate(_launch(replicas, partition, fn)):
        root = _group_of(index, partition)[1]
        assert_close(result, torch.from_numpy(_per_replica(root)), tol="exact")


def test_subgroup_barrier_meets_only_its_members():
    arrived = []

    def fn(index, group):
        if index < 2:  # only [0, 1] meet; [2, 3] pass by without a barrier
            arrived.append(index)
            dist.barrier(group=group)
            return sorted(arrived)
        return None

    results = _launch(4, [[0, 1], [2, 3]], fn)
    assert results[:2] == [[0, 1], [0, 1]]


def test_a_subgroup_collective_only_its_members_call_is_a_mismatch_not_a_hang():
    def fn(index, group):
        tensor = torch.ones(2, device=xm.xla_device())
        if index in (0, 1):
            dist.all_reduce(tensor, group=group)
        return tensor.cpu()

    with pytest.raises(CollectiveMismatchError, match=r"replicas \[0, 1\] run \[all_gather\]"):
        _launch(4, [[0, 1]], fn)


def test_a_world_of_one_subgroup_reduces_to_itself():
    def fn(index, group):
        tensor = _on_device(_per_replica(index))
        dist.all_reduce(tensor, group=group)
        return tensor.cpu()

    for index, result in enumerate(_launch(4, [[0], [1], [2], [3]], fn)):
        assert_close(result, torch.from_numpy(_per_replica(index)), tol="exact")


# --- DistributedDataParallel over subgroups ------------------------------------------------------


def test_ddp_over_subgroups_trains_each_group_on_its_own_averaged_gradient():
    torch.manual_seed(0)
    initial = net()
    partition = [[0, 2, 4, 6], [1, 3, 5, 7]]

    def fn(index, group):
        model = copy.deepcopy(initial).to(xm.xla_device())
        ddp = DistributedDataParallel(model, process_group=group)
        train_replica(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), index)
        return {k: v.cpu() for k, v in model.state_dict().items()}

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    expected = {tuple(g): averaged_gradient_reference(initial, g, sgd)[1] for g in partition}
    for index, state in enumerate(_launch(8, partition, fn)):
        assert_close(state, expected[tuple(_group_of(index, partition))], tol="training")


# --- replication helpers -------------------------------------------------------------------------


def test_set_replication_accepts_the_replicas_device_and_checks_its_arguments():
    def fn(index):
        device = xm.xla_device()
        xm.set_replication(device, [device])
        xm.set_replication(device, [])
        with pytest.raises(ValueError, match="is not among devices"):
            xm.set_replication(device, ["xla:1"])
        with pytest.raises(ValueError, match="is not an xla device"):
            xm.set_replication("cpu", [])
        return index

    assert list(xmp.spawn(fn, nprocs=2).values()) == [0, 1]


def test_mp_model_wrapper_gives_each_replica_the_model_on_its_device():
    torch.manual_seed(0)
    wrapped = xmp.MpModelWrapper(net())
    expected = {k: v.clone() for k, v in wrapped._model.state_dict().items()}

    def fn(index):
        model = wrapped.to(xm.xla_device())
        assert all(p.device.type == "xla" for p in model.parameters())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(index)  # each replica's own copy
        xm.mark_step()
        return {k: v.cpu() for k, v in model.state_dict().items()}

    for index, state in xmp.spawn(fn, nprocs=4).items():
        assert_close(state, {k: v + index for k, v in expected.items()}, tol="exact")


# --- replica groups from pg_options: the mesh, as PyTorch/XLA's new_group infers or takes it -----

SPMD = {"xla_pg_options": {"spmd": True}}


def _launch_own(replicas: int, partition: list, pg_options, fn) -> list:
    """``fn(index, group)`` in each replica, ``group`` made by ``dist.new_group(own ranks,
    pg_options=...)`` (every replica creating every group, in order); results in ordinal
    order."""

    def replica(index):
        dist.init_process_group("xla", init_method="xla://")
        try:
            mine = None
            for ranks in partition:
                group = dist.new_group(ranks, pg_options=pg_options)
                if index in ranks:
                    mine = group
            return fn(index, mine)
        finally:
            dist.destroy_process_group()

    results = xmp.spawn(replica, nprocs=replicas)
    return [results[i] for i in range(replicas)]


MESHES = {  # name: (ranks of one group, the mesh inferred from it), over 8 replicas
    "rows": ([4, 5, 6, 7], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "columns": ([1, 5], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    "one-each": ([3], [[k] for k in range(8)]),
}


@DEPRECATED_ALIASES
@pytest.mark.parametrize("name", list(MESHES))
def test_spmd_new_group_infers_the_mesh_its_collectives_run_over(name):
    ranks, mesh = MESHES[name]
    size = len(ranks)

    def fn(index, group):
        value = _on_device(_per_replica(index, shape=(size * 2, 3)))
        reduced = value.clone()
        dist.all_reduce(reduced, group=group)
        gathered = torch.zeros(size * value.shape[0], 3, device=xm.xla_device())
        dist.all_gather_into_tensor(gathered, value, group=group)
        shard = torch.zeros(2, 3, device=xm.xla_device())
        dist.reduce_scatter_tensor(shard, value, group=group)
        broadcast = value.clone()
        dist.broadcast(broadcast, src=dist.get_global_rank(group, size - 1), group=group)
        xm.mark_step()
        results = [t.cpu() for t in (reduced, gathered, shard, broadcast)]
        return group._mesh, group._groups() == mesh, results

    for index, (group_mesh, native, results) in enumerate(_launch_own(8, mesh, SPMD, fn)):
        assert group_mesh == mesh and native  # grouped xm collectives, no masked gather
        members = _group_of(index, mesh)
        values = np.stack([_per_replica(k, shape=(size * 2, 3)) for k in members])
        reduced = values.sum(0)
        expected = [
            reduced,
            values.reshape(-1, 3),
            reduced.reshape(size, 2, 3)[members.index(index)],
            values[-1],
        ]
        for result, value, tol in zip(results, expected, ["single_op", "exact"] * 2):
            assert_close(result, torch.from_numpy(value), tol=tol)


def test_a_mesh_given_in_pg_options_is_the_groups_collectives_run_over():
    mesh = [[0, 2, 4, 6], [1, 3, 5, 7]]

    def fn(index, group):
        tensor = _on_device(_per_replica(index))
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
        dist.barrier(group=group)
        return group._mesh, tensor.cpu()

    partition = [[0, 2, 4, 6], [1, 3, 5, 7]]
    for index, (group_mesh, result) in enumerate(
        _launch_own(8, partition, {"xla_pg_options": {"mesh": mesh}}, fn)
    ):
        assert group_mesh == mesh
        members = np.stack([_per_replica(k) for k in _group_of(index, mesh)])
        assert_close(result, torch.from_numpy(members.mean(0)), tol="single_op")


def test_groups_without_options_keep_their_own_ranks_as_mesh():
    def fn(index, group):
        world = dist.new_group(list(range(4)))
        return group._mesh, world._mesh

    results = _launch(4, [[0, 1, 2], [3]], fn)
    assert results == [([[0, 1, 2]], [[0, 1, 2, 3]])] * 3 + [([[3]], [[0, 1, 2, 3]])]


@pytest.mark.parametrize(
    "ranks,options,match",
    [
        ([0, 1, 2], SPMD, "not a side of a rectangle"),
        ([1, 2], SPMD, "not a row"),
        ([0, 3], SPMD, "not a row"),
        ([0, 2, 5, 7], SPMD, "not evenly spaced"),
        ([0, 1], {"xla_pg_options": {"mesh": [[0, 1], [2, 3, 4, 5, 6, 7]]}}, "groups of one size"),
        ([0, 1], {"xla_pg_options": {"mesh": [[0, 2], [1, 3]]}}, "one of them"),
    ],
)
def test_an_invalid_mesh_is_a_value_error_in_every_replica(ranks, options, match):
    def fn(index):
        dist.init_process_group("xla", init_method="xla://")
        try:
            with pytest.raises(ValueError, match=match):
                dist.new_group(ranks, pg_options=options)
            return True
        finally:
            dist.destroy_process_group()

    assert list(xmp.spawn(fn, nprocs=8).values()) == [True] * 8


def test_allgather_coalesced_gathers_each_input_and_unprovided_ops_say_so():
    def fn(index, group):
        first, second = _on_device(_per_replica(index, (2,))), _on_device(_per_replica(index, (3,)))
        outputs = [[torch.zeros_like(t) for _ in range(4)] for t in (first, second)]
        group.allgather_coalesced(outputs, [first, second])
        for op in ("allreduce_coalesced", "recv_anysource", "monitored_barrier"):
            with pytest.raises(NotImplementedError, match=op):
                getattr(group, op)(first)
        return [torch.stack(o).cpu() for o in outputs]

    for result in _launch(4, [[0, 1, 2, 3]], fn):
        for shape, gathered in zip([(2,), (3,)], result):
            expected = np.stack([_per_replica(k, shape) for k in range(4)])
            assert_close(gathered, torch.from_numpy(expected), tol="exact")
