"""One-call save and load of sharded state: bit-exact round trips, resharding onto other meshes and
one device, optimizer state created by restore, resumed training, and every bad input refused with
the target untouched. The reference is always the tensors' CPU values taken before saving."""

from __future__ import annotations

import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.spmd as xs
import spmd_torch.experimental.distributed_checkpoint as xc
import spmd_torch.runtime as xr
from tests.helpers import assert_close

DEV = torch.device("xla", 0)


class Net(torch.nn.Module):
    """Two linears, the second uneven on an 8-way axis (12 columns), with dropout."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 24)
        self.fc2 = torch.nn.Linear(12, 5)

    def forward(self, x):
        h = F.dropout(F.relu(self.fc1(x)), 0.25, training=True)
        return self.fc2(h[:, :12] + h[:, 12:])


def mesh_1d():
    return xs.Mesh(np.arange(8), (8,), ("d",))


def build(seed: int, mesh=None, specs=(("d", None), (None, "d"))):
    """A Net with its AdamW optimizer, its weights marked on ``mesh`` (None: unmarked)."""
    torch.manual_seed(seed)
    model = Net().to(DEV)
    if mesh is not None:
        xs.mark_sharding(model.fc1.weight, mesh, specs[0])
        xs.mark_sharding(model.fc2.weight, mesh, specs[1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps: int, seed: int = 0) -> list[float]:
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + i)
        x = torch.randn(8, 16, generator=g).to(DEV)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        spmd_torch.sync()
        losses.append(loss.item())
    return losses


def state_of(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def cpu_copy(value):
    """The reference: every tensor's values on the CPU, containers copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


def assert_same(actual, expected, path="") -> None:
    """Bit-exact equality of a state dict with its CPU reference, key by key."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual.detach().cpu(), expected), path
    elif isinstance(expected, dict):
        assert set(map(str, actual)) == set(map(str, expected)), path
        by_text = {str(k): v for k, v in actual.items()}
        for key, value in expected.items():
            assert_same(by_text[str(key)], value, f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}.{i}")
    else:
        assert actual == expected, path


def spec_of(t) -> str:
    return xs.get_xla_sharding_spec(t)


@pytest.fixture
def spmd_mode():
    xr.use_spmd()


@pytest.fixture
def saved(tmp_path, spmd_mode):
    """A model and AdamW trained 2 steps on the 1-D mesh, saved; with its CPU reference."""
    model, opt = build(0, mesh_1d())
    train(model, opt, 2)
    state = {**state_of(model, opt), "epoch": 7, "tag": "run-a", "cpu": torch.arange(6) * 3}
    state["extras"] = [1.5, None, (True, "x")]
    reference = cpu_copy(state)
    path = tmp_path / "ckpt"
    xc.save(state, path)
    return path, reference, model


def test_round_trip_is_bit_exact_and_keeps_the_targets_shardings(saved):
    path, reference, trained = saved
    model, opt = build(1, mesh_1d())
    train(model, opt, 1, seed=50)  # the target's state exists and differs
    state = {**state_of(model, opt), "epoch": 0, "tag": "", "cpu": torch.zeros(6, dtype=torch.long)}
    state["extras"] = [0.0, 1, (False, "")]
    xc.load(state, path)
    assert_same(state, reference)
    assert_same(model.state_dict(), reference["model"])  # the parameters themselves, in place
    assert spec_of(model.fc1.weight) == spec_of(trained.fc1.weight)
    assert spec_of(model.fc2.weight) == spec_of(trained.fc2.weight)  # uneven: 12 over 8


@pytest.mark.parametrize(
    "shape, names, specs",
    [
        ((4, 2), ("a", "b"), (("b", "a"), (None, "a"))),
        ((2, 4), ("x", "y"), ((None, ("x", "y")), ("x", "y"))),
    ],
)
def test_restore_onto_another_mesh_reshards(saved, shape, names, specs):
    path, reference, _ = saved
    mesh = xs.Mesh(np.arange(8), shape, names)
    model, opt = build(1, mesh, specs)
    state = state_of(model, opt)
    xc.load(state, path)
    opt.load_state_dict(state["optim"])
    assert_same(state_of(model, opt), {k: reference[k] for k in ("model", "optim")})
    expected = xs.Mesh(np.arange(8), shape, names)
    probe = torch.zeros(24, 16, device=DEV)
    xs.mark_sharding(probe, expected, specs[0])
    assert spec_of(model.fc1.weight) == spec_of(probe)


def test_restore_onto_one_device_and_back_onto_the_mesh(saved, tmp_path):
    path, reference, _ = saved
    xr.reset()  # SPMD off: one device
    model, opt = build(1)
    state = state_of(model, opt)
    xc.load(state, path)
    opt.load_state_dict(state["optim"])
    assert_same(state_of(model, opt), {k: reference[k] for k in ("model", "optim")})
    assert model.fc1.weight.device == DEV
    back = tmp_path / "from-one-device"
    xc.save(state_of(model, opt), back)
    xr.use_spmd()
    sharded, sharded_opt = build(2, mesh_1d())
    target = state_of(sharded, sharded_opt)
    xc.load(target, back)
    assert_same(target, {k: reference[k] for k in ("model", "optim")})
    assert spec_of(sharded.fc1.weight) == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def test_restore_creates_a_fresh_optimizers_state_with_the_parameters_layout(saved):
    path, reference, _ = saved
    model, opt = build(1, mesh_1d())
    state = state_of(model, opt)
    assert state["optim"]["state"] == {}
    xc.load(state, path)
    opt.load_state_dict(state["optim"])
    assert_same(opt.state_dict(), reference["optim"])
    created = opt.state[model.fc1.weight]["exp_avg"]
    assert created.device == DEV and created.shape == (24, 16)
    assert opt.state[model.fc1.weight]["step"].device.type == "cpu"  # AdamW keeps step on CPU


@pytest.mark.users_codegen
@pytest.mark.parametrize("other_mesh", [False, True], ids=["same-mesh", "other-mesh"])
def test_resumed_training_continues_with_the_uninterrupted_losses(tmp_path, spmd_mode, other_mesh):
    xm.set_rng_state(123)
    model, opt = build(0, mesh_1d())
    uninterrupted = train(model, opt, 5)

    xm.set_rng_state(123)
    model, opt = build(0, mesh_1d())
    first = train(model, opt, 3)
    xc.save({**state_of(model, opt), "rng": xm.get_rng_state()}, tmp_path / "ckpt")
    saved = cpu_copy(state_of(model, opt))
    del model, opt

    xm.set_rng_state(999)
    if other_mesh:
        model, opt = build(5, xs.Mesh(np.arange(8), (4, 2), ("a", "b")), (("b", None), (None, "a")))
    else:
        model, opt = build(5, mesh_1d())
    state = {**state_of(model, opt), "rng": 0}
    xc.load(state, tmp_path / "ckpt")
    opt.load_state_dict(state["optim"])
    xm.set_rng_state(state["rng"])
    assert_close(cpu_copy(state_of(model, opt)), saved, tol="exact")  # restored bit for bit
    resumed = first + train(model, opt, 2, seed=3)
    if other_mesh:  # another partitioning sums in another order: float32 rounding only
        assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), tol="resharded")
    else:  # exactly: dropout's device RNG and Adam's step count resumed too
        assert resumed == uninterrupted


def test_a_jax_user_restores_the_arrays_with_orbax_alone(saved):
    path, reference, _ = saved
    restored = ocp.PyTreeCheckpointer().restore(str(path / "state"))
    np.testing.assert_array_equal(
        restored["model"]["fc1.weight"], reference["model"]["fc1.weight"].numpy()
    )
    np.testing.assert_array_equal(
        restored["optim"]["state"]["0"]["exp_avg"],
        reference["optim"]["state"][0]["exp_avg"].numpy(),
    )
    np.testing.assert_array_equal(restored["cpu"], reference["cpu"].numpy())


def test_each_shard_is_written_once_and_replicas_not_again(tmp_path, spmd_mode):
    mesh = xs.Mesh(np.arange(8), (4, 2), ("a", "b"))
    sharded = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256).to(DEV)
    xs.mark_sharding(sharded, mesh, ("a", None))  # 4 shards, each held by 2 devices
    replicated = torch.ones(64, 256, device=DEV)
    xs.mark_sharding(replicated, mesh, (None, None))  # 1 shard, held by all 8
    xc.save({"sharded": sharded, "replicated": replicated}, tmp_path / "ckpt")
    data = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, files in os.walk(tmp_path / "ckpt" / "state")
        for name in files
        if os.path.basename(root) == "d"
    )
    logical = 2 * 64 * 256 * 4
    assert logical <= data < 1.1 * logical  # not 2x (sharded) or 8x (replicated)


# ---- bad input: a clear error naming the key or path, and the target untouched ----


def snapshot_and_target(seed: int = 1):
    model, opt = build(seed, mesh_1d())
    train(model, opt, 1, seed=70)
    state = state_of(model, opt)
    return model, opt, state, cpu_copy(state)


def refused(state, path, error, match: str) -> None:
    with pytest.raises(error, match=match):
        xc.load(state, path)


def test_missing_key_is_named_and_nothing_is_restored(saved):
    path, _, _ = saved
    _, _, state, before = snapshot_and_target()
    state["model"]["extra.weight"] = torch.zeros(3, device=DEV)
    before["model"]["extra.weight"] = torch.zeros(3)
    refused(state, path, xc.Mismatch, r"'model\.extra\.weight': missing from the checkpoint")
    assert_same(state, before)


def test_unexpected_key_is_named_and_nothing_is_restored(saved):
    path, _, _ = saved
    _, _, state, before = snapshot_and_target()
    del state["model"]["fc2.bias"]
    del before["model"]["fc2.bias"]
    refused(state, path, xc.Mismatch, r"'model\.fc2\.bias': in the checkpoint, not in the state")
    assert_same(state, before)


def test_top_level_items_left_out_are_not_restored(saved):
    path, reference, _ = saved
    model, _ = build(1, mesh_1d())
    state = {"model": model.state_dict()}
    xc.load(state, path)
    assert_same(model.state_dict(), reference["model"])


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda s: s["model"].__setitem__("fc1.bias", torch.zeros(25, device=DEV)),
            r"'model\.fc1\.bias': shape \(25,\) float32 here, \(24,\) float32 in the checkpoint",
        ),
        (
            lambda s: s["model"].__setitem__("fc1.bias", torch.zeros(24, device=DEV).half()),
            r"'model\.fc1\.bias': shape \(24,\) float16 here, \(24,\) float32",
        ),
        (
            lambda s: s["optim"].__setitem__("param_groups", {}),
            r"'optim\.param_groups': a dict here, a list in the checkpoint",
        ),
    ],
    ids=["shape", "dtype", "structure"],
)
def test_mismatch_is_named_and_nothing_is_restored(saved, change, match):
    path, _, _ = saved
    _, _, state, _ = snapshot_and_target()
    change(state)
    before = cpu_copy(state)
    refused(state, path, xc.Mismatch, match)
    assert_same(state, before)


def test_nonexistent_path_is_named(tmp_path, spmd_mode):
    _, _, state, before = snapshot_and_target()
    refused(state, tmp_path / "nope", FileNotFoundError, "no checkpoint at .*nope")
    assert_same(state, before)


def damage_array_data(path) -> None:
    """Truncate every data file of the arrays' OCDBT store to half its length."""
    for root, _, files in os.walk(path / "state"):
        for name in files:
            if "ocdbt" in root and name.startswith("d"):
                continue
            full = os.path.join(root, name)
            if os.path.basename(root) == "d":
                size = os.path.getsize(full)
                with open(full, "r+b") as f:
                    f.truncate(size // 2)


def test_truncated_array_data_is_refused_and_nothing_is_restored(saved):
    path, _, _ = saved
    damage_array_data(path)
    _, _, state, before = snapshot_and_target()
    refused(state, path, xc.CheckpointReadError, "cannot read the tensors of the checkpoint at")
    assert_same(state, before)


def test_corrupted_skeleton_is_refused_and_nothing_is_restored(saved):
    path, _, _ = saved
    (path / "meta" / "metadata").write_text('{"format": 1, "skel')
    _, _, state, before = snapshot_and_target()
    refused(state, path, xc.CheckpointReadError, "its 'meta' item is missing or damaged")
    assert_same(state, before)


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path, spmd_mode):
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "metadata").write_text(json.dumps({"hello": 1}))
    _, _, state, before = snapshot_and_target()
    refused(state, tmp_path, xc.CheckpointReadError, "not a spmd_torch checkpoint")
    assert_same(state, before)


def test_save_refuses_an_existing_path_and_an_unwritable_one(tmp_path, spmd_mode):
    model, opt = build(0, mesh_1d())
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="taken exists"):
        xc.save(state_of(model, opt), tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("a file, not a directory")
    with pytest.raises(OSError, match=r"cannot write the checkpoint .*file/ckpt"):
        xc.save(state_of(model, opt), tmp_path / "file" / "ckpt")
    assert (tmp_path / "file").read_text() == "a file, not a directory"


def test_values_a_checkpoint_cannot_hold_are_named(tmp_path, spmd_mode):
    with pytest.raises(TypeError, match=r"cannot save the set at 'model\.groups'"):
        xc.save({"model": {"groups": {1, 2}}}, tmp_path / "a")
    with pytest.raises(ValueError, match=r"keys that are equal as strings"):
        xc.save({"m": {1: 0, "1": 0}}, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
