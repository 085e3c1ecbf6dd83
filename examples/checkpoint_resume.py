"""Checkpoint, crash, resume on another mesh: the FSDP GPT of spmd_fsdp.py survives a SIGKILL.

1. A training process shards the GPT over an 8-way 'fsdp' mesh and calls
   ``CheckpointManager.save_async`` every step (a checkpoint every 3 steps); this script kills it
   with SIGKILL in the middle of the run, possibly with a write in flight.
2. A new process shards the model over a (4, 2) mesh ('data', 'fsdp'): restore fills the fresh
   model and a fresh AdamW (whose state does not exist yet) from the newest complete checkpoint,
   each device reading only its shards, and training goes on from the step after it.
3. An uninterrupted run on the 8-way mesh, alongside the other two, gives the reference losses.
   The resumed losses must equal them (to float32 rounding: the other mesh sums in another
   order); the script exits non-zero otherwise.

Run: python examples/checkpoint_resume.py   (on CPU it sets up 8 virtual devices itself)
"""

from __future__ import annotations

import os

if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and (
    "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from spmd_fsdp import GPT, Block, counting_sequences  # noqa: E402
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: E402

import spmd_torch.core.xla_model as xm  # noqa: E402
import spmd_torch.debug.metrics as met  # noqa: E402
import spmd_torch.distributed.spmd as xs  # noqa: E402
import spmd_torch.experimental.distributed_checkpoint as xc  # noqa: E402
import spmd_torch.runtime as xr  # noqa: E402
from spmd_torch.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

STEPS, KILL_AFTER, BATCH, SEQ, VOCAB = 14, 8, 16, 32, 64


def train(directory: str, mesh_shape: str) -> None:
    """Train (resuming from the newest checkpoint in ``directory`` if any), printing each loss."""
    xr.use_spmd()
    if mesh_shape == "8":
        mesh, extra_axis = xs.Mesh(np.arange(8), (8,), ("fsdp",)), None
    else:
        mesh, extra_axis = xs.Mesh(np.arange(8), (4, 2), ("data", "fsdp")), "data"
    torch.manual_seed(0)
    model = GPT(VOCAB, 64, heads=4, layers=2, seq_len=SEQ)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, extra_data_axis=extra_axis)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    manager = xc.CheckpointManager(directory, save_interval=3)
    start = 0
    if manager.all_steps():
        step = max(manager.all_steps())
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": 0}
        manager.restore(step, state)  # in place; AdamW's state is created here
        optimizer.load_state_dict(state["optim"])
        xm.set_rng_state(state["rng"])
        start = step + 1
        print(f"resumed from step {step} on mesh {dict(mesh.shape())}", flush=True)

    tokens, targets = counting_sequences(STEPS * BATCH, SEQ, VOCAB).tensors
    batch_axes = ("data", "fsdp") if extra_axis else "fsdp"
    met.clear_all()
    for step in range(start, STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        x, y = tokens[rows].to("xla"), targets[rows].to("xla")
        xs.mark_sharding(x, mesh, (batch_axes, None))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten().to(x.device))
        loss.backward()
        optimizer.step()
        xm.mark_step()
        print(f"step {step} loss {loss.item():.9e}", flush=True)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        manager.save_async(step, {**state, "rng": xm.get_rng_state()})
    manager.join()
    print(f"compilations {met.counter_value('UncachedCompile') or 0}", flush=True)


def start(directory: str, mesh_shape: str) -> subprocess.Popen:
    """``train`` in a new process, its output piped back."""
    command = [sys.executable, __file__, "--train", directory, "--mesh", mesh_shape]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def losses_of(process: subprocess.Popen, mesh_shape: str, kill_after: int | None = None) -> dict:
    """The losses a training process prints, by step; SIGKILL it once it has printed step
    ``kill_after``."""
    losses = {}
    for line in process.stdout:
        print(f"  [{mesh_shape:>3}] {line}", end="")
        if line.startswith("step"):
            _, step, _, loss = line.split()
            losses[int(step)] = float(loss)
            if int(step) == kill_after:
                process.send_signal(signal.SIGKILL)
                print(f"  [{mesh_shape:>3}] -- killed with SIGKILL after step {step}")
                break
    process.wait()
    process.stdout.close()
    if kill_after is None and process.returncode != 0:
        raise SystemExit(f"training on mesh {mesh_shape} failed ({process.returncode})")
    return losses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", metavar="DIR", help="(internal) run one training process")
    parser.add_argument("--mesh", default="8")
    args = parser.parse_args()
    if args.train:
        train(args.train, args.mesh)
        return 0

    with tempfile.TemporaryDirectory() as root:
        crashed = os.path.join(root, "crashed")
        uninterrupted = start(os.path.join(root, "reference"), "8")  # meanwhile: it shares nothing
        try:
            print("training on 8 devices, killed mid-run:")
            losses_of(start(crashed, "8"), "8", kill_after=KILL_AFTER)
            complete = xc.CheckpointManager(crashed, save_interval=3).all_steps()
            print(f"complete checkpoints after the kill: {complete}")
            print("resuming on a (4, 2) mesh:")
            resumed = losses_of(start(crashed, "4x2"), "4x2")
            print("the uninterrupted reference (run alongside):")
            reference = losses_of(uninterrupted, "8")
        finally:
            if uninterrupted.poll() is None:  # the resume failed: leave no training behind
                uninterrupted.kill()
                uninterrupted.wait()

    worst = max(abs(resumed[s] - reference[s]) / abs(reference[s]) for s in resumed)
    print(f"resumed steps {min(resumed)}..{max(resumed)}: largest relative difference {worst:.2e}")
    if min(resumed) != max(complete) + 1 or worst > 1e-5:
        print("FAILED: the resumed run does not continue the uninterrupted one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
