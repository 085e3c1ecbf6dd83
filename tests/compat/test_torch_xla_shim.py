"""``torch_xla`` as spmd_torch, only when asked for: installed from compat/torch_xla, or for one run
with ``python -m spmd_torch.run_as_torch_xla``. Libraries see a torch_xla 2.9.0 distribution whose
modules are spmd_torch's very module objects; the seed guides' older names (``lazy_tensor_core``,
``torch_xla_py``) come with it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import tomllib

from spmd_torch import _as_torch_xla
from tests.helpers import ROOT
from tests.xla_codegen import child_flags

COMPAT = ROOT / "compat" / "torch_xla"

# What a library would check, run in a child process that sees torch_xla one way or the other.
CHECKS = """
import importlib.metadata, importlib.util, sys
from packaging.version import Version
import torch
import lazy_tensor_core  # the older names first: they must not need torch_xla imported
import lazy_tensor_core.core.lazy_model as ltm
import lazy_tensor_core.utils.serialization as ltc_xser
import torch_xla_py.xla_model as old_xm
import torch_xla_py.data_parallel as dp
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
import spmd_torch, spmd_torch.core.xla_model, spmd_torch.distributed.spmd, spmd_torch.runtime
import spmd_torch.core.lazy_model, spmd_torch.distributed.legacy_data_parallel
import spmd_torch.utils.serialization

assert torch_xla.__version__ == "{version}", torch_xla.__version__
assert importlib.metadata.version("torch_xla") == "{version}"
assert len(list(importlib.metadata.distributions(name="torch_xla"))) == 1
assert Version(torch_xla.__version__) >= Version("2.2")  # transformers' FSDPv2 gate
assert importlib.util.find_spec("torch_xla") is not None
assert xm is spmd_torch.core.xla_model and xr is spmd_torch.runtime
assert torch_xla.xm is xm and torch_xla.xr is xr  # PyTorch/XLA's top level imports them so
assert sys.modules["torch_xla.distributed.spmd"] is spmd_torch.distributed.spmd
mesh = xs.Mesh(list(range(8)), (8,), ("data",))
assert isinstance(mesh, spmd_torch.distributed.spmd.Mesh)
xr.use_spmd()
assert spmd_torch.runtime.is_spmd()  # one state under both names
assert torch_xla.device() == spmd_torch.device() and torch_xla.sync is spmd_torch.sync
assert ltm is spmd_torch.core.lazy_model and ltc_xser is spmd_torch.utils.serialization
assert old_xm is xm and dp is spmd_torch.distributed.legacy_data_parallel
assert str(torch.ones(2, device=ltm.lazy_device()).device) == "xla:0"
print("checked")
"""


def _child(*command: str, path: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    env["XLA_FLAGS"] = child_flags()
    return subprocess.run(
        [sys.executable, *command], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", ["torch_xla", "lazy_tensor_core", "torch_xla_py"])
def test_without_the_shim_the_name_is_not_there(name):
    assert importlib.util.find_spec(name) is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_the_distribution_version_is_the_shims():
    project = tomllib.loads((COMPAT / "pyproject.toml").read_text())["project"]
    assert project["version"] == _as_torch_xla.VERSION
    assert project["name"] == "torch_xla"


@pytest.mark.multiprocess
def test_run_as_torch_xla_for_one_run(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(CHECKS.format(version=_as_torch_xla.VERSION))
    done = _child("-m", "spmd_torch.run_as_torch_xla", str(script), path=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked" in done.stdout


@pytest.mark.multiprocess
def test_run_as_torch_xla_imports_the_scripts_neighbours(tmp_path):
    (tmp_path / "helper_module.py").write_text("VALUE = 41\n")  # as `python script.py` finds it
    script = tmp_path / "script.py"
    script.write_text("import helper_module, sys\nprint(helper_module.VALUE + 1, sys.argv[1:])\n")
    done = _child("-m", "spmd_torch.run_as_torch_xla", str(script), "--x", path=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "42 ['--x']"


CHILD = """
import importlib.metadata, multiprocessing, subprocess, sys

def child_versions(_):
    import torch_xla, torch_xla.core.xla_model as xm
    import lazy_tensor_core.core.lazy_model as ltm, torch_xla_py.data_parallel as dp
    names = xm.__name__, ltm.__name__, dp.__name__
    return torch_xla.__version__, importlib.metadata.version("torch_xla"), *names

if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(pool.map(child_versions, [0])[0])
    command = "import torch_xla_py.xla_model as xm, torch_xla; print(torch_xla.__version__)"
    print(subprocess.run([sys.executable, "-c", command], capture_output=True, text=True).stdout)
"""


@pytest.mark.multiprocess
def test_the_runs_child_processes_see_torch_xla_too(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(CHILD)
    done = _child("-m", "spmd_torch.run_as_torch_xla", str(script), path=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    version = _as_torch_xla.VERSION
    spawned, ran = done.stdout.strip().splitlines()
    names = "spmd_torch.core.xla_model", "spmd_torch.core.lazy_model"
    names += ("spmd_torch.distributed.legacy_data_parallel",)
    assert spawned == str((version, version, *names)) and ran == version


@pytest.mark.multiprocess
def test_installed_distribution(tmp_path):
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet"]
        + ["--target", str(target), str(COMPAT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    done = _child("-c", CHECKS.format(version=_as_torch_xla.VERSION), path=f"{target}:{ROOT}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked" in done.stdout
