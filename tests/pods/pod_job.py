"""The script every host of the pod tests runs, under ``spmd_torch.distributed.run`` (or alone,
as one host with every device). Each scenario prints ``RESULT <json>`` lines the tests read.

    python pod_job.py train | mp | save DIR | restore DIR | save-killed DIR | preempt DIR
    python pod_job.py fault kill|stop|exit
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.distributed.spmd as xs
import spmd_torch.experimental.distributed_checkpoint as xc
import spmd_torch.runtime as xr

GLOBAL_BATCH, FEATURES, CLASSES, STEPS = 16, 12, 5, 4


def report(**values) -> None:
    """One result line; ``host`` is the process (inside launch, xr.process_index() is the
    replica's ordinal, as in PyTorch/XLA)."""
    host = int(os.environ.get("SPMD_TORCH_PROCESS_ID", "0"))
    print("RESULT " + json.dumps({"host": host, **values}), flush=True)


def dataset(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, features, labels): sample i is the same on every host and in every layout."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(count, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    return torch.arange(count), features, labels


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def train() -> None:
    """FSDP-style SPMD training over the job's global mesh; each host loads only its part of
    every global batch (minibatch input sharding)."""
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    net = model().to(xm.xla_device())
    for p in net.parameters():
        xs.mark_sharding(p, mesh, ("fsdp",) + (None,) * (p.dim() - 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
    ids, features, labels = dataset(GLOBAL_BATCH * STEPS)
    hosts, host = xr.process_count(), xr.process_index()
    part = GLOBAL_BATCH // hosts  # each global batch: host 0's rows, then host 1's...
    mine = torch.cat(
        [torch.arange(s, s + part) + host * part for s in range(0, len(ids), GLOBAL_BATCH)]
    )
    batches = [
        (ids[mine[k : k + part]], features[mine[k : k + part]], labels[mine[k : k + part]])
        for k in range(0, len(mine), part)
    ]
    spec = xs.ShardingSpec(mesh, ("fsdp",), minibatch=True)
    specs = {0: spec, 1: xs.ShardingSpec(mesh, ("fsdp", None), minibatch=True), 2: spec}
    loader = pl.MpDeviceLoader(
        [dict(enumerate(b)) for b in batches], xm.xla_device(), input_sharding=specs
    )
    met.clear_all()
    losses, seen = [], []
    for batch in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(net(batch[1]), batch[2])
        loss.backward()
        optimizer.step()
        xm.mark_step()
        losses.append(loss.item())
        seen.append(batch[0].cpu().tolist())  # the global batch, gathered from every host
    weight = net[0].weight
    hybrid = xs.HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(2, 1)).get_logical_mesh()
    payloads = xm.rendezvous("hosts", str(xr.process_index()).encode())  # one per process
    report(
        rendezvous=[p.decode() for p in payloads],
        mesh_reduce=xm.mesh_reduce("host_sum", xr.process_index(), sum),
        hybrid=hybrid.tolist(),
        hybrid_hosts=[[jax.devices()[k].process_index for k in row] for row in hybrid.tolist()],
        losses=losses,
        seen=seen,
        weight_sum=(weight * weight).sum().item(),
        compiles=met.counter_value("UncachedCompile"),
        process_count=xr.process_count(),
        global_devices=xr.global_runtime_device_count(),
        local_devices=xr.addressable_runtime_device_count(),
        ordinal=xr.global_ordinal(),
        local_ordinal=xr.local_ordinal(),
        master=xm.is_master_ordinal(local=False),
        local_shards=[s.shard_device for s in xs.wrap_as_sharded_tensor(weight).local_shards],
    )


def mp() -> None:
    """The per-device script: replicas numbered across hosts, each its own slice of the data."""
    ids, features, labels = dataset(GLOBAL_BATCH * STEPS)

    def replica(index: int) -> None:
        device = xm.xla_device()
        net = model().to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        world, rank = xr.world_size(), xr.global_ordinal()
        per = GLOBAL_BATCH // world
        losses = []
        for step in range(STEPS):
            rows = slice(step * GLOBAL_BATCH + rank * per, step * GLOBAL_BATCH + (rank + 1) * per)
            optimizer.zero_grad()
            loss = F.cross_entropy(net(features[rows].to(device)), labels[rows].to(device))
            loss.backward()
            xm.optimizer_step(optimizer)
            xm.mark_step()
            losses.append(xm.mesh_reduce("loss", loss.item(), np.mean))
        total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([float(index)], device=device)).item()
        payloads = xm.rendezvous("ordinals", str(index).encode())
        xm.save({"w": net[0].weight}, os.environ["POD_SAVE"], global_master=True)
        if index == xr.global_ordinal() and xr.local_ordinal() == 0:
            report(
                ordinal=index,
                world=world,
                losses=losses,
                total=total,
                payloads=[p.decode() for p in payloads],
            )

    spmd_torch.launch(replica)


def _state(shape=(64, 16)) -> dict:
    """A state sharded over the job's mesh: values known to every host, to check bit for bit."""
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    w = torch.arange(float(np.prod(shape))).reshape(shape).to(xm.xla_device())
    b = torch.arange(float(shape[1])).to(xm.xla_device()) * 0.5
    xs.mark_sharding(w, mesh, ("fsdp", None))
    return {"model": {"w": w, "b": b}, "step": 3}


def save(directory: str) -> None:
    manager = xc.CheckpointManager(directory, save_interval=1)
    state = _state()
    manager.save(3, state)
    manager.save_async(4, state)
    manager.join()
    report(steps=manager.all_steps())


def restore(directory: str, rows: str = "64", cols: str = "16") -> None:
    """Restore the latest checkpoint onto a (2, devices / 2) mesh, whatever layout saved it."""
    xr.use_spmd()
    n, shape = xr.global_runtime_device_count(), (int(rows), int(cols))
    mesh = xs.Mesh(np.arange(n), (2, n // 2), ("data", "model"))
    w = torch.zeros(shape).to(xm.xla_device())
    b = torch.zeros(shape[1]).to(xm.xla_device())
    xs.mark_sharding(w, mesh, ("model", "data"))
    target = {"model": {"w": w, "b": b}, "step": 0}
    manager = xc.CheckpointManager(directory, save_interval=1)
    manager.restore(manager.all_steps()[-1], target)
    expected = _state(shape)["model"]
    report(
        steps=manager.all_steps(),
        w_equal=bool(torch.equal(w.cpu(), expected["w"].cpu())),
        b_equal=bool(torch.equal(b.cpu(), expected["b"].cpu())),
        spec=xs.get_xla_sharding_spec(w),
    )


def save_killed(directory: str) -> None:
    """Async saves of a large state; host 1 is killed while step 2's write is in flight."""
    manager = xc.CheckpointManager(directory, save_interval=1)
    state = _state(shape=(4096, 1024))  # 16 MB: a write long enough to be killed in
    for step in range(3):
        manager.save_async(step, state)
        report(saving=step)
        if step == 2 and xr.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        manager.join()


def preempt(directory: str) -> None:
    """Steps with a checkpoint due only on preemption; the test sends SIGTERM to one host."""
    manager = xc.CheckpointManager(directory, save_interval=1000)
    state = _state()
    for step in range(1, 10_000):
        state["model"]["w"].add_(1.0)
        xm.mark_step()
        report(step=step)
        manager.save_async(
            step, state
        )  # exits (status 0) once the preemption checkpoint is written
        time.sleep(0.2)


def fault(mode: str) -> None:
    """Steps of a program spanning every host; host 1 dies, stops or returns at step 3."""
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    x = torch.ones(8 * n, 4).to(xm.xla_device())
    xs.mark_sharding(x, mesh, ("data", None))
    for step in range(10_000):
        x = x * 1.0
        total = x.sum().item()
        report(step=step, total=total)
        if step == 3 and xr.process_index() == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "exit":
                return
        time.sleep(0.05)


def hello() -> None:
    report(processes=xr.process_count())


def one_spec_for_two_inputs() -> None:
    """A minibatch spec for 2-d features given (features, labels) batches: the 1-d labels
    cannot take it, and each host's labels are only its part of them."""
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    spec = xs.ShardingSpec(xs.Mesh(np.arange(n), (n,), ("data",)), ("data", None), minibatch=True)
    _, features, labels = dataset(8)
    loader = pl.MpDeviceLoader([(features, labels)], xm.xla_device(), input_sharding=spec)
    try:
        next(iter(loader))
    except ValueError as error:
        report(error=str(error))


if __name__ == "__main__":
    scenario, *rest = sys.argv[1:]
    {
        "train": train,
        "mp": mp,
        "save": save,
        "restore": restore,
        "save-killed": save_killed,
        "preempt": preempt,
        "fault": fault,
        "hello": hello,
        "one-spec-for-two-inputs": one_spec_for_two_inputs,
    }[scenario](*rest)
