"""CheckpointManager: the step schedule, retention, async saves that later steps cannot change, and
crash safety: processes killed (SIGKILL) in the middle of save and save_async, preempted (SIGTERM)
and running out of file space, each leaving every earlier checkpoint restorable bit-exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.experimental.distributed_checkpoint as xc
import spmd_torch.runtime as xr

from . import checkpoint_worker as worker

DEV = torch.device("xla", 0)
WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")


@pytest.fixture(autouse=True)
def spmd_mode():
    xr.use_spmd()


def mesh():
    return xs.Mesh(np.arange(8), (8,), ("d",))


def sharded(values: torch.Tensor) -> torch.Tensor:
    t = values.to(DEV)
    xs.mark_sharding(t, mesh(), ("d",) + (None,) * (values.dim() - 1))
    return t


def restored(manager, step: int, shape=(16, 4)) -> tuple[torch.Tensor, object]:
    state = {"w": sharded(torch.zeros(shape)), "step": -1}
    manager.restore(step, state)
    return state["w"].cpu(), state["step"]


def test_schedule_should_save_and_all_steps(tmp_path):
    manager = xc.CheckpointManager(tmp_path, save_interval=3)
    w = sharded(torch.zeros(16, 4))
    taken = []
    for step in range(8):
        w.add_(1.0)
        taken.append(manager.save(step, {"w": w, "step": step}))
    assert taken == [step % 3 == 0 for step in range(8)]
    assert [manager.should_save(s) for s in (5, 6)] == [False, True]
    assert manager.save(7, {"w": w, "step": 7}, force=True)
    assert manager.all_steps() == [0, 3, 6, 7]
    values, step = restored(manager, 3)
    assert torch.equal(values, torch.full((16, 4), 4.0)) and step == 3
    assert xc.CheckpointManager(tmp_path, save_interval=3).all_steps() == [0, 3, 6, 7]
    assert ocp.CheckpointManager(tmp_path).all_steps() == [0, 3, 6, 7]  # plain orbax agrees


def test_max_to_keep_deletes_the_lowest_steps_and_keeps_the_newest(tmp_path):
    manager = xc.CheckpointManager(tmp_path, save_interval=1, max_to_keep=2)
    w = sharded(torch.zeros(16, 4))
    for step in range(5):
        w.add_(1.0)
        manager.save_async(step, {"w": w, "step": step})
    manager.join()
    assert manager.all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]
    values, _ = restored(manager, 4)
    assert torch.equal(values, torch.full((16, 4), 5.0))


def test_max_to_keep_deletes_the_earliest_saved_whatever_the_step(tmp_path):
    """PyTorch/XLA's retention: the oldest checkpoint goes, by when it was saved (a step saved
    again is new), and the order holds for a new manager on the directory."""
    manager = xc.CheckpointManager(tmp_path, save_interval=10, max_to_keep=2)
    kept = []
    for step, expected in ((10, [10]), (20, [10, 20]), (30, [20, 30]), (10, [10, 30])):
        assert manager.save(step, {"w": sharded(torch.full((16, 4), float(step))), "step": step})
        kept.append(manager.all_steps())
    assert kept == [[10], [10, 20], [20, 30], [10, 30]]

    manager = xc.CheckpointManager(tmp_path, save_interval=10, max_to_keep=2)
    manager.save_async(20, {"w": sharded(torch.full((16, 4), 21.0)), "step": 20})
    manager.join()
    assert manager.all_steps() == [10, 20]
    assert sorted(os.listdir(tmp_path)) == ["10", "20"]
    values, step = restored(manager, 10)
    assert torch.equal(values, torch.full((16, 4), 10.0)) and step == 10


def test_async_save_holds_the_values_of_its_step_whatever_runs_next(tmp_path):
    manager = xc.CheckpointManager(tmp_path, save_interval=1, max_pending_async=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512).to(DEV)
    xs.mark_sharding(model.weight, mesh(), ("d", None))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(32, 256).to(DEV)
    expected = {}
    for step in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()  # the previous parameters are donated to this step's program
        spmd_torch.sync()
        expected[step] = model.weight.detach().cpu().clone()
        manager.save_async(step, {"w": model.weight})
        with torch.no_grad():
            model.weight.mul_(-3.0)  # mutated right after the call
    manager.join()
    for step in range(3):
        w = sharded(torch.zeros(512, 256))
        manager.restore(step, {"w": w})
        assert torch.equal(w.cpu(), expected[step]), step


def test_async_save_finishes_its_checkpoint_on_the_background_thread(tmp_path):
    """save_async returns while ``_save`` (what finishes a checkpoint) waits on another thread;
    the step counts once it is done, as PyTorch/XLA's manager does it."""
    manager = xc.CheckpointManager(tmp_path, save_interval=10)
    release, entered = threading.Event(), threading.Event()
    finish = manager._save

    def held_save(*args, **kwargs):
        entered.set()
        release.wait(60)
        finish(*args, **kwargs)

    manager._save = held_save
    assert manager.save_async(10, {"w": sharded(torch.ones(16, 4))})
    assert entered.wait(60) and threading.current_thread() is threading.main_thread()
    assert manager.all_steps() == []  # written or not, it is not complete until _save ends
    release.set()
    manager.join()
    assert manager.all_steps() == [10]


def test_restore_names_a_missing_step_and_the_complete_ones(tmp_path):
    manager = xc.CheckpointManager(tmp_path, save_interval=1)
    manager.save(2, {"w": sharded(torch.ones(16, 4))})
    w = sharded(torch.zeros(16, 4))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 5 in .*: \[2\]"):
        manager.restore(5, {"w": w})
    assert torch.equal(w.cpu(), torch.zeros(16, 4))


def test_bad_arguments_and_an_unwritable_directory_are_named(tmp_path):
    with pytest.raises(ValueError, match="save_interval must be an integer >= 1, got 0"):
        xc.CheckpointManager(tmp_path, save_interval=0)
    with pytest.raises(ValueError, match="max_to_keep must be an integer >= 0, got -1"):
        xc.CheckpointManager(tmp_path, save_interval=1, max_to_keep=-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"cannot write checkpoints to .*file/run"):
        xc.CheckpointManager(tmp_path / "file" / "run", save_interval=1)
    manager = xc.CheckpointManager(tmp_path / "run", save_interval=1, chkpt_on_preemption=False)
    with pytest.raises(RuntimeError, match="chkpt_on_preemption=True"):
        manager.reached_preemption(0)


def test_prime_optimizer_still_works_for_old_scripts(tmp_path):
    model = torch.nn.Linear(8, 16).to(DEV)
    xs.mark_sharding(model.weight, mesh(), ("d", None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert xc.prime_optimizer(opt) is opt
    exp_avg = opt.state[model.weight]["exp_avg"]
    assert torch.equal(exp_avg.cpu(), torch.zeros(16, 8))
    assert xs.get_xla_sharding_spec(exp_avg) == xs.get_xla_sharding_spec(model.weight)


# ---- crash safety: a real process, killed ----


def spawn(directory, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WORKER, str(directory), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_line(process: subprocess.Popen, prefix: str) -> list[str]:
    lines = []
    while True:
        line = process.stdout.readline()
        assert line, f"the worker ended before printing {prefix!r}:\n" + "".join(lines)
        lines.append(line)
        if line.startswith(prefix):
            return lines


def partial_writes(directory) -> list[str]:
    return [e for e in os.listdir(directory) if "orbax-checkpoint-tmp" in e]


def expected_w(step: int) -> torch.Tensor:
    return worker.base() + step


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_in_the_middle_of_a_save_leaves_the_earlier_checkpoints(tmp_path, mode):
    process = spawn(tmp_path, mode)
    try:
        wait_for_line(process, "saved 1")
        deadline = time.monotonic() + 60
        while not partial_writes(tmp_path):  # step 2 (or later) being written
            assert time.monotonic() < deadline and process.poll() is None
        process.kill()
        process.wait()
    finally:
        process.kill()
        process.stdout.close()
    assert partial_writes(tmp_path)  # killed mid-write: the partial one is there, unfinished
    manager = xc.CheckpointManager(tmp_path, save_interval=1)
    steps = manager.all_steps()
    assert steps == list(range(len(steps))) and len(steps) >= (2 if mode == "sync" else 1)
    assert not partial_writes(tmp_path)  # cleared by the next manager
    for step in (steps[-1], steps[0]):
        values, saved_step = restored(manager, step, (worker.ROWS, worker.COLS))
        assert saved_step == step and torch.equal(values, expected_w(step))


@pytest.mark.multiprocess
def test_sigterm_saves_the_current_step_and_exits_cleanly(tmp_path):
    process = spawn(tmp_path, "preempt")
    try:
        lines = wait_for_line(process, "saving 3")
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    lines += out.splitlines(keepends=True)
    assert process.returncode == 0, "".join(lines)
    last = int([line for line in lines if line.startswith("saving")][-1].split()[1])
    manager = xc.CheckpointManager(tmp_path, save_interval=1000)
    assert last >= 3 and manager.all_steps() == [0, last]  # step 0, then the preempted step
    values, step = restored(manager, last, (worker.ROWS, worker.COLS))
    assert step == last and torch.equal(values, expected_w(last))


@pytest.mark.multiprocess
def test_running_out_of_file_space_names_the_checkpoint_and_keeps_the_others(tmp_path):
    process = spawn(tmp_path, "disk-full")
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out
    error = [line for line in out.splitlines() if line.startswith("error")]
    assert error and f"cannot write the checkpoint {tmp_path}/2" in error[0], out
    manager = xc.CheckpointManager(tmp_path, save_interval=1)
    assert manager.all_steps() == [0, 1] and not partial_writes(tmp_path)
    values, _ = restored(manager, 1, (worker.ROWS, worker.COLS))
    assert torch.equal(values, expected_w(1))
