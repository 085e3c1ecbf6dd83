"""Under the ``torch_xla`` face, the few behaviours that follow PyTorch/XLA's rather than
spmd_torch's own (docs/migration.md): a CPU tensor joining a device op is uploaded, a profiler
region open at a barrier is an error, an SPMD upload lands once an op reads it, and
``import torch_xla`` patches ``nn.GRU`` and
``clip_grad_norm_`` and defines ``torch.ops.quantized_decomposed`` as PyTorch/XLA's import does. Outside the face each stays as spmd_torch has it.
"""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.debug.profiler as xp
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch import config
from spmd_torch._XLAC import _get_xla_tensor_debug_info as debug_info
from tests.helpers import ROOT, assert_close

dev = spmd_torch.device()


@pytest.fixture
def face():
    with mock.patch.object(config.FACE, "on", True):
        yield


def test_under_the_face_a_cpu_tensor_in_a_device_op_is_uploaded_with_a_warning(face):
    x, y = torch.randn(5), torch.randn(2, 5)
    with pytest.warns(UserWarning, match=r"a \(2, 5\) torch.float32 CPU tensor joined an op") as w:
        out = x.to(dev) * y
    assert w[0].filename == __file__  # the user's line, not ours
    assert out.device == dev
    assert_close(out.cpu(), x * y, tol="exact")
    assert_close((y - x.to(dev)).cpu(), y - x, tol="exact")  # the CPU tensor first, too


@pytest.fixture
def spmd_mode():
    xr.use_spmd()


def _uploads() -> int:
    return met.counter_value("TransferToDevice") or 0


def test_under_the_face_an_spmd_upload_lands_when_an_op_reads_it(face, spmd_mode):
    """As PyTorch/XLA's virtual device: held on the host until a traced op reads it, then
    uploaded whole (replicated) before any program runs; a later ``mark_sharding`` reshards it."""
    host = torch.randn(8, 8)
    t = host.to(dev)
    assert "Tensor on host: with size [8, 8]" in debug_info(t)
    before = _uploads()
    doubled = t + t
    assert _uploads() == before + 1  # traced only: no program ran
    info = debug_info(t)
    assert "Tensor on host: None" in info and "IR: xla::device_data" in info
    assert "NumShards: 8" in info and "OpSharding: {replicated}" in info
    xs.mark_sharding(t, xs.Mesh(np.arange(8), (8, 1)), (0, 1))
    assert_close(doubled.cpu(), 2 * host, tol="exact")
    assert_close((t * 3).cpu(), 3 * host, tol="exact")


def test_outside_the_face_an_spmd_upload_waits_for_its_layout(spmd_mode):
    """Traced ops leave it on the host, so a ``mark_sharding`` after them uploads each device's
    shard only: one upload, straight into the layout."""
    host = torch.randn(8, 8)
    t = host.to(dev)
    doubled = t + t
    assert "Tensor on host: with size [8, 8]" in debug_info(t)
    before = _uploads()
    xs.mark_sharding(t, xs.Mesh(np.arange(8), (8, 1)), (0, 1))
    assert _uploads() == before + 1
    assert "OpSharding: {devices=[8,1]0,1,2,3,4,5,6,7}" in debug_info(t)
    assert_close(doubled.cpu(), 2 * host, tol="exact")


def test_a_barrier_inside_a_trace_region_runs_outside_the_face():
    x = torch.ones(3, device=dev)
    with xp.Trace("outer"):
        y = x * 2
        spmd_torch.sync()
    assert_close(y.cpu(), torch.full((3,), 2.0), tol="exact")


def test_under_the_face_a_region_open_at_a_barrier_is_an_error(face):
    """As PyTorch/XLA numbers regions: siblings since the last barrier count 1, 2, ...; the
    outermost open region is named. ``reset_scope=False`` keeps the region open."""
    with xp.Trace("first"):
        pass
    with xp.Trace("second"):
        with xp.Trace("inner"):
            with pytest.raises(
                RuntimeError, match=r"^Expecting scope to be empty but it is second.2$"
            ):
                spmd_torch.sync()
            spmd_torch.sync(reset_scope=False)
    spmd_torch.sync()
    with xp.Trace("third"):  # numbered afresh after the barrier
        with pytest.raises(RuntimeError, match="it is third.1$"):
            xm.mark_step()


def test_under_the_face_a_step_trace_ends_with_its_barrier(face):
    """A ``StepTrace`` closes its own region before the barrier it issues, as PyTorch/XLA's."""
    x = torch.ones(2, device=dev)
    for step in range(2):
        with xp.StepTrace("train_step", step_num=step):
            x = x + 1
    xp.set_tracer_marked_step(False)
    assert_close(x.cpu(), torch.full((2,), 3.0), tol="exact")


CHILD = """
import torch
import torch_xla
from torch_xla.experimental.gru import GRU
before = torch.nn.utils.clip_grad_norm_

# nn.GRU is the scanned GRU, torch's kept as _orig; a bidirectional one is torch's own.
assert torch.nn.GRU is GRU and torch.nn.GRU._orig.__module__ == "torch.nn.modules.rnn"
torch.manual_seed(0)
theirs = torch.nn.GRU._orig(3, 4, num_layers=2)
ours = torch.nn.GRU(3, 4, num_layers=2)
ours.load_state_dict(theirs.state_dict())
x = torch.randn(7, 2, 3)
expected, _ = theirs(x)
got, _ = ours.to("xla")(x.to("xla"))
assert torch.allclose(got.cpu(), expected, atol=1e-5), (got.cpu() - expected).abs().max()
assert type(torch.nn.GRU(3, 4, bidirectional=True)) is torch.nn.GRU._orig

# clip_grad_norm_ of xla parameters without gradients: a zero on the device.
w = torch.rand(3, 3).to("xla")
zero = torch.nn.utils.clip_grad_norm_(w, 1.0)
assert zero.device.type == "xla" and zero.cpu().item() == 0.0
assert torch.nn.utils.clip_grad_norm_(torch.rand(3), 1.0).device.type == "cpu"  # torch's own
# with gradients: torch's own result and clipping
g = torch.randn(3, 3) * 10
w.grad = g.to("xla")
norm = torch.nn.utils.clip_grad_norm_([w], 1.0)
ref = torch.zeros(3, 3, requires_grad=True)
ref.grad = g.clone()
assert torch.allclose(norm.cpu(), torch.nn.utils.clip_grad_norm_._orig([ref], 1.0))
assert torch.allclose(w.grad.cpu(), ref.grad, atol=1e-6)
# PT2E quantization's ops are defined, as PyTorch/XLA's import defines them
q = torch.ops.quantized_decomposed.quantize_per_channel(
    torch.tensor([[1.0, -2.0]]), torch.tensor([0.5]), torch.tensor([0]), 0, -128, 127, torch.int8
)
assert q.tolist() == [[2, -4]]
import importlib; importlib.reload(torch_xla)  # importing again patches nothing twice
assert torch.nn.utils.clip_grad_norm_ is before and torch.nn.GRU is GRU
print("checked")
"""


@pytest.mark.multiprocess
def test_import_torch_xla_patches_gru_and_clip_grad_norm(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(CHILD)
    env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "spmd_torch.run_as_torch_xla", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked" in done.stdout


def test_import_spmd_torch_patches_nothing_in_torch():
    assert torch.nn.GRU.__module__ == "torch.nn.modules.rnn"
    assert not hasattr(torch.nn.utils.clip_grad_norm_, "_orig")
