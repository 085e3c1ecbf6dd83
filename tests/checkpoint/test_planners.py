"""SPMDSavePlanner / SPMDLoadPlanner through torch.distributed.checkpoint in one process (no process
group): bit-exact round trips of a trained model and its AdamW state, resharded onto other meshes,
one device and back; replicas written once; bad targets refused and left untouched. The reference
is always the tensors' CPU values taken before saving."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dist_cp
import torch.nn.functional as F
import torch.utils._pytree as pytree
from jax.sharding import SingleDeviceSharding
from torch import nn
from torch.distributed.checkpoint import CheckpointException

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch._lazy import placement
from spmd_torch.experimental.distributed_checkpoint._helpers import (
    _CpuShards,
    _sharded_cpu_state_dict,
)
from spmd_torch.experimental.distributed_checkpoint.planners import SPMDLoadPlanner, SPMDSavePlanner
from tests.helpers import assert_close

dev = spmd_torch.device()

# DCP says it runs in one process when no process group is initialised: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MESHES = {
    "1d": lambda: xs.Mesh(np.arange(8), (8,), ("data",)),
    "4x2": lambda: xs.Mesh(np.arange(8), (4, 2), ("x", "y")),
    "2x4": lambda: xs.Mesh(np.arange(8), (2, 4), ("x", "y")),
}

# Parameter specs of the model below (weights (20, 12) and (6, 20), biases (20,) and (6,)); 20
# rows over 8 and 6 rows over 4 or 8 are uneven. Unlisted parameters stay replicated.
SPECS = {
    "1d": {"0.weight": ("data", None), "0.bias": ("data",), "2.weight": (None, "data")},
    "4x2": {"0.weight": ("y", "x"), "0.bias": ("x",), "2.weight": ("x", "y"), "2.bias": ("y",)},
    "2x4": {
        "0.weight": (None, "y"),
        "0.bias": ("y",),
        "2.weight": ("y", "x"),
        "2.bias": (("x", "y"),),
    },
}


@pytest.fixture
def spmd_mode():
    xr.use_spmd()


def _trained(seed: int, layout: str | None, steps: int, lr: float):
    """A model and its AdamW after ``steps`` steps, parameters and optimizer moments marked with
    ``SPECS[layout]`` (None: unmarked, so replicated in SPMD mode and on one device otherwise)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 6)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    params = dict(model.named_parameters())
    specs = SPECS[layout] if layout else {}
    mesh = MESHES[layout]() if layout else None
    for name, spec in specs.items():
        xs.mark_sharding(params[name], mesh, spec)
    for _ in range(steps):
        x, y = torch.randn(8, 12), torch.randint(0, 6, (8,))
        F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
        opt.zero_grad()
        spmd_torch.sync()
    for name, spec in specs.items():
        for moment in ("exp_avg", "exp_avg_sq"):
            xs.mark_sharding(opt.state[params[name]][moment], mesh, spec)
    return model, opt


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _cpu_copy(tree):
    return pytree.tree_map(lambda v: v.cpu().clone() if isinstance(v, torch.Tensor) else v, tree)


def _layouts(tree) -> dict:
    leaves = pytree.tree_flatten_with_path(tree)[0]
    return {
        pytree.keystr(path): placement.layout_of(v)
        for path, v in leaves
        if isinstance(v, torch.Tensor) and v.device.type == "xla"
    }


def _save(state, path) -> None:
    dist_cp.save(state, storage_writer=dist_cp.FileSystemWriter(path), planner=SPMDSavePlanner())


def _load(state, path) -> None:
    dist_cp.load(state, storage_reader=dist_cp.FileSystemReader(path), planner=SPMDLoadPlanner())


def _load_error(state, path) -> BaseException:
    """The planner's error from loading into ``state`` (DCP reports it wrapped, by rank)."""
    with pytest.raises(CheckpointException) as caught:
        _load(state, path)
    ((error, _),) = caught.value.failures.values()
    return error


def _assert_loaded(model, opt, state, expected) -> None:
    """``state`` (and, in place, the model's parameters and the optimizer's moments) equal the
    saved values bit for bit; Python values (the learning rate) are the saved ones."""
    assert_close(state, expected, tol="exact")
    assert_close(dict(model.named_parameters()), dict(expected["model"]), tol="exact")
    for index, param in enumerate(model.parameters()):
        for moment in ("exp_avg", "exp_avg_sq"):
            saved = expected["optim"]["state"][index][moment]
            assert_close(opt.state[param][moment], saved, tol="exact")
    assert state["optim"]["param_groups"][0]["lr"] == 0.1


@pytest.mark.parametrize("target", ["4x2", "2x4", None], ids=["4x2", "2x4", "replicated"])
def test_load_reshards_onto_the_target_layout(spmd_mode, tmp_path, target):
    model, opt = _trained(seed=0, layout="1d", steps=2, lr=0.1)
    state = _state(model, opt)
    expected = _cpu_copy(state)
    _save(state, tmp_path)

    model2, opt2 = _trained(seed=1, layout=target, steps=1, lr=0.05)
    state2 = _state(model2, opt2)
    layouts = _layouts(state2)
    _load(state2, tmp_path)

    _assert_loaded(model2, opt2, state2, expected)
    assert _layouts(state2) == layouts
    sharded = [k for k, layout in layouts.items() if not layout.is_fully_replicated]
    assert len(sharded) == (3 * len(SPECS[target]) if target else 0)  # parameters and moments


def test_load_onto_single_device_tensors(spmd_mode, tmp_path):
    model, opt = _trained(seed=0, layout="1d", steps=2, lr=0.1)
    state = _state(model, opt)
    expected = _cpu_copy(state)
    _save(state, tmp_path)
    xr.reset()  # SPMD off: new tensors live on one device

    model2, opt2 = _trained(seed=1, layout=None, steps=1, lr=0.05)
    state2 = _state(model2, opt2)
    _load(state2, tmp_path)

    _assert_loaded(model2, opt2, state2, expected)
    assert all(type(layout) is SingleDeviceSharding for layout in _layouts(state2).values())


def test_load_from_single_device_onto_a_sharded_target(request, tmp_path):
    model, opt = _trained(seed=0, layout=None, steps=2, lr=0.1)
    state = _state(model, opt)
    assert all(type(layout) is SingleDeviceSharding for layout in _layouts(state).values())
    expected = _cpu_copy(state)
    _save(state, tmp_path)
    request.getfixturevalue("spmd_mode")

    model2, opt2 = _trained(seed=1, layout="1d", steps=1, lr=0.05)
    state2 = _state(model2, opt2)
    layouts = _layouts(state2)
    _load(state2, tmp_path)

    _assert_loaded(model2, opt2, state2, expected)
    assert _layouts(state2) == layouts


# (mesh, tensor shape, spec, the saved chunks as (offsets, sizes))
CHUNKS = {
    "rows_over_4_of_8": ("4x2", (8, 4), ("x", None), [((r, 0), (2, 4)) for r in (0, 2, 4, 6)]),
    "columns_over_2_of_8": ("4x2", (8, 4), (None, "y"), [((0, 0), (8, 2)), ((0, 2), (8, 2))]),
    "both_axes": (
        "4x2",
        (8, 4),
        ("x", "y"),
        [((r, c), (2, 2)) for r in (0, 2, 4, 6) for c in (0, 2)],
    ),
    "replicated": ("4x2", (8, 4), (None, None), [((0, 0), (8, 4))]),
    "uneven": (
        "1d",
        (20, 3),
        ("data", None),
        [((r, 0), (min(3, 20 - r), 3)) for r in range(0, 20, 3)],
    ),
}


@pytest.mark.parametrize("case", CHUNKS)
def test_each_distinct_shard_is_written_once(spmd_mode, tmp_path, case):
    mesh, shape, spec, chunks = CHUNKS[case]
    values = torch.randn(shape)
    pending = torch.mul(values.to(dev), 1.0)  # the planner computes pending values itself
    wrapped = xs.mark_sharding(pending, MESHES[mesh](), spec)
    _save({"w": wrapped, "step": 3}, tmp_path)

    saved = dist_cp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"]
    got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in saved.chunks)
    assert got == sorted(chunks)
    # The chunks hold the right values: read back by DCP's default planner into CPU tensors.
    target = {"w": torch.zeros(shape), "step": 0}
    dist_cp.load(target, storage_reader=dist_cp.FileSystemReader(tmp_path))
    assert_close(target, {"w": values, "step": 3}, tol="exact")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_values_keep_their_dtype_bit_for_bit(spmd_mode, tmp_path, dtype):
    values = (torch.randn(20, 6) * 100).to(dtype)
    saved = values.to(dev)
    xs.mark_sharding(saved, MESHES["1d"](), ("data", None))
    _save({"w": saved}, tmp_path)
    target = torch.zeros(20, 6, dtype=dtype).to(dev)
    xs.mark_sharding(target, MESHES["4x2"](), ("y", "x"))

    _load({"w": target}, tmp_path)

    assert_close(target, values, tol="exact")


def test_each_distinct_target_shard_reads_only_the_chunks_it_overlaps(spmd_mode, tmp_path):
    values = torch.randn(8, 4)
    saved = values.to(dev)
    xs.mark_sharding(saved, MESHES["1d"](), ("data", None))  # 8 chunks of one row
    _save({"w": saved}, tmp_path)
    target = torch.zeros(8, 4).to(dev)
    wrapped = xs.mark_sharding(target, MESHES["4x2"](), ("x", None))  # 4 shards of 2 rows, twice
    reader = dist_cp.FileSystemReader(tmp_path)
    planner = SPMDLoadPlanner()
    planner.set_up_planner({"w": wrapped}, reader.read_metadata())

    reads = planner.create_local_plan().items

    got = sorted((r.dest_index.offset[0], r.storage_index.offset[0]) for r in reads)
    assert got == [(shard, shard + row) for shard in (0, 2, 4, 6) for row in (0, 1)]
    _load({"w": wrapped}, tmp_path)
    assert_close(target, values, tol="exact")


def _mixed_state() -> tuple[dict, dict]:
    """A nested state dict with tiled, partially replicated, replicated, single-layout and CPU
    tensors and a Python value, and its CPU values."""
    values = {"tiled": torch.randn(8, 4), "partial": torch.randn(20, 3), "repl": torch.randn(6)}
    tiled, partial, repl = (values[k].to(dev) for k in ("tiled", "partial", "repl"))
    xs.mark_sharding(tiled, MESHES["4x2"](), ("x", "y"))
    xs.mark_sharding(partial, MESHES["4x2"](), ("x", None))  # uneven, replicated over "y"
    xs.mark_sharding(repl, MESHES["4x2"](), (None,))
    cpu = torch.randn(3)
    state = {"m": {"tiled": tiled, "partial": partial, "repl": repl}, "cpu": cpu, "step": 7}
    expected = {"m": dict(values), "cpu": cpu.clone(), "step": 7}
    return state, expected


UNSHARDED = ["m.repl", "cpu", "step"]


@pytest.mark.parametrize("on_cpu", [False, True], ids=["xla", "cpu_shards"])
def test_save_planner_separates_tensors_split_over_devices(spmd_mode, on_cpu):
    state, _ = _mixed_state()
    planner = SPMDSavePlanner()
    planner.set_up_planner(_sharded_cpu_state_dict(state) if on_cpu else state, True)

    assert planner.is_coordinator
    assert sorted(planner.sharded_state_dict) == ["m.partial", "m.tiled"]
    kind = _CpuShards if on_cpu else xs.XLAShardedTensor
    assert all(type(v) is kind for v in planner.sharded_state_dict.values())
    assert sorted(planner.unsharded_state_dict) == sorted(UNSHARDED)
    assert planner.unsharded_state_dict["step"] == 7
    repl = planner.unsharded_state_dict["m.repl"]
    assert repl.device.type == ("cpu" if on_cpu else "xla")
    assert not isinstance(repl, xs.XLAShardedTensor)


def test_load_planner_separates_tensors_split_over_devices(spmd_mode, tmp_path):
    state, _ = _mixed_state()
    _save(state, tmp_path)
    planner = SPMDLoadPlanner()
    planner.set_up_planner(state, dist_cp.FileSystemReader(tmp_path).read_metadata(), True)

    assert sorted(planner.sharded_state_dict) == ["m.partial", "m.tiled"]
    assert planner.sharded_state_dict["m.tiled"].global_tensor is state["m"]["tiled"]
    assert sorted(planner.unsharded_state_dict) == sorted(UNSHARDED)
    assert planner.unsharded_state_dict["m.repl"] is state["m"]["repl"]


@pytest.mark.parametrize("on_cpu", [False, True], ids=["xla", "cpu_shards"])
def test_a_write_item_names_its_local_shard(spmd_mode, on_cpu):
    """One write item per distinct shard, ``index.index`` its place in ``local_shards`` (replicas
    on devices 1, 3, 5, 7 and the shard of padding are not written); one per unsharded tensor."""
    state, _ = _mixed_state()
    planner = SPMDSavePlanner()
    planner.set_up_planner(_sharded_cpu_state_dict(state) if on_cpu else state, True)

    items = planner.create_local_plan().items

    by_key: dict = {}
    for item in items:
        by_key.setdefault(item.index.fqn, []).append(item)
    assert sorted(by_key) == ["cpu", "m.partial", "m.repl", "m.tiled", "step"]
    assert [len(by_key[k]) for k in ("cpu", "m.repl", "step")] == [1, 1, 1]
    partial = sorted(by_key["m.partial"], key=lambda item: item.index.index)
    # 20 rows over 4: rows 0-4, 5-9, 10-14, 15-19 on devices 0/1, 2/3, 4/5, 6/7.
    assert [item.index.index for item in partial] == [0, 2, 4, 6]
    assert [item.index.offset for item in partial] == [(0, 0), (5, 0), (10, 0), (15, 0)]
    assert sorted(item.index.index for item in by_key["m.tiled"]) == list(range(8))
    for key in ("m.tiled", "m.partial"):
        shards = xs.wrap_if_sharded(_fqn(state, key)).local_shards
        for item in by_key[key]:
            shard = shards[item.index.index]
            assert item.index.offset == torch.Size(s.start for s in shard.indices)
            assert_close(planner.resolve_data(item), shard.data, tol="exact")


def _fqn(state: dict, key: str):
    value = state
    for part in key.split("."):
        value = value[part]
    return value


@pytest.mark.parametrize("target", ["cpu", "xla_default", "xla_spmd"])
def test_cpu_shards_round_trip(spmd_mode, tmp_path, target):
    state, expected = _mixed_state()
    _save(_sharded_cpu_state_dict(state), tmp_path)

    metadata = dist_cp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    chunks = sorted(tuple(c.offsets) for c in metadata["m.partial"].chunks)
    assert chunks == [(0, 0), (5, 0), (10, 0), (15, 0)]  # each distinct shard once
    out = {"m": {k: torch.zeros_like(v) for k, v in expected["m"].items()}}
    out.update(cpu=torch.zeros(3), step=0)
    if target == "cpu":  # DCP's default planner
        dist_cp.load(out, storage_reader=dist_cp.FileSystemReader(tmp_path))
    else:
        out["m"] = {k: v.to(dev) for k, v in out["m"].items()}
        if target == "xla_spmd":
            xs.mark_sharding(out["m"]["tiled"], MESHES["2x4"](), ("y", None))
            xs.mark_sharding(out["m"]["partial"], MESHES["1d"](), (None, "data"))
            _load(out, tmp_path)
        else:
            dist_cp.load(out, storage_reader=dist_cp.FileSystemReader(tmp_path))
    assert_close(out, expected, tol="exact")


def test_a_planner_keeps_nothing_from_its_last_checkpoint(spmd_mode, tmp_path):
    save, load = SPMDSavePlanner(), SPMDLoadPlanner()
    first, second = torch.randn(8), torch.randn(3)
    dist_cp.save(
        {"a": first.to(dev)}, storage_writer=dist_cp.FileSystemWriter(tmp_path / "1"), planner=save
    )
    dist_cp.save(
        {"b": second.to(dev)}, storage_writer=dist_cp.FileSystemWriter(tmp_path / "2"), planner=save
    )
    target = {"b": torch.zeros(3).to(dev)}
    for state, name in (({"a": torch.zeros(8).to(dev)}, "1"), (target, "2")):
        dist_cp.load(state, storage_reader=dist_cp.FileSystemReader(tmp_path / name), planner=load)

    metadata = dist_cp.FileSystemReader(tmp_path / "2").read_metadata()
    assert list(metadata.state_dict_metadata) == ["b"]
    assert_close(target, {"b": second}, tol="exact")


def test_plain_filesystem_writer_saves_through_the_xla_stream(spmd_mode, tmp_path):
    values = torch.randn(8, 4)
    state = {"w": values.to(dev)}
    xs.mark_sharding(state["w"], MESHES["1d"](), ("data", None))
    dist_cp.save(
        state, storage_writer=dist_cp.FileSystemWriter(tmp_path), planner=SPMDSavePlanner()
    )
    target = {"w": torch.zeros(8, 4)}
    dist_cp.load(target, storage_reader=dist_cp.FileSystemReader(tmp_path))
    assert_close(target, {"w": values}, tol="exact")


def _target_and_reference(extra: dict):
    """A sharded target state dict with ``extra`` entries last, and its CPU values and layouts."""
    model, opt = _trained(seed=1, layout="4x2", steps=1, lr=0.05)
    state = {**_state(model, opt), **extra}
    return state, _cpu_copy(state), _layouts(state)


def test_missing_key_raises_and_leaves_the_target_untouched(spmd_mode, tmp_path):
    model, opt = _trained(seed=0, layout="1d", steps=2, lr=0.1)
    _save(_state(model, opt), tmp_path)
    extra = torch.zeros(4, 4).to(dev)
    xs.mark_sharding(extra, MESHES["4x2"](), ("x", "y"))
    state, before, layouts = _target_and_reference({"zz_extra": {"w": extra}})

    error = _load_error(state, tmp_path)

    assert isinstance(error, RuntimeError)
    assert "Missing key in checkpoint state_dict: 'zz_extra.w'" in str(error)
    assert "shape (4, 4)" in str(error)

    assert_close(state, before, tol="exact")
    assert _layouts(state) == layouts


@pytest.mark.parametrize("where", ["xla_sharded", "cpu"])
def test_shape_mismatch_raises_and_leaves_the_target_untouched(spmd_mode, tmp_path, where):
    model, opt = _trained(seed=0, layout="1d", steps=2, lr=0.1)
    saved = _state(model, opt)
    saved["zz_last"] = torch.ones(6, 4) if where == "cpu" else saved["model"]["2.weight"]
    _save(saved, tmp_path)
    wrong = torch.zeros(6, 5)
    if where == "xla_sharded":
        wrong = wrong.to(dev)
        xs.mark_sharding(wrong, MESHES["4x2"](), ("y", None))
    state, before, layouts = _target_and_reference({"zz_last": wrong})

    error = _load_error(state, tmp_path)

    saved_shape = (6, 4) if where == "cpu" else (6, 20)
    assert isinstance(error, ValueError)
    assert str(error).startswith(
        f"checkpoint key 'zz_last' holds a tensor of shape {saved_shape}; the target's has shape "
        "(6, 5)"
    )

    assert_close(state, before, tol="exact")
    assert _layouts(state) == layouts
