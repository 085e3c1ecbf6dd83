"""One test per row of the migration table in docs/migration.md.

A present row's name must import from our module and pass the behaviour check its row names; an
absent row's name must not import. Checks are looked up by the row's check id in CHECKS (ids with
an argument, ``kind:argument``, in PARAMETRIC).
"""

from __future__ import annotations

import ast
import gc
import importlib
import importlib.metadata
import inspect
import os
import pathlib
import re
import socket
from collections.abc import Callable

import jax
import numpy as np
import pytest
import rich.console
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.graph as graph
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
import spmd_torch.test.test_utils as test_utils
import spmd_torch.utils.serialization as xser
from spmd_torch.core.xla_builder import get_computation_hlo
from tests.helpers import assert_close

TABLE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migration.md"
_ROW = re.compile(
    r"^\| `(?P<name>[^`]+)` \| `(?P<ours>[^`]+)` \| (?P<status>present|absent) \|"
    r" (?P<note>.*) \| `(?P<check>[^`]+)` \|$"
)


def rows() -> list[dict]:
    """The table's rows, in order; a row that looks like one but does not parse is an error."""
    parsed = []
    for line in TABLE.read_text().splitlines():
        if line.startswith("| `") and line.count("|") == 6:  # the 5-column tables
            match = _ROW.match(line)
            assert match, f"migration.md: malformed table row: {line}"
            parsed.append(match.groupdict())
    return parsed


def resolve(dotted: str):
    """The object a dotted name (``pkg.module.attr``, a trailing ``('arg')`` ignored) names."""
    path = dotted.split("(")[0].split(".")
    for split in range(len(path), 0, -1):
        try:
            obj = importlib.import_module(".".join(path[:split]))
        except ModuleNotFoundError:
            continue
        for attr in path[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module in {dotted!r}")


def _device() -> torch.device:
    return spmd_torch.device()


def _xla(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(_device())


# --- torch_xla ----------------------------------------------------------------------------------


def check_device(fn):
    dev = fn()
    assert dev == torch.device("xla", 0)
    assert torch.ones(2, device=dev).device.type == "xla"


def check_devices(fn):
    assert fn() == [torch.device("xla", k) for k in range(len(jax.local_devices()))]


def check_real_devices(fn):
    real = fn()
    assert real and all(re.fullmatch(r"[A-Z]+:\d+", d) for d in real), real
    assert real[0].split(":")[0] == xr.device_type()


def check_device_count(fn):
    assert fn() == len(spmd_torch.real_devices())


def check_sync(fn):
    x = _xla([1.0, 2.0]) * 3
    assert graph.pending_count() > 0
    fn()
    assert graph.pending_count() == 0
    assert x.cpu().tolist() == [3.0, 6.0]


def check_step(fn):
    x = _xla([1.0, 2.0])
    with fn():
        y = x + 1
    assert graph.pending_count() == 0
    assert y.cpu().tolist() == [2.0, 3.0]


def check_compile(fn):
    @fn
    def double(t):
        return t * 2

    out = double(_xla([1.0, 4.0]))
    assert graph.pending_count() == 0
    assert out.cpu().tolist() == [2.0, 8.0]
    with fn():
        z = _xla([1.0]) + 1
    assert graph.pending_count() == 0 and z.cpu().tolist() == [2.0]


def check_manual_seed(fn):
    fn(7)
    first = torch.rand(4, device=_device()).cpu()
    fn(7)
    assert torch.equal(torch.rand(4, device=_device()).cpu(), first)


def check_launch(fn):
    seen = []
    fn(lambda index, tag: seen.append((index, tag)), args=("x",), debug_single_process=True)
    assert seen == [(0, "x")]


def check_version(value):
    assert value == importlib.metadata.version("spmd_torch")


# --- runtime -------------------------------------------------------------------------------------


def check_device_type(fn):
    assert fn() == {"cpu": "CPU", "gpu": "CUDA", "tpu": "TPU"}[jax.default_backend()]


def check_set_device_type(fn, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", xr.device_type())
    fn(xr.device_type())
    assert os.environ["PJRT_DEVICE"] == xr.device_type()


def check_is_bf16_supported(fn):
    assert fn() is True


def check_jax_device_count(fn):
    assert fn() == len(jax.devices()) == 8


def check_global_runtime_device_attributes(fn):
    attributes = fn()
    assert isinstance(attributes, list) and len(attributes) == 8
    assert all(isinstance(a, dict) for a in attributes)


def check_use_spmd(fn):
    fn()
    assert xr.is_spmd() and os.environ.get("XLA_USE_SPMD") == "1"


def check_is_spmd(fn):
    assert fn() is False
    xr.use_spmd()
    assert fn() is True


# --- xla_model -----------------------------------------------------------------------------------


def check_is_xla_tensor(fn):
    assert fn(_xla([1.0])) is True and fn(torch.ones(1)) is False


def check_get_xla_supported_devices(fn):
    assert fn() == [f"xla:{k}" for k in range(len(jax.local_devices()))]


def check_xla_real_devices(fn):
    assert fn(["xla:0"]) == [f"{xr.device_type()}:0"]


def check_xla_device_hw(fn):
    assert fn(_device()) == xr.device_type()


def check_parse_xla_device(fn):
    assert fn("CPU:3") == ("CPU", 3)


def check_xla_replication_devices(fn):
    assert fn(["xla:0"]) == [f"{xr.device_type()}:{i}" for i in range(8)]


def check_master_print(fn, capsys):
    fn("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def check_wait_device_ops(fn):
    x = _xla([2.0]) * 2
    spmd_torch.sync()
    assert fn() is None
    assert x.cpu().tolist() == [4.0]


def check_unlazy(fn):
    x = _xla([1.0]) + 1
    fn([x])
    assert graph.pending_count() == 0 and x.cpu().tolist() == [2.0]


def check_add_step_closure(fn):
    seen = []
    x = _xla([5.0]) * 2
    fn(lambda t: seen.append(t.cpu().tolist()), args=(x,))
    assert seen == []
    xm.mark_step()
    assert seen == [[10.0]]


def check_rate_tracker(cls):
    tracker = cls()
    tracker.add(100)
    assert tracker.rate() > 0 and tracker.global_rate() > 0


def check_all_reduce(fn):
    x = _xla([1.0, 2.0])
    assert fn(xm.REDUCE_SUM, x).cpu().tolist() == [1.0, 2.0]
    tensors = [_xla([3.0])]
    assert fn(xm.REDUCE_SUM, tensors) is tensors
    assert tensors[0].cpu().tolist() == [3.0]


def check_all_gather(fn):
    assert fn(_xla([[1.0, 2.0]]), dim=0).cpu().tolist() == [[1.0, 2.0]]


def check_reduce_scatter(fn):
    out = fn(xm.REDUCE_SUM, _xla([1.0, 2.0]), scale=1.0, scatter_dim=0, shard_count=1)
    assert out.cpu().tolist() == [1.0, 2.0]


def check_all_to_all(fn):
    out = fn(_xla([[1.0, 2.0]]), split_dimension=0, concat_dimension=0, split_count=1)
    assert out.cpu().tolist() == [[1.0, 2.0]]


def check_collective_permute(fn):
    assert fn(_xla([4.0]), pairs=[[0, 0]]).cpu().tolist() == [4.0]


def check_collective_broadcast(fn):
    x = _xla([7.0])
    fn([x])
    assert x.cpu().tolist() == [7.0]


def check_all_gather_bucketized(fn):
    out = fn([_xla([1.0]), _xla([2.0, 3.0])], dim=0)
    assert [t.cpu().tolist() for t in out] == [[1.0], [2.0, 3.0]]


def check_reduce_scatter_bucketized(fn):
    out = fn(xm.REDUCE_SUM, [_xla([1.0]), _xla([2.0])], scale=1.0, scatter_dim=0, shard_count=1)
    assert [t.cpu().tolist() for t in out] == [[1.0], [2.0]]


def check_all_reduce_bucketized_gradients(fn):
    grads = [_xla([1.0]), _xla([2.0])]
    fn(grads, scale=1.0, groups=None, pin_layout=False)
    assert [g.cpu().tolist() for g in grads] == [[1.0], [2.0]]


def _trained_pair(step: Callable):
    """A linear layer trained one SGD step on CPU and on xla through ``step(optimizer)``."""
    torch.manual_seed(0)
    cpu = torch.nn.Linear(3, 2)
    dev = torch.nn.Linear(3, 2).to(_device())
    dev.load_state_dict(cpu.state_dict())
    x = torch.randn(4, 3)
    for model, data, run in ((cpu, x, lambda o: o.step()), (dev, x.to(_device()), step)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(data).sum().backward()
        run(optimizer)
    xm.mark_step()
    return cpu, dev


def check_reduce_gradients(fn):
    cpu, dev = _trained_pair(lambda o: (fn(o), o.step()))
    assert_close(dev.weight.cpu(), cpu.weight.detach())


def check_optimizer_step(fn):
    cpu, dev = _trained_pair(lambda o: fn(o))
    assert_close(dev.weight.cpu(), cpu.weight.detach())


def check_save(fn, tmp_path):
    fn({"w": _xla([1.0, 2.0])}, tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt")
    assert loaded["w"].device.type == "cpu" and loaded["w"].tolist() == [1.0, 2.0]


def check_send_cpu_data_to_device(fn):
    (moved,) = fn(torch.tensor([1.0, 2.0]), _device())
    assert moved.device.type == "xla" and moved.cpu().tolist() == [1.0, 2.0]


def check_rendezvous(fn):
    assert fn("tag", b"payload") == [b"payload"]


def check_xla_rendezvous(fn):
    assert fn(b"payload") == [b"payload"]


def check_mesh_reduce(fn):
    assert fn("tag", 3.5, lambda values: sum(values) * 2) == 7.0


def check_do_on_ordinals(fn):
    assert fn(lambda t: t.tolist(), (_xla([1.0]),), ordinals=(0,)) == [1.0]


def check_rng_state(_fn):
    xm.set_rng_state(1234)
    assert xm.get_rng_state() == 1234


def check_fork_rng(fn):
    xm.set_rng_state(11)
    with fn():
        xm.set_rng_state(99)
    assert xm.get_rng_state() == 11


def check_get_memory_info(fn):
    if xr.device_type() == "CPU":  # PJRT's CPU client keeps no memory statistics
        with pytest.raises(RuntimeError, match="cpu"):
            fn(_device())
    else:
        assert {"bytes_used", "bytes_limit"} <= set(fn(_device()))


def check_optimization_barrier_(fn):
    a, b = _xla([1.0]) + 1, _xla([2.0]) * 2
    assert fn([a, b]) is None
    assert a.cpu().tolist() == [2.0] and b.cpu().tolist() == [4.0]


def check_broadcast_master_param(fn):
    model = torch.nn.Linear(2, 2).to(_device())
    before = model.weight.cpu()
    fn(model)
    assert torch.equal(model.weight.cpu(), before)


def check_get_stablehlo(fn):
    x = _xla([1.0]) + 1
    text = fn([x])
    assert "stablehlo.add" in text and "func.func" in text
    spmd_torch.sync()


# --- core.functions, multiprocessing, loaders, backend ---------------------------------------------


def check_functions_all_reduce(fn):
    x = _xla([1.0, 2.0]).requires_grad_()
    out = fn(xm.REDUCE_SUM, x)
    out.sum().backward()
    assert out.cpu().tolist() == [1.0, 2.0] and x.grad.cpu().tolist() == [1.0, 1.0]


def check_functions_all_gather(fn):
    x = _xla([[1.0, 2.0]]).requires_grad_()
    out = fn(x, dim=0)
    out.sum().backward()
    assert out.cpu().tolist() == [[1.0, 2.0]] and x.grad.cpu().tolist() == [[1.0, 1.0]]


def check_sync_batch_norm(cls):
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    expected = torch.nn.BatchNorm1d(3)(x)
    assert_close(cls(3).to(_device())(x.to(_device())).cpu(), expected)


def check_spawn(fn):
    seen = []
    fn(lambda index, tag: seen.append((index, tag)), args=("x",), nprocs=1)
    assert seen == [(0, "x")]


def check_mp_model_wrapper(cls):
    module = torch.nn.Linear(2, 2)
    wrapped = cls(module)
    assert wrapped.to(_device()).weight.device.type == "xla"


def _batches():
    return [(torch.full((2, 3), float(i)), torch.tensor([i, i])) for i in range(3)]


def check_mp_device_loader(cls):
    seen = [(x.device.type, x.cpu()[0, 0].item()) for x, _ in cls(_batches(), _device())]
    assert seen == [("xla", 0.0), ("xla", 1.0), ("xla", 2.0)]


def check_parallel_loader(cls):
    loader = cls(_batches(), [_device()]).per_device_loader(_device())
    assert [y.cpu().tolist() for _, y in loader] == [[0, 0], [1, 1], [2, 2]]


def check_per_device_loader(cls):
    loader = pl.ParallelLoader(_batches(), [_device()])
    assert isinstance(loader.per_device_loader(_device()), cls)


def check_xla_backend(module):
    assert "xla" in torch.distributed.Backend.backend_list


def check_process_group_class(cls):
    assert issubclass(cls, torch.distributed.ProcessGroup)


# --- SPMD ----------------------------------------------------------------------------------------


def _mesh(shape=(8,), names=("data",)):
    return xs.Mesh(np.arange(8), shape, names)


def _shard_indices(t) -> list:
    return [tuple((s.start, s.stop) for s in shard.indices) for shard in t.local_shards]


def check_mesh(cls):
    mesh = cls(np.arange(8), (4, 2), ("data", "model"))
    assert mesh.size() == 8 and mesh.shape() == {"data": 4, "model": 2}
    assert mesh.get_logical_mesh().tolist() == np.arange(8).reshape(4, 2).tolist()


def check_hybrid_mesh(cls):
    mesh = cls(ici_mesh_shape=(4, 2), axis_names=("data", "model"))
    assert mesh.size() == 8 and mesh.shape() == {"data": 4, "model": 2}


def check_get_1d_mesh(fn):
    mesh = fn("fsdp")
    assert mesh.shape() == {"fsdp": 8}


def check_global_mesh(_fn):
    mesh = _mesh()
    xs.set_global_mesh(mesh)
    assert xs.get_global_mesh() is mesh


def check_sharding_type(cls):
    assert {"REPLICATED", "TILED", "PARTIAL", "MANUAL"} <= set(cls.__members__)


def check_sharding_spec(cls):
    xr.use_spmd()
    spec = cls(_mesh(), ("data", None))
    t = torch.arange(16.0).reshape(8, 2).to(_device())
    xs.mark_sharding(t, spec.mesh, spec.partition_spec)
    assert _shard_indices(xs.wrap_as_sharded_tensor(t))[1] == (
        (1, 2),
        (0, 2),
    )


def check_mark_sharding(fn):
    xr.use_spmd()
    t = torch.arange(16.0).reshape(8, 2).to(_device())
    sharded = fn(t, _mesh(), ("data", None))
    shards = sharded.local_shards
    assert len(shards) == 8 and shards[3].data.cpu().tolist() == [[6.0, 7.0]]


def check_mark_sharding_with_gradients(fn):
    xr.use_spmd()
    x = torch.arange(16.0).reshape(8, 2).to(_device()).requires_grad_()
    y = fn(x, _mesh(), ("data", None))
    (y * 3).sum().backward()
    assert x.grad.cpu().tolist() == [[3.0, 3.0]] * 8
    spec = xs.get_xla_sharding_spec(y) or ""
    assert "devices=[8,1]" in spec


def check_mark_sharding_function(cls):
    xr.use_spmd()
    x = torch.ones(8, 2).to(_device()).requires_grad_()
    y = cls.apply(x, _mesh(), ("data", None))
    y.sum().backward()
    assert x.grad.cpu().tolist() == [[1.0, 1.0]] * 8


def check_clear_sharding(fn):
    xr.use_spmd()
    t = xs.mark_sharding(torch.ones(8, 2).to(_device()), _mesh(), ("data", None)).global_tensor
    fn(t)
    assert "devices=" not in (xs.get_xla_sharding_spec(t) or "")


def check_wrap_if_sharded(fn):
    xr.use_spmd()
    t = torch.ones(8, 2).to(_device())
    xs.mark_sharding(t, _mesh(), ("data", None))
    assert isinstance(fn(t), xs.XLAShardedTensor)
    assert not isinstance(fn(torch.ones(2)), xs.XLAShardedTensor)


def check_xla_sharded_tensor(cls):
    xr.use_spmd()
    sharded = xs.mark_sharding(torch.arange(8.0).to(_device()), _mesh(), ("data",))
    assert isinstance(sharded, cls)
    assert sharded.global_tensor.cpu().tolist() == list(range(8))
    assert [type(p).__name__ for p in sharded.placements] == ["Shard"]
    assert sharded.to_local() is sharded.global_tensor


def check_xla_shard(cls):
    xr.use_spmd()
    sharded = xs.mark_sharding(
        torch.arange(16.0).reshape(8, 2).to(_device()), _mesh(), ("data", None)
    )
    shard = sharded.local_shards[2]
    assert isinstance(shard, cls) and shard.data.cpu().tolist() == [[4.0, 5.0]]
    assert [(i.start, i.stop) for i in shard.indices] == [(2, 3), (0, 2)]


def check_manual_sharding(_fn):
    xr.use_spmd()
    mesh = _mesh()
    t = torch.arange(8.0).to(_device())
    local = xs.enable_manual_sharding(t, ("data",), mesh=mesh).global_tensor
    assert tuple(local.shape) == (1,)
    back = xs.disable_manual_sharding(local * 2, ("data",), (8,), mesh=mesh).global_tensor
    assert back.cpu().tolist() == [2.0 * i for i in range(8)]


def check_shard_as(fn):
    xr.use_spmd()
    a = torch.ones(8, 2).to(_device())
    xs.mark_sharding(a, _mesh(), ("data", None))
    a2, b2 = fn(a, torch.ones(8, 2).to(_device()) * 2)
    spmd_torch.sync()
    assert "devices=[8,1]" in (xs.get_xla_sharding_spec(b2) or "")
    assert b2.cpu().tolist() == [[2.0, 2.0]] * 8


def check_annotate_custom_sharding(fn):
    xr.use_spmd()
    t = torch.arange(16.0).reshape(8, 2).to(_device())
    out = fn(t, _mesh(), ("data", None))
    assert "devices=[8,1]" in (xs.get_xla_sharding_spec(out.global_tensor) or "")
    assert out.global_tensor.cpu().tolist() == torch.arange(16.0).reshape(8, 2).tolist()


def check_apply_backward_optimization_barrier(fn):
    layer = torch.nn.Linear(2, 2).to(_device())
    fn(layer)
    layer(torch.ones(1, 2).to(_device())).sum().backward()
    assert layer.weight.grad.cpu().tolist() == [[1.0, 1.0], [1.0, 1.0]]


def check_xla_distribute_tensor(fn):
    mesh = torch.distributed.device_mesh.DeviceMesh("xla", list(range(8)))
    out = fn(torch.arange(8.0), mesh, [torch.distributed.tensor.Shard(0)])
    assert out.global_tensor.cpu().tolist() == list(range(8))
    assert len(out.local_shards) == 8


def _distribute_module(fn):
    """``fn(module, mesh, partition_fn)`` calls partition_fn per submodule, returns the module."""
    mesh = torch.distributed.device_mesh.DeviceMesh("xla", list(range(8)))
    module = torch.nn.Sequential(torch.nn.Linear(8, 8))
    calls = []

    def partition(name, submodule, device_mesh):
        calls.append(name)
        if isinstance(submodule, torch.nn.Linear):
            submodule.to(_device())
            xs.mark_sharding(submodule.weight, _mesh(), ("data", None))

    assert fn(module, mesh, partition) is module
    assert calls == ["", "0"]
    assert "devices=[8,1]" in (xs.get_xla_sharding_spec(module[0].weight) or "")


def check_xla_distribute_module(fn):
    _distribute_module(fn)


def check_auto_policy(fn):
    mesh = torch.distributed.device_mesh.DeviceMesh("xla", list(range(8)))
    with pytest.raises(NotImplementedError):
        xs.xla_distribute_module(torch.nn.Linear(2, 2), mesh, fn)


def check_xla_patched_linear(cls):
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    weight = layer.weight.detach().to(_device()).requires_grad_()
    out = cls.apply(x.to(_device()), weight, layer.bias.detach().to(_device()))
    out.sum().backward()
    layer(x).sum().backward()
    assert_close(out.detach().cpu(), layer(x).detach())
    assert_close(weight.grad.cpu(), layer.weight.grad, kind="grad")


def check_xla_patched_nn_linear_forward(fn):
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    expected = layer(x).detach()
    assert_close(fn(layer.to(_device()), x.to(_device())).detach().cpu(), expected)


def check_convert_to_xla_mesh(fn):
    mesh = fn(torch.distributed.device_mesh.DeviceMesh("xla", [[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert mesh.mesh_shape == (2, 4)


def check_visualize_tensor_sharding(fn):
    xr.use_spmd()
    t = torch.ones(8, 2).to(_device())
    xs.mark_sharding(t, _mesh(), ("data", None))
    table = _rendered(fn(t, use_color=False))
    assert all(f"CPU {device}" in table for device in range(8))


def check_visualize_sharding(fn):
    table = _rendered(fn("{devices=[8,1]0,1,2,3,4,5,6,7}", use_color=False))
    assert all(f"CPU {device}" in table for device in range(8))


def _rendered(table) -> str:
    """A ``rich`` table as the text a console prints."""
    console = rich.console.Console()
    with console.capture() as capture:
        console.print(table)
    return capture.get()


# --- FSDP, experimental, checkpointing -----------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def check_transformer_auto_wrap_policy(fn):
    assert fn(_Block(), False, 0, transformer_layer_cls={_Block})
    assert not fn(torch.nn.Linear(2, 2), False, 0, transformer_layer_cls={_Block})
    assert fn(torch.nn.Linear(2, 2), True, 0, transformer_layer_cls={_Block})


def check_size_based_auto_wrap_policy(fn):
    assert fn(torch.nn.Linear(2, 2), False, 200, min_num_params=100)
    assert not fn(torch.nn.Linear(2, 2), False, 50, min_num_params=100)


def check_checkpoint_module(fn):
    block = _Block()
    wrapped = fn(block)
    x = torch.randn(2, 4)
    assert_close(wrapped(x), block.linear(x), tol="exact")


def check_experimental_compile(fn):
    double = fn(lambda t: t * 2)
    assert double(_xla([1.0, 4.0])).cpu().tolist() == [2.0, 8.0]
    assert graph.pending_count() == 0


def check_eager_mode(_fn):
    experimental = importlib.import_module("spmd_torch.experimental")
    assert experimental.is_eager_mode() is False
    experimental.eager_mode(True)
    try:
        assert experimental.is_eager_mode() is True
        x = _xla([1.0]) + 1
        assert graph.pending_count() == 0 and x.cpu().tolist() == [2.0]
    finally:
        experimental.eager_mode(False)
    assert experimental.is_eager_mode() is False


def check_eager_mode_context(fn):
    is_eager_mode = resolve("spmd_torch.experimental.is_eager_mode")
    with fn(True):
        assert is_eager_mode() is True
    assert is_eager_mode() is False


def check_fsdp_v2(cls):
    xr.use_spmd()
    xs.set_global_mesh(xs.Mesh(np.arange(8), (8, 1), ("fsdp", "model")))
    torch.manual_seed(0)
    cpu = torch.nn.Linear(8, 8)
    model = cls(torch.nn.Linear(8, 8))
    model.module.load_state_dict(cpu.state_dict())
    x = torch.randn(8, 8)
    assert_close(model(x.to(_device())).cpu(), cpu(x))


def check_checkpoint_manager(cls, tmp_path):
    manager = cls(str(tmp_path), save_interval=1)
    state = {"w": _xla([1.0, 2.0])}
    assert manager.save(0, state)
    target = {"w": _xla([0.0, 0.0])}
    manager.restore(0, target)
    assert target["w"].cpu().tolist() == [1.0, 2.0]


def check_dcp_planners(cls):
    assert issubclass(
        cls, (torch.distributed.checkpoint.SavePlanner, torch.distributed.checkpoint.LoadPlanner)
    )


def check_prime_optimizer(fn):
    model = torch.nn.Linear(2, 2).to(_device())
    optimizer = torch.optim.AdamW(model.parameters())
    fn(optimizer)
    assert len(optimizer.state) == 2


# --- debug ---------------------------------------------------------------------------------------


def check_metrics_report(fn):
    (_xla([1.0]) + 1).cpu()
    report = fn()
    assert "Metric: CompileTime" in report or "Counter: CachedCompile" in report


def check_short_metrics_report(fn):
    (_xla([1.0]) + 1).cpu()
    assert "Metric:" in fn() or "Counter:" in fn()


def check_met_counters(_fn):
    met.clear_all()
    xm.mark_step()
    assert "MarkStep" in met.counter_names() and met.counter_value("MarkStep") == 1


def check_met_metrics(_fn):
    (_xla([3.0]) * 2).cpu()
    assert "TransferFromDeviceTime" in met.metric_names()
    count, total, samples = met.metric_data("TransferFromDeviceTime")
    assert count >= 1 and total > 0 and samples


def check_met_clear(_fn):
    xm.mark_step()
    met.clear_counters()
    assert met.counter_value("MarkStep") in (None, 0)
    (_xla([1.0]) + 1).cpu()
    met.clear_metrics()
    assert met.metric_data("TransferFromDeviceTime") in (None, (0, 0.0, []))
    met.clear_all()


def check_executed_fallback_ops(fn):
    assert isinstance(fn(), list)
    met.clear_all()
    assert fn() == []


def check_mcu_get_data_points(fn):
    report = (
        "Metric: CompileTime\n  TotalSamples: 2\n  Accumulator: 01s500ms\nCounter: X\n  Value: 3"
    )
    points = fn([report, met.metrics_report()])
    assert points["CompileTime__Accumulator_sec"][0] == 1.5 and points["X__Value"] == [3, None]


def check_mcu_compare_metrics(fn):
    points = {"X__Value": [3, 3]}
    assert fn(points, "Counter: X\n  Value: 3") == ""
    assert fn(points, "Counter: X\n  Value: 4").startswith("X__Value failed its expression check")


def _metric_after_a_step(name: str):
    spmd_torch.sync()
    x = torch.randn(64, 64).to(_device())
    (x @ x + torch.arange(64.0, device=_device())).sum().item()
    xm.mark_step()
    return met.metric_data(name)


def check_metric(fn, name):
    data = _metric_after_a_step(name)
    assert data is not None and data[0] >= 1, f"metric {name} not recorded: {data}"


def check_spmd_metric(fn, name):
    xr.use_spmd()
    t = torch.ones(8, 2).to(_device())
    xs.mark_sharding(t, _mesh(), ("data", None))
    check_metric(fn, name)


def check_eager_metric(fn, name):
    met.clear_all()
    with spmd_torch.experimental.eager_mode_context(True):
        (_xla([1.0]) + 2.5).cpu()
    data = met.metric_data(name)
    assert data is not None and data[0] >= 1, f"metric {name} not recorded: {data}"
    assert name.replace("EagerOp", "") not in met.metric_names()


def check_counter(fn, name):
    _metric_after_a_step(name)
    (_xla([1.0]) * 5).cpu()  # the second run of one program structure hits the cache
    (_xla([2.0]) * 5).cpu()
    value = met.counter_value(name)
    assert value is not None and value >= 1, f"counter {name} not counted: {value}"


def check_profiler_trace_files(_fn, tmp_path):
    xp = importlib.import_module("spmd_torch.debug.profiler")
    xp.start_trace(str(tmp_path))
    with xp.Trace("migration_region"):
        (_xla([1.0]) + 1).cpu()
    xp.stop_trace()
    assert any(p.is_file() for p in tmp_path.rglob("*"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def check_profiler_start_server(fn):
    port = _free_port()
    server = fn(port)
    try:
        assert server.port == port
        with socket.create_connection(("localhost", port), timeout=5):
            pass  # the profiler service accepts connections
    finally:
        server.stop()


def check_profiler_capture_from_server(fn, tmp_path):
    address = f"localhost:{_free_port()}"
    with pytest.raises(RuntimeError, match=f"no profile captured from {address}"):
        fn(address, str(tmp_path), duration_ms=100, num_tracing_attempts=1, interval_s=0)


def check_scan(fn):
    xs = _xla([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    carry, ys = fn(lambda c, x: (c + x, c + x), _xla([0.0, 0.0]), xs)
    assert carry.cpu().tolist() == [9.0, 12.0]
    assert ys.cpu().tolist() == [[1.0, 2.0], [4.0, 6.0], [9.0, 12.0]]


def check_value_and_grad_partitioned(fn):
    carry, xs = _xla([[1.0, 2.0], [3.0, 4.0]]), _xla([[[1.0, 0.0], [0.0, 2.0]]]).requires_grad_()
    forward, alias_input, backward = fn(lambda c, x: (c @ x, c @ x), carry, xs)
    new_carry, (y, partial) = forward(carry, xs[0])
    assert new_carry.cpu().tolist() == [[1.0, 4.0], [3.0, 8.0]]
    grad_carry, grad_x = backward(
        torch.ones_like(y), (torch.ones_like(y), alias_input(partial, xs[0]))
    )
    assert grad_carry.cpu().tolist() == [[2.0, 4.0], [2.0, 4.0]]  # (g_carry + g_y) @ x.T
    assert grad_x.cpu().tolist() == [[8.0, 8.0], [12.0, 12.0]]  # carry.T @ (g_carry + g_y)


def check_tree_flatten_none(fn):
    leaves, unflatten = fn(((1, 2), (None, 3), None))
    assert leaves == [1, 2, 3] and unflatten([4, 5, 6]) == ((4, 5), (None, 6), None)


def check_gmm(fn):
    lhs, rhs = _xla([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), _xla([[[1.0]], [[10.0]]])
    sizes = torch.tensor([1, 2], dtype=torch.int32).to(_device())
    assert fn(lhs[:, :1], rhs, sizes).cpu().tolist() == [[1.0], [30.0], [50.0]]


def _paged_cache():
    """Two sequences of 3 and 1 keys over a pool of 4 pages of 2: keys of 0s and 1s, values
    10s, 20s and 30s, in page order."""
    k_pages = _xla([[[[0.0], [1.0]], [[0.0], [0.0]], [[1.0], [0.0]], [[0.0], [0.0]]]])
    v_pages = _xla([[[[10.0], [20.0]], [[0.0], [0.0]], [[30.0], [0.0]], [[5.0], [0.0]]]])
    lengths = torch.tensor([3, 1], dtype=torch.int32).to(_device())
    page_indices = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32).to(_device())
    return k_pages, v_pages, lengths, page_indices


def check_paged_attention(fn):
    """A query of 0 weighs each key alike: the mean of the values it sees."""
    k_pages, v_pages, lengths, page_indices = _paged_cache()
    out = fn(_xla([[[0.0]], [[0.0]]]), k_pages, v_pages, lengths, page_indices, 1)
    assert_close(out.cpu(), torch.tensor([[[20.0]], [[5.0]]]))


def check_multi_queries_paged_attention(fn):
    """Sequence 0's two queries sit at keys 1 and 2: means of the first two and three values."""
    k_pages, v_pages, lengths, page_indices = _paged_cache()
    effective = torch.tensor([2, 1], dtype=torch.int32).to(_device())
    out = fn(
        _xla([[[[0.0]], [[0.0]]]] * 2), k_pages, v_pages, lengths, page_indices, effective, 1, 1
    )
    assert_close(out[0].cpu().flatten(), torch.tensor([15.0, 20.0]))


def check_ragged_paged_attention(fn):
    """The cache of ``_paged_cache`` with keys and values interleaved by head; sequence 0's two
    queries (rows 0, 1) at keys 1 and 2, sequence 1's one (row 2) at key 0."""
    k_pages, v_pages, lengths, page_indices = _paged_cache()
    kv_pages = torch.stack([k_pages[0], v_pages[0]], dim=2)  # [pages, page_size, 2, 1]
    cu_q_lens = torch.tensor([0, 2, 3], dtype=torch.int32).to(_device())
    num_seqs = torch.tensor([2], dtype=torch.int32).to(_device())
    out = fn(_xla([[[0.0]]] * 4), kv_pages, lengths, page_indices, cu_q_lens, num_seqs)
    assert_close(out[:3].cpu().flatten(), torch.tensor([15.0, 20.0, 5.0]))


def check_quantized_matmul_int8(fn):
    """Weights 1 and -2 scaled by 0.5; the row (127, 1) quantizes to itself (scale 1)."""
    w = torch.tensor([[1, -2]], dtype=torch.int8).to(_device())
    scale = _xla([0.5])
    assert_close(fn(_xla([[4.0, 2.0]]), w, scale).cpu(), torch.tensor([[0.0]]))
    out = fn(_xla([[127.0, 1.0]]), w, scale, quantize_activation=True)
    assert_close(out.cpu(), torch.tensor([[62.5]]))


def check_XlaQuantizedLinear(cls):
    """One output channel of weights (2, -1) scaled by 0.5, less a zero point of 1."""
    layer = cls(2, 1)
    layer.load_quantized_weight(
        torch.tensor([[2, -1]], dtype=torch.int8), torch.tensor([0.5]), torch.tensor([1.0])
    )
    out = layer.to(_device())(_xla([[3.0, 4.0]]))
    assert_close(out.cpu(), torch.tensor([[3.0 - 2.0 - 7.0]]))


def _pallas_add(x, y):
    from jax.experimental import pallas

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pallas.pallas_call(kernel, out_shape=out, interpret=True)(x, y)


def check_make_kernel_from_pallas(fn):
    add = fn(_pallas_add, lambda x, y: [(x.shape, x.dtype)])
    assert add(_xla([1.0, 2.0]), _xla([10.0, 20.0])).cpu().tolist() == [11.0, 22.0]


def check_trace_pallas(fn):
    payload, tensors = fn(_pallas_add, _xla([1, 2]).int(), _xla([3, 4]).int())
    (out,) = spmd_torch._XLAC._xla_tpu_custom_call(tensors, payload, [(2,)], [torch.int32])
    assert out.cpu().tolist() == [4, 6]


def check_splash_attention(fn):
    from spmd_torch.experimental.splash_attention import SplashAttentionConfig

    q = torch.zeros(1, 1, 4, 2)  # every score 0: each query averages the values it sees
    v = torch.arange(8.0).reshape(1, 1, 4, 2)
    out = fn(_xla(q), _xla(q), _xla(v), SplashAttentionConfig().to_json(), causal=True)
    assert out.cpu()[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]  # mean of 0, 2, ... up to 2i


def check_assume_pure(fn):
    traces = []

    def block(x, w):
        traces.append(1)
        return torch.sin(x @ w)

    pure = fn(block)
    x = torch.tensor([[0.5, 1.0], [1.5, 2.0]])
    for _ in range(2):
        got = pure(x.to(_device()), x.to(_device()))
    assert_close(got.cpu(), torch.sin(x @ x))
    assert traces == [1]


def check_gradient_accumulation(fn):
    torch.manual_seed(0)
    model, data = torch.nn.Linear(3, 1), torch.randn(2, 4, 3)
    want = list(torch.autograd.grad(model(data).square().mean(), model.parameters()))
    ours = torch.nn.Linear(3, 1)
    ours.load_state_dict(model.state_dict())
    ours = ours.to(_device())
    loss = fn(lambda x: ours(x).square().mean(), (data.to(_device()),), ours)
    assert_close(loss.cpu(), model(data).square().mean().detach())
    assert_close([p.grad.cpu() for p in ours.parameters()], want, kind="grad")


def check_scan_gru(cls):
    torch.manual_seed(0)
    reference, x = torch.nn.GRU(3, 4), torch.randn(5, 2, 3)
    ours = cls(3, 4)
    ours.load_state_dict(reference.state_dict())
    with torch.no_grad():
        want, _ = reference(x)
        got, _ = ours.to(_device())(x.to(_device()))
    assert_close(got.cpu(), want)


def check_pure_module(cls):
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    with torch.no_grad():
        want = layer(x)
        got = cls(layer).to(_device())(x.to(_device()))
    assert_close(got.cpu(), want)


def check_scan_layers(fn):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    x = torch.randn(2, 4)
    with torch.no_grad():  # a graph holding the weights would keep .to() from swapping them
        want = layers[2](layers[1](layers[0](x)))
        got = fn(layers.to(_device()), x.to(_device()))
    assert_close(got.cpu(), want)


def check_fori_loop(fn):
    left, x = fn(0, 5, lambda v: v * 2, _xla([1.0]))
    assert (left.item(), x.cpu().tolist()) == (0, [32.0])


def check_while_loop(fn):
    i, x = fn(lambda i, x: i > 0, lambda i, x: (i - 1, x + 1), (_xla(10.0), _xla(3.0)))
    assert (i.item(), x.item()) == (0.0, 13.0)


def check_flash_attention(fn):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    scores = (q @ k.transpose(-1, -2)) * 0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v
    out = fn(*(t.float().to(_device()) for t in (q, k, v)), causal=True, sm_scale=0.5)
    assert_close(out.cpu(), expected.float())  # computed in float32: float32's row


def check_xlac_metrics_report(fn):
    (_xla([1.0, 2.0]) * 2).cpu()
    report = fn()
    assert report == met.metrics_report() and "Metric: CompileTime" in report


def check_xlac_tensors_text(fn):
    y = _xla([1.0, 2.0]).sin()
    text = fn([y])
    assert "aten.sin.default" in text
    spmd_torch.sync()


def check_xlac_tensors_hlo(fn):
    y = _xla([1.0, 2.0]).sin()
    assert "f32[2]{0} sine(f32[2]{0} %" in fn([y])
    spmd_torch.sync()


def check_xlac_lowering_context(cls):
    ctx = cls("Sum")
    x = _xla([1.0, 2.0])
    ctx.build([x + x])
    assert 'name: "Sum"' in ctx.hlo_text() and 'opcode: "add"' in ctx.hlo_text()
    assert ctx.parameter_id_tensor_mapping()[ctx.tensor_parameter_id(x)].tolist() == [1.0, 2.0]


def check_xlac_allow_execution(fn):
    pending = _xla([1.0, 2.0]) * 2
    fn(False)
    try:
        with pytest.raises(RuntimeError, match="Unexpected execution"):
            pending.cpu()
    finally:
        fn(True)
    assert pending.cpu().tolist() == [2.0, 4.0]


def check_builder_module_proto(fn):
    ctx = spmd_torch._XLAC.lowering.LoweringContext()
    ctx.build([_xla([1.0, 2.0]).sin()])
    computation = fn("sine", ctx.hlo())
    assert "f32[2]{0} sine(f32[2]{0} %" in get_computation_hlo(computation)
    with pytest.raises(NotImplementedError, match="printed"):
        computation.apply()


def check_xlac_from_cpu_shards(fn):
    xr.use_spmd()
    sharding = xs.Mesh(np.arange(8), (4, 2)).get_op_sharding((0, None))
    from_cpu_shards = spmd_torch._XLAC._global_tensor_from_cpu_shards
    t = from_cpu_shards([torch.tensor([[i // 2, i // 2]]) for i in range(8)], sharding)
    assert t.cpu().tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]


def check_xlac_buffer_donation(fn):
    t = _xla([1.0, 2.0, 3.0])
    spmd_torch.sync()
    assert fn(t, True) and spmd_torch._XLAC._get_buffer_donation(t)
    out = t * 2
    spmd_torch.sync(wait=True)
    assert out.cpu().tolist() == [2.0, 4.0, 6.0] and spmd_torch._XLAC._is_placecholder(t)


def check_xlac_manual_region(fn):
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (8,))
    x = _xla(list(range(8)))
    xs.mark_sharding(x, mesh, (0,))
    local = spmd_torch._XLAC._spmd_full_to_shard_shape(x)
    assert tuple(local.shape) == (1,)
    sharding = mesh.get_op_sharding((0,))
    full = spmd_torch._XLAC._spmd_shard_to_full_shape(local * local, sharding, (8,), x.dtype)
    assert full.cpu().tolist() == [float(i * i) for i in range(8)]


def check_profiler_trace(cls):
    with cls("region"):
        y = _xla([1.0]) * 4
    assert y.cpu().tolist() == [4.0]


def check_profiler_step_trace(cls):
    with cls("train_step", step_num=0):
        y = _xla([1.0]) + 2
    assert graph.pending_count() == 0 and y.cpu().tolist() == [3.0]


def check_profiler_trace_me(fn):
    @fn("scoped")
    def plus_one(t):
        return t + 1

    assert plus_one(_xla([1.0])).cpu().tolist() == [2.0]


# --- amp -----------------------------------------------------------------------------------------


def check_autocast(cls):
    a, b = torch.randn(4, 4).to(_device()), torch.randn(4, 4).to(_device())
    with cls(_device(), dtype=torch.bfloat16):
        product, soft = a @ b, torch.softmax(a, dim=-1)
    assert product.dtype == torch.bfloat16 and soft.dtype == torch.float32
    spmd_torch.sync()


def check_torch_autocast(fn):
    a = torch.randn(4, 4).to(_device())
    with fn("xla", dtype=torch.bfloat16):
        product = a @ a
    assert product.dtype == torch.bfloat16
    spmd_torch.sync()


def check_grad_scaler(cls):
    scaler = cls(init_scale=8.0)
    w = torch.nn.Parameter(_xla([1.0]))
    optimizer = torch.optim.SGD([w], lr=0.5)
    scaler.scale((w * 2).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert w.cpu().tolist() == [0.0]


def check_syncfree(cls, name):
    torch.manual_seed(0)
    start, x = torch.randn(3), torch.randn(3)
    reference = torch.nn.Parameter(start.clone())
    ours = torch.nn.Parameter(start.clone().to(_device()))
    ref_opt = getattr(torch.optim, name)([reference], lr=0.1)
    our_opt = cls([ours], lr=0.1)
    for _ in range(3):
        for p, opt, data in ((reference, ref_opt, x), (ours, our_opt, x.to(_device()))):
            opt.zero_grad()
            (p * data).square().sum().backward()
            opt.step()
        xm.mark_step()
    assert_close(ours.detach().cpu(), reference.detach())


# --- utils, test_utils, backends ----------------------------------------------------------------


def check_sample_generator(cls):
    sample = (torch.zeros(2), torch.ones(2))
    items = list(cls(data=sample, sample_count=3))
    assert len(items) == 3 and all(item is sample for item in items)
    assert len(cls(data=sample, sample_count=3)) == 3


def check_data_wrapper(cls):
    class Pair(cls):
        def __init__(self, a, b):
            super().__init__()
            self.a, self.b = a, b

        def get_tensors(self):
            return [self.a, self.b]

        def from_tensors(self, tensors):
            return Pair(*tensors)

    moved = xm.send_cpu_data_to_device([Pair(torch.ones(1), torch.zeros(1))], _device())
    assert moved[0].a.device.type == "xla" and moved[0].b.cpu().tolist() == [0.0]


def check_as_list(fn):
    assert fn(3) == [3] and fn([1, 2]) == [1, 2] and fn((1, 2)) == (1, 2)


def check_getenv_as(fn, monkeypatch):
    monkeypatch.setenv("MIGRATION_TABLE_INT", "12")
    monkeypatch.setenv("MIGRATION_TABLE_BOOL", "0")
    assert fn("MIGRATION_TABLE_INT", int) == 12
    assert fn("MIGRATION_TABLE_BOOL", bool) is False
    assert fn("MIGRATION_TABLE_UNSET", int, 5) == 5


def check_check_env_flag(fn, monkeypatch):
    monkeypatch.setenv("MIGRATION_TABLE_FLAG", "true")
    assert fn("MIGRATION_TABLE_FLAG") is True
    assert fn("MIGRATION_TABLE_UNSET_FLAG") is False


def check_for_each_instance(fn):
    seen = []
    fn({"a": [1, "x", (2, 3.0)]}, lambda v: isinstance(v, int), seen.append)
    assert sorted(seen) == [1, 2]


def check_for_each_instance_rewrite(fn):
    out = fn({"a": [1, "x", (2, 3.0)]}, lambda v: isinstance(v, int), lambda v: v * 10)
    assert out == {"a": [10, "x", (20, 3.0)]}


def check_get_free_tcp_ports(fn):
    ports = fn(2)
    assert len(ports) == 2 and len(set(ports)) == 2 and all(0 < p < 65536 for p in ports)


def check_lazy_property(cls):
    calls = []
    lazy = cls(lambda: calls.append(1) or 42)
    assert calls == [] and lazy.value == 42 and lazy.value == 42 and calls == [1]


def check_tmp_folder(cls):
    folder = cls()
    path = folder.name
    assert os.path.isdir(path)
    del folder
    gc.collect()
    assert not os.path.exists(path)


def check_fn_data_generator(cls):
    items = list(cls(lambda data: data.sum(1), 4, torch.ones, dims=(3,), count=2))
    assert len(items) == 2
    data, target = items[0]
    assert tuple(data.shape) == (4, 3) and target.tolist() == [3.0] * 4


def check_get_print_fn(fn):
    assert callable(fn(debug=True)) and callable(fn(debug=False))


def check_eprint(fn, capsys):
    fn("to stderr")
    assert capsys.readouterr().err == "to stderr\n"


def check_serialization(_fn, tmp_path):
    xser.save({"w": _xla([1.0, 2.0])}, str(tmp_path / "ckpt"))
    loaded = xser.load(str(tmp_path / "ckpt"))
    assert loaded["w"].tolist() == [1.0, 2.0]


def check_activation_checkpoint(fn):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    expected = torch.autograd.grad(torch.tanh(layer(x)).sum(), layer.weight)[0]
    dev = torch.nn.Linear(3, 3).to(_device())
    dev.load_state_dict(layer.state_dict())
    out = fn(lambda t: torch.tanh(dev(t)), x.to(_device()).requires_grad_(), use_reentrant=True)
    out.sum().backward()
    assert_close(dev.weight.grad.cpu(), expected, kind="grad")


def check_print_training_update(fn, capsys):
    fn(_device(), 10, 0.5, 100.0, 120.0)
    out = capsys.readouterr().out
    assert "Step=10" in out and "0.5" in out


def check_print_test_update(fn, capsys):
    fn(_device(), 91.5, 2, 30)
    out = capsys.readouterr().out
    assert "91.5" in out


@test_utils.mp_test  # the child process imports it by name: decorated at module level
def _sums_on_the_device_in_a_child(value):
    assert torch.ones(2).to(_device()).sum().item() == value


def check_mp_test(fn):
    assert fn is test_utils.mp_test
    assert _sums_on_the_device_in_a_child(2.0) == 0  # the child's exit code


def check_get_summary_writer(fn):
    assert fn(None) is None


def check_write_to_summary(fn):
    assert fn(None, 0, dict_to_write={"loss": 1.0}) is None


def check_close_summary_writer(fn):
    assert fn(None) is None


def check_mat_mul_precision(_fn):
    backends = importlib.import_module("spmd_torch.backends")
    before = backends.get_mat_mul_precision()
    try:
        backends.set_mat_mul_precision("highest")
        assert backends.get_mat_mul_precision() == "highest"
    finally:
        backends.set_mat_mul_precision(before)


def check_data_parallel(cls):
    seen = []

    def loop(model, loader, device, context):
        for _, (x, _target) in loader:
            seen.append((model.weight.device.type, x.cpu()[0, 0].item()))

    cls(torch.nn.Linear(3, 2), device_ids=[str(_device())])(loop, _batches())
    assert seen == [("xla", 0.0), ("xla", 1.0), ("xla", 2.0)]


def check_dtensor_distribute_tensor(fn):
    mesh = torch.distributed.device_mesh.DeviceMesh("xla", list(range(8)))
    out = fn(torch.arange(8.0), mesh, [torch.distributed.tensor.Shard(0)])
    assert isinstance(out, xs.XLAShardedTensor)
    assert out.global_tensor.cpu().tolist() == list(range(8))


def check_dtensor_distribute_module(fn):
    _distribute_module(fn)


CHECKS: dict[str, Callable] = {
    "device": check_device,
    "devices": check_devices,
    "real_devices": check_real_devices,
    "device_count": check_device_count,
    "sync": check_sync,
    "step": check_step,
    "compile": check_compile,
    "manual_seed": check_manual_seed,
    "launch": check_launch,
    "version": check_version,
    "xr.device_type": check_device_type,
    "xr.set_device_type": check_set_device_type,
    "xr.is_bf16_supported": check_is_bf16_supported,
    "jax_device_count": check_jax_device_count,
    "xr.global_runtime_device_attributes": check_global_runtime_device_attributes,
    "xr.use_spmd": check_use_spmd,
    "xr.is_spmd": check_is_spmd,
    "xm.is_xla_tensor": check_is_xla_tensor,
    "xm.get_xla_supported_devices": check_get_xla_supported_devices,
    "xm.xla_real_devices": check_xla_real_devices,
    "xm.xla_device_hw": check_xla_device_hw,
    "xm.parse_xla_device": check_parse_xla_device,
    "xm.xla_replication_devices": check_xla_replication_devices,
    "xm.master_print": check_master_print,
    "xm.wait_device_ops": check_wait_device_ops,
    "xm.unlazy": check_unlazy,
    "xm.add_step_closure": check_add_step_closure,
    "xm.RateTracker": check_rate_tracker,
    "xm.all_reduce": check_all_reduce,
    "xm.all_gather": check_all_gather,
    "xm.reduce_scatter": check_reduce_scatter,
    "xm.all_to_all": check_all_to_all,
    "xm.collective_permute": check_collective_permute,
    "xm.collective_broadcast": check_collective_broadcast,
    "xm.all_gather_bucketized": check_all_gather_bucketized,
    "xm.reduce_scatter_bucketized": check_reduce_scatter_bucketized,
    "xm.all_reduce_bucketized_gradients": check_all_reduce_bucketized_gradients,
    "xm.reduce_gradients": check_reduce_gradients,
    "xm.optimizer_step": check_optimizer_step,
    "xm.save": check_save,
    "xm.send_cpu_data_to_device": check_send_cpu_data_to_device,
    "xm.rendezvous": check_rendezvous,
    "xm.xla_rendezvous": check_xla_rendezvous,
    "xm.mesh_reduce": check_mesh_reduce,
    "xm.do_on_ordinals": check_do_on_ordinals,
    "xm.rng_state": check_rng_state,
    "xm.fork_rng": check_fork_rng,
    "xm.get_memory_info": check_get_memory_info,
    "xm.optimization_barrier_": check_optimization_barrier_,
    "xm.broadcast_master_param": check_broadcast_master_param,
    "xm.get_stablehlo": check_get_stablehlo,
    "xf.all_reduce": check_functions_all_reduce,
    "xf.all_gather": check_functions_all_gather,
    "xf.SyncBatchNorm": check_sync_batch_norm,
    "xmp.spawn": check_spawn,
    "xmp.MpModelWrapper": check_mp_model_wrapper,
    "pl.MpDeviceLoader": check_mp_device_loader,
    "pl.ParallelLoader": check_parallel_loader,
    "pl.PerDeviceLoader": check_per_device_loader,
    "xla_backend": check_xla_backend,
    "process_group_class": check_process_group_class,
    "xs.Mesh": check_mesh,
    "xs.HybridMesh": check_hybrid_mesh,
    "xs.get_1d_mesh": check_get_1d_mesh,
    "xs.global_mesh": check_global_mesh,
    "xs.ShardingType": check_sharding_type,
    "xs.ShardingSpec": check_sharding_spec,
    "xs.mark_sharding": check_mark_sharding,
    "xs.mark_sharding_with_gradients": check_mark_sharding_with_gradients,
    "xs.MarkShardingFunction": check_mark_sharding_function,
    "xs.clear_sharding": check_clear_sharding,
    "xs.wrap_if_sharded": check_wrap_if_sharded,
    "xs.XLAShardedTensor": check_xla_sharded_tensor,
    "xs.XLAShard": check_xla_shard,
    "xs.manual_sharding": check_manual_sharding,
    "xs.shard_as": check_shard_as,
    "xs.annotate_custom_sharding": check_annotate_custom_sharding,
    "xs.apply_backward_optimization_barrier": check_apply_backward_optimization_barrier,
    "xs.xla_distribute_tensor": check_xla_distribute_tensor,
    "xs.xla_distribute_module": check_xla_distribute_module,
    "xs.auto_policy": check_auto_policy,
    "xs.XLAPatchedLinear": check_xla_patched_linear,
    "xs.xla_patched_nn_linear_forward": check_xla_patched_nn_linear_forward,
    "experimental.compile": check_experimental_compile,
    "xs.convert_to_xla_mesh": check_convert_to_xla_mesh,
    "xs.visualize_tensor_sharding": check_visualize_tensor_sharding,
    "xs.visualize_sharding": check_visualize_sharding,
    "fsdp.transformer_auto_wrap_policy": check_transformer_auto_wrap_policy,
    "fsdp.size_based_auto_wrap_policy": check_size_based_auto_wrap_policy,
    "fsdp.checkpoint_module": check_checkpoint_module,
    "eager_mode": check_eager_mode,
    "eager_mode_context": check_eager_mode_context,
    "fsdp_v2": check_fsdp_v2,
    "dcp.CheckpointManager": check_checkpoint_manager,
    "dcp.planners": check_dcp_planners,
    "dcp.prime_optimizer": check_prime_optimizer,
    "met.metrics_report": check_metrics_report,
    "met.short_metrics_report": check_short_metrics_report,
    "met.counters": check_met_counters,
    "met.metrics": check_met_metrics,
    "met.clear": check_met_clear,
    "met.executed_fallback_ops": check_executed_fallback_ops,
    "mcu.get_data_points": check_mcu_get_data_points,
    "mcu.compare_metrics": check_mcu_compare_metrics,
    "xp.trace_files": check_profiler_trace_files,
    "xp.Trace": check_profiler_trace,
    "flash_attention": check_flash_attention,
    "scan": check_scan,
    "value_and_grad_partitioned": check_value_and_grad_partitioned,
    "tree_flatten_none": check_tree_flatten_none,
    "gmm": check_gmm,
    "paged_attention": check_paged_attention,
    "quantized_matmul_int8": check_quantized_matmul_int8,
    "XlaQuantizedLinear": check_XlaQuantizedLinear,
    "multi_queries_paged_attention": check_multi_queries_paged_attention,
    "ragged_paged_attention": check_ragged_paged_attention,
    "make_kernel_from_pallas": check_make_kernel_from_pallas,
    "trace_pallas": check_trace_pallas,
    "splash_attention": check_splash_attention,
    "assume_pure": check_assume_pure,
    "PureModule": check_pure_module,
    "scan_gru": check_scan_gru,
    "gradient_accumulation": check_gradient_accumulation,
    "scan_layers": check_scan_layers,
    "fori_loop": check_fori_loop,
    "while_loop": check_while_loop,
    "xlac.metrics_report": check_xlac_metrics_report,
    "xlac.tensors_text": check_xlac_tensors_text,
    "xlac.tensors_hlo": check_xlac_tensors_hlo,
    "xlac.lowering_context": check_xlac_lowering_context,
    "xlac.allow_execution": check_xlac_allow_execution,
    "builder.module_proto": check_builder_module_proto,
    "xlac.from_cpu_shards": check_xlac_from_cpu_shards,
    "xlac.buffer_donation": check_xlac_buffer_donation,
    "xlac.manual_region": check_xlac_manual_region,
    "xp.start_server": check_profiler_start_server,
    "xp.trace": check_profiler_capture_from_server,
    "xp.StepTrace": check_profiler_step_trace,
    "xp.trace_me": check_profiler_trace_me,
    "amp.autocast": check_autocast,
    "amp.torch_autocast": check_torch_autocast,
    "amp.GradScaler": check_grad_scaler,
    "xu.SampleGenerator": check_sample_generator,
    "xu.DataWrapper": check_data_wrapper,
    "xu.as_list": check_as_list,
    "xu.getenv_as": check_getenv_as,
    "xu.check_env_flag": check_check_env_flag,
    "xu.for_each_instance": check_for_each_instance,
    "xu.for_each_instance_rewrite": check_for_each_instance_rewrite,
    "xu.get_free_tcp_ports": check_get_free_tcp_ports,
    "xu.LazyProperty": check_lazy_property,
    "xu.TmpFolder": check_tmp_folder,
    "xu.FnDataGenerator": check_fn_data_generator,
    "xu.get_print_fn": check_get_print_fn,
    "xu.eprint": check_eprint,
    "xser.save_load": check_serialization,
    "checkpoint": check_activation_checkpoint,
    "tu.print_training_update": check_print_training_update,
    "tu.print_test_update": check_print_test_update,
    "tu.mp_test": check_mp_test,
    "tu.get_summary_writer": check_get_summary_writer,
    "tu.write_to_summary": check_write_to_summary,
    "tu.close_summary_writer": check_close_summary_writer,
    "backends.mat_mul_precision": check_mat_mul_precision,
    "data_parallel": check_data_parallel,
    "dtensor.distribute_tensor": check_dtensor_distribute_tensor,
    "dtensor.distribute_module": check_dtensor_distribute_module,
}


def check_alias(obj, target: str):
    assert obj is resolve(target), f"not the same object as {target}"


def check_value(obj, literal: str):
    assert obj == ast.literal_eval(literal)


def check_value_call(fn, literal: str):
    assert fn() == ast.literal_eval(literal)


def check_signature(fn, names: str):
    parameters = inspect.signature(fn).parameters
    missing = [name for name in names.split(",") if name not in parameters]
    assert not missing, f"parameters {missing} missing from {inspect.signature(fn)}"


PARAMETRIC: dict[str, Callable] = {
    "alias": check_alias,
    "value": check_value,
    "value_call": check_value_call,
    "signature": check_signature,
    "met.metric": check_metric,
    "met.counter": check_counter,
    "met.spmd_metric": check_spmd_metric,
    "met.eager_metric": check_eager_metric,
    "syncfree": check_syncfree,
}

# Fixtures a check may ask for by parameter name.
_FIXTURES = ("monkeypatch", "capsys", "tmp_path")


@pytest.fixture
def engine_restored(monkeypatch):
    """Checks may turn SPMD on or set a global mesh: start and end with the default engine."""
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    global_mesh = xs.get_global_mesh()
    yield
    xs.set_global_mesh(global_mesh)
    xr.reset()


# Checks that spawn an OS process (mp_test runs the function in a child): marked multiprocess.
_SPAWNS_PROCESSES = {"tu.mp_test"}


def _row_params() -> list:
    return [
        pytest.param(
            row,
            id=row["name"],
            marks=[pytest.mark.multiprocess] if row["check"] in _SPAWNS_PROCESSES else [],
        )
        for row in rows()
    ]


@pytest.mark.parametrize("row", _row_params())
def test_row(row, engine_restored, request):
    if row["status"] == "absent":
        assert row["check"] == "absent", f"absent row with check {row['check']!r}"
        with pytest.raises((ImportError, AttributeError)):
            resolve(row["ours"])
        return
    obj = resolve(row["ours"])
    kind, _, argument = row["check"].partition(":")
    check = PARAMETRIC[kind] if argument else CHECKS[row["check"]]
    extra = {
        name: request.getfixturevalue(name)
        for name in _FIXTURES
        if name in inspect.signature(check).parameters
    }
    if argument:
        check(obj, argument, **extra)
    else:
        check(obj, **extra)


def test_table_has_a_check_for_every_row():
    known = set(CHECKS) | {"absent"}
    unknown = [
        row["name"]
        for row in rows()
        if row["check"].partition(":")[0] not in PARAMETRIC and row["check"] not in known
    ]
    assert not unknown, f"rows with no check function: {unknown}"


def test_table_counts_match_its_summary():
    table = rows()
    present = sum(row["status"] == "present" for row in table)
    summary = f"Rows: **{len(table)}; present {present}, absent {len(table) - present}"
    assert summary in TABLE.read_text(), f"update the summary line of migration.md: {summary}"
