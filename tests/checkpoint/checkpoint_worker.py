"""A training process for the crash tests: saves ``w = BASE + step`` (sharded 8 ways) every step
through a CheckpointManager, printing ``saving <step>`` before and ``saved <step>`` after.

    python checkpoint_worker.py DIR sync|async|preempt|disk-full
"""

from __future__ import annotations

import os
import resource
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import spmd_torch  # noqa: E402
import spmd_torch.distributed.spmd as xs  # noqa: E402
import spmd_torch.experimental.distributed_checkpoint as xc  # noqa: E402
import spmd_torch.runtime as xr  # noqa: E402

ROWS, COLS = 2048, 2048  # 16 MB: a write long enough to be killed in the middle of


def base() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def main(directory: str, mode: str) -> None:
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (8,), ("d",))
    w = base().to("xla")
    xs.mark_sharding(w, mesh, ("d", None))
    interval = 1000 if mode == "preempt" else 1
    manager = xc.CheckpointManager(directory, save_interval=interval)
    if mode == "disk-full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        limit = ROWS * COLS * 4 + (4 << 20)  # a step of w fits (16 MB, 8 shards)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    for step in range(10**6):
        if step:
            w.add_(1.0)
        spmd_torch.sync()
        state = {"w": w, "step": step}
        print(f"saving {step}", flush=True)
        try:
            if mode in ("async", "preempt"):
                taken = manager.save_async(step, state)
            else:
                taken = manager.save(step, state)
        except OSError as error:
            print(f"error {error}", flush=True)
            return
        if taken:
            print(f"saved {step}", flush=True)
        if mode == "disk-full" and step == 1:
            # The disk fills up: no file may grow past 1 MB from now on, less than one 2 MB
            # shard (OCDBT writes each shard whole into one file, but spreads shards over as
            # many files as the writes' timing makes, so only a limit below a shard is certain)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
