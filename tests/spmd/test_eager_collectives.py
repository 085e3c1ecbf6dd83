"""Programs holding collectives, dispatched back to back on the CPU, never deadlock: eager mode's
one program per op made PyTorch/XLA's eager SPMD data-parallel example hang on a 2-core host (two
programs' all-reduce participants held XLA's CPU thread pool, each waiting for the other's).

The pattern runs in a child process under a wall-clock limit: a deadlock aborts the process (XLA
gives up on the rendezvous after 40 s) or hangs it, and must fail this test, not the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.multiprocess

PATTERN = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, torch
    import spmd_torch, spmd_torch.runtime as xr, spmd_torch.distributed.spmd as xs
    import spmd_torch.experimental as exp

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    weights = []
    for _ in range(16):
        w = torch.randn(256, 256).to("xla")
        xs.mark_sharding(w, mesh, ("data", None))
        weights.append(w)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    model.to("xla")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = torch.randn(64, 128).to("xla")
    xs.mark_sharding(batch, mesh, ("data", None))
    spmd_torch.sync()
    exp.eager_mode(True)
    sums = [(w @ w.t()).sum() for _ in range(20) for w in weights]  # 320 all-reduce programs
    for step in range(10):  # eager SPMD data parallel: every gradient all-reduced, op by op
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()
    print("sum", float(sum(s.item() for s in sums[-16:])), flush=True)
    """
)


def test_many_programs_with_collectives_in_eager_spmd_run_to_the_end():
    done = subprocess.run(
        [sys.executable, "-c", PATTERN],
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sum" in done.stdout
