"""The runtime (xr) names PyTorch/XLA scripts use beyond the core ones: set_device_type, the
XLA_USE_SPMD variable use_spmd sets, device attributes, bf16 support, cached graph count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.runtime as xr
import spmd_torch.utils.utils as xu
from spmd_torch import config
from spmd_torch._lazy.execute import global_array


def test_use_spmd_sets_the_variable_and_reset_takes_it_back(monkeypatch):
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    xr.use_spmd()
    assert os.environ["XLA_USE_SPMD"] == "1"
    xr.reset()
    assert "XLA_USE_SPMD" not in os.environ
    assert xr.is_spmd() is False


def test_reset_turns_spmd_off_whoever_set_its_switch(monkeypatch):
    """One truth: the mode. reset() ends SPMD, and the switch a user set goes with it (it was
    left on, and is_spmd() answered True for programs running on one device)."""
    monkeypatch.setenv("XLA_USE_SPMD", "1")
    xr.use_spmd()
    xr.reset()
    assert "XLA_USE_SPMD" not in os.environ and xr.is_spmd() is False
    x = torch.ones(2, device=spmd_torch.device()) + 1
    assert global_array(x).sharding.num_devices == 1


def test_the_spmd_switch_turns_the_mode_on_and_off(monkeypatch):
    """PyTorch/XLA's is_spmd() reads XLA_USE_SPMD: deleting it after use_spmd() ends SPMD, and
    setting it starts SPMD, for the programs that follow too (an input lands on one device, then
    on the whole mesh)."""
    xr.use_spmd()
    x = torch.ones(2, device=spmd_torch.device())
    spmd_torch.sync()
    monkeypatch.delenv("XLA_USE_SPMD")
    assert xr.is_spmd() is False
    assert global_array(x * 2).sharding.num_devices == 1
    monkeypatch.setenv("XLA_USE_SPMD", "1")
    assert xr.is_spmd() is True
    assert global_array(x * 2).sharding.num_devices == 8
    xr.reset()


def test_one_reading_of_every_boolean_switch(monkeypatch):
    """XLA_USE_BF16=2 is on wherever it is read (it was off through one parser, on through the
    other), as PyTorch/XLA's runtime reads it."""
    monkeypatch.setenv("XLA_USE_BF16", "2")
    assert config.USE_BF16.read() is True
    assert xu.check_env_flag("XLA_USE_BF16") is True
    assert xu.getenv_as("XLA_USE_BF16", bool) is True
    monkeypatch.setenv("XLA_USE_BF16", "off")
    assert not config.USE_BF16.read() and not xu.check_env_flag("XLA_USE_BF16")
    monkeypatch.setenv("XLA_USE_BF16", "maybe")
    with pytest.raises(ValueError, match="XLA_USE_BF16='maybe' is not a valid bool"):
        config.USE_BF16.read()


def test_set_device_type_sets_pjrt_device(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    xr.set_device_type("CPU")
    assert os.environ["PJRT_DEVICE"] == "CPU"


def test_set_device_type_refuses_another_kind_once_running(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    with pytest.raises(RuntimeError, match="Can't change device type to 'TPU'.*runs on CPU"):
        xr.set_device_type("TPU")
    assert "PJRT_DEVICE" not in os.environ


@pytest.mark.multiprocess  # a fresh interpreter, before the runtime starts
def test_set_device_type_before_the_runtime_starts_picks_jax_platform():
    script = (
        "import os, jax\n"
        "import spmd_torch.runtime as xr\n"
        "xr.set_device_type('CPU')\n"
        "print(jax.config.jax_platforms, os.environ['PJRT_DEVICE'], xr.device_type())\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="")
    env.pop("PJRT_DEVICE", None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "CPU", "CPU"]


@pytest.mark.multiprocess  # a fresh interpreter: the variables are read at import
@pytest.mark.parametrize(
    "xla_flags, count", [("", 4), ("--xla_force_host_platform_device_count=2", 2)]
)
def test_pytorch_xla_start_up_variables_pick_platform_and_cpu_devices(xla_flags, count):
    script = "import jax, spmd_torch\nprint(jax.config.jax_platforms, jax.device_count())\n"
    env = dict(os.environ, JAX_PLATFORMS="", PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    env["XLA_FLAGS"] = xla_flags  # XLA's own count, when given, is the one that counts
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", str(count)]


@pytest.mark.multiprocess  # a fresh interpreter: PJRT_DEVICE is read at import
@pytest.mark.parametrize(
    "pjrt_device, platform, fix",
    [
        ("CUDA", "cuda", 'pip install -U "jax[cuda12]", or "jax[cuda13]"'),
        ("GPU", "cuda", 'pip install -U "jax[cuda12]", or "jax[cuda13]"'),
        ("TPU", "tpu", 'pip install -U "jax[tpu]"'),
    ],
)
def test_a_platform_jax_cannot_start_is_named_with_its_fix(pjrt_device, platform, fix):
    if xr._why_jax_cannot_start(platform) == []:
        pytest.skip(f"this machine can start JAX's {platform!r} platform")
    script = (
        "import torch, spmd_torch.core.xla_model as xm\ntorch.ones(2, device=xm.xla_device())\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="", PJRT_DEVICE=pjrt_device)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "AssertionError" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"RuntimeError: PJRT_DEVICE={pjrt_device} asks for JAX's ")
    assert f"{platform!r} platform" in error and fix in error, error
    assert "JAX_PLATFORMS" not in error  # JAX's advice names a variable the user never set


def test_a_cuda_plugin_without_a_gpu_names_only_the_gpu(tmp_path, monkeypatch):
    (tmp_path / "jax_plugins" / "xla_cuda12").mkdir(parents=True)  # as jax[cuda12] installs it
    (tmp_path / "jax_plugins" / "xla_cuda12" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = xr._why_jax_cannot_start("cuda")
    if missing == []:
        pytest.skip("this machine has an NVIDIA GPU")
    assert missing == ["no NVIDIA GPU is visible (no /dev/nvidia0, /dev/nvidiactl, /dev/dxg)"]


def test_device_attributes_name_every_device():
    attributes = xr.global_runtime_device_attributes()
    assert [a["name"] for a in attributes] == [f"CPU:{i}" for i in range(8)]
    assert all(a["device_kind"] == "cpu" and a["platform"] == "cpu" for a in attributes)
    assert xr.runtime_device_attributes("CPU:3") == attributes[3]
    with pytest.raises(RuntimeError, match="no device 'TPU:0'"):
        xr.runtime_device_attributes("TPU:0")


def test_is_bf16_supported_on_cpu():
    assert xr.is_bf16_supported() is True


def test_get_num_cached_compilation_graph_counts_new_programs():
    before = xr.get_num_cached_compilation_graph()
    x = torch.arange(5.0).to(xm.xla_device())
    (x * 3 + 11).cpu()  # a program shape no other test compiles
    assert xr.get_num_cached_compilation_graph() == before + 1
    (x * 3 + 11).cpu()  # the same program again: cached
    assert xr.get_num_cached_compilation_graph() == before + 1
