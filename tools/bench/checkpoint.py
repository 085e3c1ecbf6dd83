"""W5, checkpoints: W4's model and AdamW state, spmd_torch's checkpoints against orbax's own.

After 2 steps of W4's training on the 8-device 'fsdp' mesh, spmd_torch.experimental.
distributed_checkpoint saves and restores the state, and orbax (PyTreeCheckpointHandler,
compression off) does the same with the very same jax arrays, alternated rep by rep in one
process: save, save_async (the time it blocks the loop, and until written), restore onto the same
layout and onto a (4,2) mesh; seconds, bytes on disk, and the peak growth of the process's RSS.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from . import harness
from .models import FSDP, GPT_W4_CFG, gpt_data, gpt_loss, new_adamw, new_gpt
from .training import fsdp_mesh_size


def _disk_bytes(path: str) -> int:
    """Bytes of every file under `path`: a checkpoint's size on disk."""
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, files in os.walk(path)
        for name in files
    )


def _trained(n: int, mesh_shape: tuple, names: tuple, spec: tuple) -> tuple[nn.Module, Any]:
    """W4's GPT on the device with its 2-D params marked `spec` over a mesh of `n` devices, and
    its AdamW (made after the marks, so its state follows them)."""
    import spmd_torch
    import spmd_torch.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(n), mesh_shape, names)
    model = new_gpt().to(spmd_torch.device())
    for p in model.parameters():
        if p.dim() == 2:
            xs.mark_sharding(p, mesh, spec)
    return model, new_adamw(model)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """A few W4 steps, so the checkpoint holds trained weights and filled AdamW moments."""
    import spmd_torch

    batch = [torch.from_numpy(a).to(spmd_torch.device()) for a in gpt_data(GPT_W4_CFG)]
    for _ in range(steps):
        gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()
        spmd_torch.sync()


def _ready(model: nn.Module) -> None:
    """Waits until the restored parameters are on their devices (an engine read: the device
    arrays behind the tensors), so a restore's time includes its transfers."""
    import jax

    from spmd_torch._lazy.execute import global_array

    jax.block_until_ready([global_array(t) for t in model.parameters()])


def _orbax_restore(handler: Any, path: str, like: dict) -> Any:
    """Orbax's own restore onto the layouts of `like` (jax arrays), as a JAX user would call it."""
    import jax
    import orbax.checkpoint as ocp

    args = jax.tree.map(
        lambda a: (
            ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype)
            if isinstance(a, jax.Array)
            else ocp.RestoreArgs(restore_type=np.ndarray)
        ),
        like,
    )
    restored = ocp.Checkpointer(handler).restore(
        path, args=ocp.args.PyTreeRestore(item=like, restore_args=args, partial_restore=True)
    )
    return jax.block_until_ready(restored)


class _Timings:
    """Seconds and peak RSS growth of each named operation, one entry per rep."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.growth: dict[str, list[int]] = {}

    def timed(self, name: str, fn: Callable[[], Any]) -> None:
        with harness.RssPeak() as rss:
            t0 = harness.now()
            fn()
            elapsed = harness.now() - t0
        self.times.setdefault(name, []).append(elapsed)
        self.growth.setdefault(name, []).append(rss.growth)

    def medians(self, warmup: int) -> dict[str, float]:
        """Median seconds after the warm-up reps; save_async_total counts from the call."""
        median = {k: statistics.median(v[warmup:]) for k, v in self.times.items()}
        median["save_async_total"] += median["save_async_blocking"]
        return median


def w5_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import shutil
    import tempfile

    import jax
    import orbax.checkpoint as ocp

    import spmd_torch.experimental.distributed_checkpoint as xc
    from spmd_torch.experimental.distributed_checkpoint import _tree

    n = fsdp_mesh_size()
    model, opt = _trained(n, (n,), (FSDP.axis,), (FSDP.axis, None))
    _train(model, opt, 2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    # Orbax's side: the very same device arrays, as a JAX user would hold them.
    split = _tree.split(state)
    direct, state_bytes = split.arrays, split.nbytes
    jax.block_until_ready(direct)
    other, other_opt = _trained(n, (n // 2, 2), ("a", "b"), ("a", "b"))
    other_state = {"model": other.state_dict(), "optim": other_opt.state_dict()}  # state: made
    # by the first restore, filled in place by the later ones
    handler = ocp.PyTreeCheckpointHandler(use_compression=False)
    orbax_writer = ocp.Checkpointer(handler)
    root = tempfile.mkdtemp(prefix="w5-")
    t = _Timings()
    manager = xc.CheckpointManager(os.path.join(root, "managed"), 1, chkpt_on_preemption=False)
    try:
        for rep in range(warmup + steps):
            ours, theirs = os.path.join(root, f"ours{rep}"), os.path.join(root, f"orbax{rep}")
            t.timed("save", lambda: xc.save(state, ours))
            t.timed(
                "orbax_save", lambda: orbax_writer.save(theirs, args=ocp.args.PyTreeSave(direct))
            )
            t.timed("restore", lambda: (xc.load(state, ours), _ready(model)))
            t.timed("orbax_restore", lambda: _orbax_restore(handler, theirs, direct))
            t.timed("restore_4x2", lambda: (xc.load(other_state, ours), _ready(other)))
            other_like = _tree.split(other_state).arrays
            t.timed("orbax_restore_4x2", lambda: _orbax_restore(handler, theirs, other_like))
            t.timed("save_async_blocking", lambda: manager.save_async(rep, state, force=True))
            t.timed("save_async_total", manager.join)
            disk = {"ours": _disk_bytes(ours), "orbax": _disk_bytes(theirs)}
            shutil.rmtree(ours)
            shutil.rmtree(theirs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "device": f"{n}-device mesh",
        "mesh_devices": n,
        "warmup": warmup,
        "steps": steps,
        "state_bytes": state_bytes,
        "disk_bytes": disk,
        "seconds": t.medians(warmup),
        "rss_growth_bytes": {k: max(v[warmup:]) for k, v in t.growth.items()},
    }
