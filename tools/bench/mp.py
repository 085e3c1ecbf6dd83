"""W2mp: W2's MLP data parallel, two ways, on the same data from one init.

``mp`` is a per-device multiprocessing script (``spmd_torch.launch``, one replica per device,
``xm.optimizer_step`` all-reducing the gradients); ``spmd_torch`` is one SPMD program, the batch
sharded over a 1-D mesh. The mean of the replicas' losses is the SPMD loss. Steps/s is the median
of timed windows of pipelined steps; one more window of blocked steps splits the host time per
step (harness.host_breakdown).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from . import harness
from .models import mlp_data, mlp_loss, new_mlp, new_sgd
from .training import spmd_trainer

W2MP_BATCH = 32  # rows per replica (per device in the SPMD program)
W2MP_WINDOWS = 5  # timed windows; --steps is split between them
W2MP_AXIS = "data"


def _devices() -> int:
    """Replicas (mp) and mesh size (SPMD): every local device, as ``launch`` uses."""
    import jax

    return jax.local_device_count()


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A global batch of W2MP_BATCH rows per device; for 8 devices, W2's batch of 256 itself."""
    return mlp_data(W2MP_BATCH * n)


def _windows(steps: int) -> tuple[int, int]:
    """(windows, steps per window) for `steps` timed steps."""
    windows = min(W2MP_WINDOWS, max(steps, 1))
    return windows, max(steps // windows, 1)


def _replica(
    index: int,
    data: tuple[np.ndarray, np.ndarray],
    warmup: int,
    steps: int,
    check: bool,
) -> dict[str, Any]:
    """One replica of the mp script, as a PyTorch/XLA user writes it: the same init everywhere,
    its own rows of the batch (uploaded once, before the loop, as W2 does: no loader), gradients
    all-reduced by xm.optimizer_step, one barrier per step. Each step's tracing time (until its
    barrier) is kept: replicas take turns at Python, so the world's is the replicas' sum."""
    import spmd_torch.core.xla_model as xm

    dev = xm.xla_device()
    model = new_mlp().to(dev)
    opt = new_sgd(model)
    rows = slice(index * W2MP_BATCH, (index + 1) * W2MP_BATCH)
    x, y = (torch.from_numpy(a[rows]).to(dev) for a in data)
    xm.mark_step()
    xm.wait_device_ops()
    trace_ns: list[int] = []

    def step() -> torch.Tensor:
        start = time.perf_counter_ns()
        loss = mlp_loss(model, x, y)
        loss.backward()
        xm.optimizer_step(opt)
        opt.zero_grad()
        loss = loss.detach()
        trace_ns.append(time.perf_counter_ns() - start)
        xm.mark_step()
        return loss

    if check:
        losses = [step() for _ in range(steps)]
        return {"losses": [loss.item() for loss in losses]}
    windows, window = _windows(steps)
    result = harness.run_windows(step, xm.wait_device_ops, warmup, windows, window, index == 0)
    return {**result, "trace_ns": trace_ns}


def _summary(r: dict[str, Any], host_ms: dict[str, Any], n: int, compiles: int) -> dict[str, Any]:
    """The result fields both ways report (the probe's raw readings and every step's loss left
    out)."""
    return {
        **{k: v for k, v in r.items() if k not in ("probe", "probe_steps", "trace_ns", "losses")},
        "compiles_total": compiles,
        "host_ms": host_ms,
        "mesh_devices": n,
    }


def w2mp_mp(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import spmd_torch

    n = _devices()
    before = harness.spmd_uncached()
    results = spmd_torch.launch(_replica, args=(_data(n), warmup, steps, check))
    replicas = [results[k] for k in range(n)]
    if check:  # the global batch's loss: the mean of the replicas' equal-sized batches' losses
        return {"losses": [float(np.mean(ls)) for ls in zip(*(r["losses"] for r in replicas))]}
    r0 = replicas[0]
    lo, hi = r0["probe_steps"]
    trace_s = sum(sum(r["trace_ns"][lo:hi]) for r in replicas) / 1e9
    host_ms = harness.host_breakdown(r0["probe"], trace_s)
    host_ms["trace_per_replica"] = host_ms["trace"] / n
    return {
        **_summary(r0, host_ms, n, harness.spmd_uncached() - before),
        "loss_first": float(np.mean([r["loss_first"] for r in replicas])),
        "loss_last": float(np.mean([r["loss_last"] for r in replicas])),
        "device": f"{n} replicas",
        "warmup": warmup,
        "steps": steps,
    }


def _dp_shard(n: int) -> Callable[[nn.Module, list[torch.Tensor]], None]:
    """W2mp's SPMD marks: the batch split on dim 0 over an n-device 1-D mesh; the parameters
    left unmarked, so replicated (data parallel)."""
    import spmd_torch.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(n), (n,), (W2MP_AXIS,))

    def shard(model: nn.Module, batch: list[torch.Tensor]) -> None:
        for t in batch:
            xs.mark_sharding(t, mesh, (W2MP_AXIS,) + (None,) * (t.dim() - 1))

    return shard


def w2mp_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import spmd_torch  # noqa: F401  (before the model is made, as every spmd_torch run does)

    n = _devices()
    before = harness.spmd_uncached()
    tr = spmd_trainer(new_mlp(), new_sgd, mlp_loss, _data(n), shard=_dp_shard(n))
    if check:
        return harness.run_trainer(tr, warmup, steps, check)
    windows, window = _windows(steps)
    r = harness.run_windows(tr.step, tr.wait, warmup, windows, window, probe=True)
    lo, hi = r["probe_steps"]
    trace_s = sum(r["probe"]["host_s"]) - sum(tr.barrier_times[lo:hi])
    host_ms = harness.host_breakdown(r["probe"], trace_s)
    return {
        **_summary(r, host_ms, n, harness.spmd_uncached() - before),
        "device": f"{n}-device mesh",
        "warmup": warmup,
        "steps": steps,
    }
