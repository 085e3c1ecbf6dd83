"""The ``xla`` backend of torch.distributed inside launch: process groups per replica, collectives
against numpy, and DistributedDataParallel against an eager CPU reference averaging gradients."""

from __future__ import annotations

import copy
import functools
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch.nn.parallel import DistributedDataParallel

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.xla_backend  # noqa: F401  (registers 'xla' and 'xla://')
import spmd_torch.distributed.xla_multiprocessing as xmp
import spmd_torch.utils.utils
from tests.helpers import assert_close
from tests.mp._training import STEPS, averaged_gradient_reference, batch, net, train_replica

REPLICAS = 8
# all_gather_into_tensor / reduce_scatter_tensor are deprecated aliases from torch 2.13 on.
DEPRECATED_ALIASES = pytest.mark.filterwarnings("ignore:`torch.distributed.*:FutureWarning")


def _launch(fn, *args) -> list:
    """``fn(index, *args)`` in every replica, inside an ``xla`` default group; results in order."""

    def replica(index, *args):
        dist.init_process_group("xla", init_method="xla://")
        try:
            return fn(index, *args)
        finally:
            dist.destroy_process_group()

    results = spmd_torch.launch(replica, args=args)
    return [results[i] for i in range(REPLICAS)]


def _per_replica(index: int, shape=(5,), dtype=np.float32) -> np.ndarray:
    """Replica ``index``'s input: differs between replicas, the same on every run."""
    rng = np.random.default_rng(100 + index)
    return (rng.standard_normal(shape) * 3).astype(dtype)


def _on_device(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).to(xm.xla_device())


def _all_inputs(**kwargs) -> np.ndarray:
    return np.stack([_per_replica(i, **kwargs) for i in range(REPLICAS)])


# --- process groups ------------------------------------------------------------------------------


def test_xla_backend_is_registered_for_the_xla_device():
    assert dist.Backend.XLA == "xla"
    assert dist.Backend.default_device_backend_map["xla"] == "xla"
    assert not {"x", "l", "a"} & set(dist.Backend.default_device_backend_map)


def test_init_process_group_gives_each_replica_its_ordinal_and_the_replica_count():
    def fn(index):
        group = dist.group.WORLD
        registered = _resolve_process_group(group.group_name) is group  # each replica's own "0"
        return dist.get_rank(), dist.get_world_size(), dist.get_backend(), registered

    expected = [(i, REPLICAS, "xla", True) for i in range(REPLICAS)]
    assert _launch(fn) == expected
    assert not dist.is_initialized()


def _env_init(index, port):
    """init_process_group over env:// as PyTorch/XLA's test_ddp does: one TCP store all meet in."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MASTER_ADDR", "127.0.0.1")
        patch.setenv("MASTER_PORT", str(port))
        dist.init_process_group("xla", init_method="env://", rank=index, world_size=4)
    try:
        total = torch.tensor([float(index)], device=xm.xla_device())
        dist.all_reduce(total)
        return dist.get_rank(), dist.get_world_size(), total.cpu().item()
    finally:
        dist.destroy_process_group()


def test_env_init_method_meets_every_replica_in_its_store():
    """Each replica waits in the TCP store stepped away from the world's turns (holding its
    turn, replica 0 waited for the others forever)."""
    port = spmd_torch.utils.utils.get_free_tcp_ports()[0]
    results = xmp.spawn(_env_init, args=(port,), nprocs=4)
    assert [results[k] for k in range(4)] == [(k, 4, 6.0) for k in range(4)]


def test_each_replica_has_its_own_world_and_the_main_thread_keeps_its_group():
    dist.init_process_group("xla", init_method="xla://")  # outside launch: a world of one
    main_group = dist.group.WORLD
    try:

        def fn(index):
            before = dist.is_initialized()
            dist.init_process_group("xla", init_method="xla://")
            group = dist.group.WORLD
            dist.destroy_process_group()
            return before, group is main_group, dist.is_initialized()

        assert spmd_torch.launch(fn)[3] == (False, False, False)
        assert dist.group.WORLD is main_group and dist.get_world_size() == 1
        # c10d's registry of group names is the process's again (thread isolation mode is off)
        assert _resolve_process_group(main_group.group_name) is main_group
    finally:
        dist.destroy_process_group()


def test_launch_puts_back_the_excepthook_init_process_group_wraps():
    hook = sys.excepthook
    _launch(lambda index: None)
    assert sys.excepthook is hook


def test_xla_init_method_rejects_a_rank_other_than_the_ordinal():
    def fn(index):
        dist.init_process_group("xla", init_method="xla://", rank=(index + 1) % REPLICAS)

    with pytest.raises(ValueError, match=r"rank=\d\): this replica's rank is \d"):
        spmd_torch.launch(fn)


def test_new_group_over_every_replica_reduces_like_the_world():
    def fn(index):
        group = dist.new_group(ranks=list(range(REPLICAS)))
        tensor = _on_device(_per_replica(index))
        dist.all_reduce(tensor, group=group)
        name = group.group_name
        dist.destroy_process_group(group)
        return tensor.cpu(), name

    expected = torch.from_numpy(_all_inputs().sum(0))
    for result, name in _launch(fn):
        assert name == "1"  # after the default group, "0"
        assert_close(result, expected, tol="single_op")


# --- collectives ---------------------------------------------------------------------------------

_REDUCTIONS = {
    "SUM": (dist.ReduceOp.SUM, lambda x: x.sum(0)),
    "AVG": (dist.ReduceOp.AVG, lambda x: x.mean(0)),
    "PRODUCT": (dist.ReduceOp.PRODUCT, lambda x: x.prod(0)),
    "MIN": (dist.ReduceOp.MIN, lambda x: x.min(0)),
    "MAX": (dist.ReduceOp.MAX, lambda x: x.max(0)),
}


@pytest.mark.parametrize("op", list(_REDUCTIONS))
def test_all_reduce_matches_numpy(op):
    reduce_op, reference = _REDUCTIONS[op]

    def fn(index):
        tensor = _on_device(_per_replica(index) / 3 if op == "PRODUCT" else _per_replica(index))
        dist.all_reduce(tensor, op=reduce_op)
        return tensor.cpu()

    inputs = _all_inputs()
    expected = torch.from_numpy(reference(inputs / 3 if op == "PRODUCT" else inputs))
    for result in _launch(fn):
        assert_close(result, expected, tol="single_op")


@pytest.mark.parametrize("op", ["BAND", "BOR"])
def test_all_reduce_bitwise_matches_numpy(op):
    reduce_op = getattr(dist.ReduceOp, op)
    reference = np.bitwise_and.reduce if op == "BAND" else np.bitwise_or.reduce
    bits = [np.array([0b1111, 0b1010, 1 << i, 0xFF ^ (1 << i)], np.int32) for i in range(REPLICAS)]

    def fn(index):
        tensor = _on_device(bits[index])
        dist.all_reduce(tensor, op=reduce_op)
        return tensor.cpu()

    expected = torch.from_numpy(reference(np.stack(bits), axis=0))
    for result in _launch(fn):
        assert_close(result, expected)


def test_all_reduce_of_an_unsupported_op_names_it():
    def fn(index):
        dist.all_reduce(
            torch.ones(2, dtype=torch.int32, device=xm.xla_device()), dist.ReduceOp.BXOR
        )

    with pytest.raises(NotImplementedError, match="allreduce with RedOpType.BXOR"):
        _launch(fn)


def test_all_gather_into_a_list_matches_numpy():
    def fn(index):
        outputs = [torch.zeros(2, 3, device=xm.xla_device()) for _ in range(REPLICAS)]
        dist.all_gather(outputs, _on_device(_per_replica(index, shape=(2, 3))))
        return torch.stack(outputs).cpu()

    expected = torch.from_numpy(_all_inputs(shape=(2, 3)))
    for result in _launch(fn):
        assert_close(result, expected)


_GATHER_APIS = [
    name for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)
]
_SCATTER_APIS = [
    name for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)
]


@DEPRECATED_ALIASES
@pytest.mark.parametrize("api", _GATHER_APIS)
@pytest.mark.parametrize("layout", ["concatenated", "stacked"])
def test_all_gather_into_tensor_matches_numpy(api, layout):
    out_shape = (REPLICAS * 2, 3) if layout == "concatenated" else (REPLICAS, 2, 3)

    def fn(index):
        output = torch.zeros(out_shape, device=xm.xla_device())
        getattr(dist, api)(output, _on_device(_per_replica(index, shape=(2, 3))))
        return output.cpu()

    expected = torch.from_numpy(_all_inputs(shape=(2, 3)).reshape(out_shape))
    for result in _launch(fn):
        assert_close(result, expected)


@DEPRECATED_ALIASES
def test_all_gather_into_tensor_of_the_wrong_shape_names_both_shapes():
    def fn(index):
        output = torch.zeros(REPLICAS, 3, device=xm.xla_device())
        dist.all_gather_into_tensor(output, torch.zeros(2, 3, device=xm.xla_device()))

    with pytest.raises(ValueError, match=r"of a \(2, 3\) input needs .*\(8, 2, 3\).*got \(8, 3\)"):
        _launch(fn)


@DEPRECATED_ALIASES
@pytest.mark.parametrize("api", _SCATTER_APIS)
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
@pytest.mark.parametrize("layout", ["concatenated", "stacked"])
def test_reduce_scatter_tensor_matches_numpy(api, op, layout):
    reduce_op, reference = _REDUCTIONS[op]
    in_shape = (REPLICAS * 2, 3) if layout == "concatenated" else (REPLICAS, 2, 3)

    def fn(index):
        output = torch.zeros(2, 3, device=xm.xla_device())
        getattr(dist, api)(output, _on_device(_per_replica(index, shape=in_shape)), op=reduce_op)
        return output.cpu()

    reduced = reference(_all_inputs(shape=in_shape)).reshape(REPLICAS, 2, 3)
    for index, result in enumerate(_launch(fn)):
        assert_close(result, torch.from_numpy(reduced[index]), tol="single_op")


def test_reduce_scatter_of_a_list_matches_numpy():
    def fn(index):
        output = torch.zeros(3, device=xm.xla_device())
        inputs = list(_on_device(_per_replica(index, shape=(REPLICAS, 3))))
        dist.reduce_scatter(output, inputs)
        return output.cpu()

    reduced = _all_inputs(shape=(REPLICAS, 3)).sum(0)
    for index, result in enumerate(_launch(fn)):
        assert_close(result, torch.from_numpy(reduced[index]), tol="single_op")


@pytest.mark.parametrize("root", [0, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_broadcast_copies_the_roots_tensor_exactly(root, dtype):
    def value(index):
        array = _per_replica(index, shape=(4,))
        if dtype == np.bool_:
            return array > 0
        if dtype == np.float32 and index != root:
            array[:2] = [np.inf, np.nan]  # masked, not multiplied by zero: no NaN reaches the sum
        return array.astype(dtype)

    def fn(index):
        tensor = _on_device(value(index))
        dist.broadcast(tensor, src=root)
        return tensor.cpu()

    for result in _launch(fn):
        assert_close(result, torch.from_numpy(value(root)), tol="exact")


def test_barrier_waits_for_every_replica():
    arrived = []

    def fn(index):
        arrived.append(index)
        dist.barrier()
        return len(arrived)

    assert _launch(fn) == [REPLICAS] * REPLICAS


def test_object_collectives_pass_python_objects_between_replicas():
    def fn(index):
        gathered = [None] * REPLICAS
        dist.all_gather_object(gathered, {"rank": index, "name": "r" * index})  # sizes differ
        objects = [f"from {index}", index]
        dist.broadcast_object_list(objects, src=2)
        return gathered, objects

    expected = ([{"rank": i, "name": "r" * i} for i in range(REPLICAS)], ["from 2", 2])
    assert _launch(fn) == [expected] * REPLICAS


def test_all_reduce_of_a_cpu_tensor_writes_the_result_back():
    def fn(index):
        tensor = torch.from_numpy(_per_replica(index))
        dist.all_reduce(tensor)
        return tensor

    expected = torch.from_numpy(_all_inputs().sum(0))
    for result in _launch(fn):
        assert result.device.type == "cpu"
        assert_close(result, expected, tol="single_op")


def test_async_work_waits_and_its_future_holds_the_result():
    def fn(index):
        tensor = _on_device(_per_replica(index))
        work = dist.all_reduce(tensor, async_op=True)
        assert work.wait()
        (value,) = work.get_future().wait()
        return value.cpu()

    expected = torch.from_numpy(_all_inputs().sum(0))
    for result in _launch(fn):
        assert_close(result, expected, tol="single_op")


# --- DistributedDataParallel ---------------------------------------------------------------------


def _train_ddp(model: torch.nn.Module, index: int, bucket_view: bool) -> tuple:
    """STEPS of SGD through DDP on replica ``index``'s batches: (losses, final state on CPU)."""
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    losses = train_replica(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), index)
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("bucket_view", [True, False], ids=["bucket_view", "copies"])
def test_ddp_training_matches_sgd_on_the_averaged_gradient(bucket_view):
    torch.manual_seed(0)
    initial = net()

    def fn(index):
        torch.manual_seed(index)  # each replica starts elsewhere: DDP broadcasts rank 0's weights
        model = net() if index else copy.deepcopy(initial)
        model = model.to(xm.xla_device())
        return _train_ddp(model, index, bucket_view)

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    expected_losses, expected_state = averaged_gradient_reference(initial, range(REPLICAS), sgd)
    for index, (losses, state) in enumerate(_launch(fn)):
        assert_close(losses, expected_losses[:, index])
        assert_close(state, expected_state)


def test_ddp_broadcasts_rank_0s_buffers_before_each_forward():
    torch.manual_seed(0)
    initial = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)
    )

    def fn(index):
        model = copy.deepcopy(initial).to(xm.xla_device())
        return _train_ddp(model, index, bucket_view=True)  # DDP's broadcast_buffers is on

    # Reference: every replica's forward starts from rank 0's running statistics and updates its
    # own copy; rank 0's copy carries on. Gradients are averaged as before.
    model = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.named_parameters())
    expected_losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses, statistics = [], []
        for index in range(REPLICAS):
            own = {k: v.clone() for k, v in model.named_buffers()}
            x, y = batch(step, index)
            output = torch.func.functional_call(model, {**params, **own}, (x,))
            losses.append(torch.nn.functional.mse_loss(output, y))
            statistics.append(own)
        torch.stack(losses).mean().backward()
        optimizer.step()
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(statistics[0][name])
        expected_losses.append(torch.stack(losses).detach())
    expected_losses = torch.stack(expected_losses)

    results = _launch(fn)
    for index, (losses, state) in enumerate(results):
        assert_close(losses, expected_losses[:, index])
        for name, value in model.named_parameters():
            assert_close(state[name], value.detach())
    assert_close(results[0][1], dict(model.state_dict()))
