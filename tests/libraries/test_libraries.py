"""The libraries users run on PyTorch/XLA, run the way their users run them: each flow runs twice,
on eager CPU (no torch_xla) and with torch_xla being spmd_torch (``run_as_torch_xla``), and the
two must agree. The libraries switch into their XLA code paths by themselves (accelerate's XLA
distributed type, Trainer's xm.mark_step and FSDPv2, diffusers' per-step mark_step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, assert_close
from tests.xla_codegen import child_flags

FLOWS = ROOT / "tests" / "libraries" / "flows"
pytestmark = pytest.mark.multiprocess


def run_flow(name: str, *args: str, shim: bool, home, capture: bool = False) -> dict:
    """One flow in a child process; its last stdout line is its JSON report. ``capture``: with
    spmd_torch's automatic capture on."""
    script = [str(FLOWS / f"{name}.py"), *args]
    command = [sys.executable, *(["-m", "spmd_torch.run_as_torch_xla"] if shim else []), *script]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "HOME": str(home),
        "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": child_flags(),
        **({"SPMD_TORCH_AUTO_CAPTURE": "1"} if capture else {}),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=home)
    assert done.returncode == 0, f"{name} {args} (shim={shim}) failed:\n{done.stderr[-6000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def both(
    name: str, *args: str, tmp_path, eager_args: tuple | None = None, capture: bool = False
) -> tuple[dict, dict]:
    """The flow on eager CPU (with ``eager_args`` if given) and through the shim (``args``),
    there with automatic capture on if ``capture``."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "xla").mkdir()
    eager_args = args if eager_args is None else eager_args
    eager = run_flow(name, *eager_args, shim=False, home=tmp_path / "cpu")
    lazy = run_flow(name, *args, shim=True, home=tmp_path / "xla", capture=capture)
    assert eager["device"] == "cpu" and lazy["device"] == "xla:0"
    return eager, lazy


def test_accelerate_training_loop(tmp_path):
    pytest.importorskip("accelerate")
    eager, lazy = both("accelerate_loop", tmp_path=tmp_path)
    assert lazy["distributed_type"] == "DistributedType.XLA"
    assert len(lazy["losses"]) == 12
    assert_close(torch.tensor(lazy["losses"]), torch.tensor(eager["losses"]))
    assert lazy["restored"] and eager["restored"]
    first, *later = lazy["compiles_per_epoch"]
    assert later == [first] * len(later)  # epochs after the first compile nothing


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdpv2"])
def test_transformers_trainer(fsdp, tmp_path):
    pytest.importorskip("transformers")
    # FSDPv2 changes where the weights live, not the numbers: its reference is the plain run.
    args = ["fsdp"] if fsdp else []
    eager, lazy = both("trainer_llama", *args, tmp_path=tmp_path, eager_args=())
    assert len(lazy["losses"]) == 5
    assert_close(torch.tensor(lazy["losses"]), torch.tensor(eager["losses"]))
    assert_close(torch.tensor(lazy["eval_loss"]), torch.tensor(eager["eval_loss"]))
    # The first step also builds AdamW's state, a program of its own, and a step's program runs
    # at the next step's barrier: from the third step on, nothing compiles.
    counts = lazy["compiles_per_step"]
    assert counts[2:] == [counts[2]] * 3, counts
    if fsdp:  # each weight sharded over the 8-device fsdp axis, as FSDPv2 does
        assert lazy["sharding"].startswith("{devices=[8,1]"), lazy["sharding"]
        assert "pytorch_model.bin" in lazy["saved"]
    else:
        assert "model.safetensors" in lazy["saved"] and lazy["saved"] == eager["saved"]


@pytest.mark.parametrize(
    "library, flow, captured",
    [
        ("accelerate", "accelerate_loop", ["Sequential.forward", "AdamW.step"]),
        ("transformers", "trainer_llama", ["LlamaForCausalLM.forward", "AdamW.step"]),
        ("lightning", "lightning_fit", ["SGD.step", "Sequential.forward"]),
    ],
)
def test_automatic_capture_takes_over_library_loops(library, flow, captured, tmp_path):
    """With ``SPMD_TORCH_AUTO_CAPTURE=1`` the libraries' loops, unchanged, run their model's
    forward and their optimizer's step through Dynamo once the step repeats, though a data
    loader's barrier comes between every two steps (accelerate, Trainer) or the step is given a
    closure holding the forward (Lightning); the losses stay eager's."""
    pytest.importorskip(library)
    eager, lazy = both(flow, tmp_path=tmp_path, capture=True)
    assert eager["captured"] == [] and lazy["captured"] == captured
    assert_close(torch.tensor(lazy["losses"]), torch.tensor(eager["losses"]))


def test_diffusers_pipeline(tmp_path):
    pytest.importorskip("diffusers")
    eager, lazy = both("diffusers_ddpm", tmp_path=tmp_path)
    assert_close(torch.tensor(lazy["image"]), torch.tensor(eager["image"]))
    # One program per kind of step: the noisy steps, the last (noise-free) step, the image output.
    assert lazy["compiles"] == 3


def test_huggingface_hub_save_pretrained(tmp_path):
    pytest.importorskip("huggingface_hub")
    eager, lazy = both("hub_save_pretrained", tmp_path=tmp_path)
    assert lazy["config"] == {"width": 4}
    assert_close(torch.tensor(lazy["weight"]), torch.tensor(eager["weight"]), tol="exact")
    assert_close(torch.tensor(lazy["out"]), torch.tensor(eager["out"]))


def test_lightning_xla_accelerator_and_strategy(tmp_path):
    pytest.importorskip("lightning")
    eager, lazy = both("lightning_fit", tmp_path=tmp_path)
    assert lazy["strategy"] == "SingleDeviceXLAStrategy"
    assert len(lazy["losses"]) == 12
    assert_close(torch.tensor(lazy["losses"]), torch.tensor(eager["losses"]))
    assert_close(torch.tensor(lazy["weight"]), torch.tensor(eager["weight"]), tol="training")
    # Lightning marks each optimizer step; the first step (no gradients yet to accumulate into)
    # is a program of its own, and a step's program runs at the next barrier: from the second
    # epoch on, nothing compiles.
    counts = lazy["compiles_per_epoch"]
    assert counts[1:] == [counts[1]] * 2, counts
