"""launch/spawn: one replica per device, ordinals, host-level rendezvous, master-only effects,
and faults that end in a clear error (never a hang) after which the process launches again."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.xla_multiprocessing as xmp
import spmd_torch.runtime as xr
from spmd_torch._lazy.replicas import CollectiveMismatchError, RendezvousError
from tests.helpers import assert_close

WORLD = 8


def _ordinals(index):
    return (
        index,
        xr.world_size(),
        xr.global_ordinal(),
        xr.local_ordinal(),
        xm.xrt_world_size(),
        xm.get_ordinal(),
        xm.get_local_ordinal(),
        xm.is_master_ordinal(),
        xm.is_master_ordinal(local=False),
        xr.process_index(),
        xr.process_count(),
        str(xm.xla_device()),
    )


def test_each_replica_knows_its_ordinal_and_sees_xla0():
    results = spmd_torch.launch(_ordinals)
    assert sorted(results) == list(range(WORLD))
    for k, got in results.items():
        master = k == 0
        assert got == (k, WORLD, k, k, WORLD, k, k, master, master, k, WORLD, "xla:0")
    # outside a launch: one process, as before
    assert (xr.world_size(), xr.global_ordinal(), xm.get_ordinal(), xr.process_count()) == (
        1,
        0,
        0,
        1,
    )


def _draws_after_a_long_draw(index):
    torch.randn(2_000_000)  # replica 0 draws while the later replicas' threads start
    return torch.randn(3)


def test_every_replica_starts_from_the_launchers_cpu_rng_state():
    """As every process of PyTorch/XLA's launch starts from one seed: a replica's stream starts
    from the state the launcher had, not from wherever replica 0's draws had taken it when the
    replica's thread came up (PyTorch/XLA's eager multi-process example then trained 8 models
    with different initial weights)."""
    torch.manual_seed(5)
    drawn = xmp.spawn(_draws_after_a_long_draw)
    torch.manual_seed(5)
    torch.randn(2_000_000)
    want = torch.randn(3)
    assert all(torch.equal(d, want) for d in drawn.values()), drawn


def test_spawn_nprocs_any_count_and_one_returns_the_result():
    assert xmp.spawn(_ordinals, nprocs=1) == _ordinals_single()
    results = xmp.spawn(_ordinals, nprocs=3)
    assert [got[:2] for got in results.values()] == [(0, 3), (1, 3), (2, 3)]


def _put_and_grow(index, channel, local_queue, state):
    channel.put(index)
    local_queue.put(index)
    state["seen"].append(index)  # each replica's own copy, as a spawned process's would be
    return state["seen"]


def test_spawn_args_copied_as_processes_receive_them_and_queues_shared():
    channel = torch.multiprocessing.get_context("spawn").Manager().Queue(4)  # a proxy: no deep copy
    local_queue = torch.multiprocessing.Queue(4)  # neither pickle nor deep copy: threads share it
    state = {"seen": []}
    results = xmp.spawn(_put_and_grow, args=(channel, local_queue, state), nprocs=4)
    assert results == {k: [k] for k in range(4)} and state == {"seen": []}
    assert sorted(channel.get(block=False) for _ in range(4)) == [0, 1, 2, 3]
    assert sorted(local_queue.get(timeout=5) for _ in range(4)) == [0, 1, 2, 3]


def _ordinals_single():
    return (0, 1, 0, 0, 1, 0, 0, True, True, 0, 1, "xla:0")


@pytest.mark.parametrize("nprocs", [0, 9, -1, 2.0, "8"])
def test_bad_nprocs_is_refused(nprocs):
    with pytest.raises(ValueError, match="Unsupported nprocs"):
        xmp.spawn(_ordinals, nprocs=nprocs)


def test_launch_in_spmd_mode_is_refused():
    xr.use_spmd()
    try:
        with pytest.raises(RuntimeError, match="Runtime is already initialized"):
            spmd_torch.launch(_ordinals)
    finally:
        xr.reset()


def _ordinal_sum(index):
    device = xm.xla_device()
    total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([index], device=device))
    return total.item()


def test_ordinal_tensor_all_reduced_is_the_triangle_number():
    assert spmd_torch.launch(_ordinal_sum) == {k: WORLD * (WORLD - 1) // 2 for k in range(WORLD)}


def _step_program(index):
    device = xm.xla_device()
    w = torch.ones(4, device=device)
    for _ in range(3):
        grad = torch.ones(4, device=device) * float(index)  # a float is lifted: one program
        xm.all_reduce(xm.REDUCE_SUM, [grad], scale=1.0 / xr.world_size())
        w = w - 0.1 * grad
        xm.mark_step()
    return w.cpu()


def test_identical_replica_steps_compile_once_for_all_replicas():
    spmd_torch.launch(_step_program)  # warm: the first step's program differs (no history)
    before = met.counter_value("UncachedCompile") or 0
    results = spmd_torch.launch(_step_program)
    assert (met.counter_value("UncachedCompile") or 0) == before
    mean = sum(range(WORLD)) / WORLD
    for w in results.values():
        assert_close(w, torch.full((4,), 1 - 3 * 0.1 * mean))


def _rendezvous(index):
    everyone = xm.rendezvous("hello", payload=f"from {index}".encode())
    pair = xm.rendezvous(
        "pairs", payload=bytes([index]), replicas=[index - index % 2, index - index % 2 + 1]
    )
    try:
        xm.rendezvous("text", payload="from")
    except TypeError as error:  # payloads are bytes, as in PyTorch/XLA
        assert "rendezvous 'text': payload must be bytes, not str" in str(error)
    else:
        raise AssertionError("a str payload was taken")
    mean = xm.mesh_reduce("mean", torch.tensor([float(index)]), lambda xs: torch.cat(xs).mean())
    device_mean = xm.mesh_reduce(
        "device", torch.tensor([index * 2.0], device=xm.xla_device()), lambda xs: sum(xs)
    )
    return everyone, pair, float(mean), float(device_mean)


def test_rendezvous_and_mesh_reduce_exchange_host_values():
    results = spmd_torch.launch(_rendezvous)
    for k, (everyone, pair, mean, device_sum) in results.items():
        assert everyone == [f"from {j}".encode() for j in range(WORLD)]
        assert pair == [bytes([k - k % 2]), bytes([k - k % 2 + 1])]
        # sums of small integers and their mean: exact in float32 (the kit compares floats exactly)
        assert_close((mean, device_sum), (sum(range(WORLD)) / WORLD, 2.0 * sum(range(WORLD))))


def _master_effects(index, path):
    xm.master_print(f"master says {index}")
    print(f"replica {index} says hi")
    device = xm.xla_device()
    state = {"w": torch.arange(6.0, device=device).reshape(2, 3) * (index + 1), "step": index}
    xm.save(state, path)


def test_master_only_side_effects_run_once(tmp_path, capsys, monkeypatch):
    saved = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: saved.append(f) or real_save(obj, f))
    path = tmp_path / "model.pt"
    spmd_torch.launch(_master_effects, args=(str(path),))
    out = capsys.readouterr().out
    assert out.count("master says") == 1 and "master says 0" in out
    for k in range(WORLD):
        assert out.count(f"replica {k} says hi") == 1
    assert saved == [str(path)]
    loaded = torch.load(path)  # plain PyTorch: CPU tensors, the master's values
    assert loaded["step"] == 0 and loaded["w"].device.type == "cpu"
    assert_close(loaded["w"], torch.arange(6.0).reshape(2, 3), tol="exact")


# --- faults: a clear error within seconds, and the process launches again --------------------


def _fails_at_step_3(index):
    device = xm.xla_device()
    x = torch.ones(2, device=device)
    for step in range(10):
        if step == 3 and index == 5:
            raise ValueError(f"replica {index} gives up at step {step}")
        x = xm.all_reduce(xm.REDUCE_SUM, x, scale=1.0 / xr.world_size())
        xm.mark_step()
    return x.cpu()


def _assert_launches_again():
    assert spmd_torch.launch(_ordinal_sum)[3] == WORLD * (WORLD - 1) // 2


def test_a_replica_raising_stops_all_and_names_itself():
    start = time.monotonic()
    with pytest.raises(ValueError, match="replica 5 gives up at step 3") as info:
        spmd_torch.launch(_fails_at_step_3)
    assert time.monotonic() - start < 30
    assert "(raised by replica 5 of 8 in launch/spawn)" in getattr(info.value, "__notes__", [])
    assert any(frame.name == "_fails_at_step_3" for frame in info.traceback)
    _assert_launches_again()


def _skips_a_collective(index):
    device = xm.xla_device()
    x = torch.ones(2, device=device)
    if index != 3:
        x = xm.all_reduce(xm.REDUCE_SUM, x)
    x = x * 2
    xm.mark_step()


def test_a_replica_skipping_a_collective_is_named():
    with pytest.raises(CollectiveMismatchError, match=r"replicas \[3\] run \[no collective\]"):
        spmd_torch.launch(_skips_a_collective)
    _assert_launches_again()


def _skips_and_returns(index):
    if index != 3:
        xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=xm.xla_device())).cpu()


def test_a_replica_returning_early_while_others_reduce_is_named():
    with pytest.raises(CollectiveMismatchError, match=r"replicas \[3\] returned"):
        spmd_torch.launch(_skips_and_returns)
    _assert_launches_again()


def _wrong_tag(index):
    xm.rendezvous("epoch_end" if index != 6 else "epoch_start")


def test_a_replica_at_another_rendezvous_is_named():
    with pytest.raises(RendezvousError, match=r"replicas \[6\] at rendezvous 'epoch_start'"):
        spmd_torch.launch(_wrong_tag)
    _assert_launches_again()


def _bad_gather(index):
    xm.all_gather(torch.ones(2, 3, device=xm.xla_device()), dim=2)


def _bad_groups(index):
    xm.all_gather(torch.ones(2, device=xm.xla_device()), groups=[[0, 1, 2], [3, 4, 5, 6, 7]])


def test_bad_collective_arguments_name_the_problem():
    with pytest.raises(IndexError, match="all_gather: dim 2 is out of range .* shape \\(2, 3\\)"):
        spmd_torch.launch(_bad_gather)
    with pytest.raises(ValueError, match=r"different sizes \[3, 5\]"):
        spmd_torch.launch(_bad_groups)
    _assert_launches_again()


def _sharding_inside(index):
    xr.use_spmd()


def test_spmd_inside_a_replica_is_refused():
    with pytest.raises(RuntimeError, match="inside replica 0 of launch/spawn"):
        spmd_torch.launch(_sharding_inside)


def _constant_differs(index):
    x = F.pad(torch.ones(2, device=xm.xla_device()), (0, 1), value=float(index))  # kept number
    xm.all_reduce(xm.REDUCE_SUM, [x])
    xm.mark_step()


def test_a_graph_that_differs_by_ordinal_names_the_first_difference():
    """Led by where the programs part; the replicas grouped, none accused of skipping one."""
    with pytest.raises(CollectiveMismatchError) as raised:
        spmd_torch.launch(_constant_differs)
    message = str(raised.value)
    assert re.search(
        r"^.*: replica 0's and replica 1's programs part at .*aten.constant_pad_nd.default.*0\.0"
        r".*-> .*1\.0",
        message,
    ), message
    assert "every replica runs [all_reduce]" in message and "depends on the ordinal" in message


def _scaled_by_ordinal(index):
    x = torch.ones(2, device=xm.xla_device()) * xm.get_ordinal()  # an int: program data
    return xm.all_reduce(xm.REDUCE_SUM, x).cpu()


def _filled_by_ordinal(index):
    x = torch.full((2,), float(xm.get_ordinal()), device=xm.xla_device())  # a lifted fill
    return xm.all_reduce(xm.REDUCE_SUM, x).cpu()


@pytest.mark.parametrize("replica_step", [_scaled_by_ordinal, _filled_by_ordinal])
def test_an_ordinal_scaled_tensor_before_a_collective_runs_as_one_program(replica_step):
    before = met.counter_value("UncachedCompile") or 0
    results = spmd_torch.launch(replica_step)
    assert all(torch.equal(r, torch.full((2,), 28.0)) for r in results.values())
    assert (met.counter_value("UncachedCompile") or 0) - before == 1
