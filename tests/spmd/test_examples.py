"""The examples beyond MNIST run to completion: their own checks pass, their output is checked."""

from __future__ import annotations

import re

import pytest

from tests.helpers import run_example as _run

# Each test runs an example as a script, in a process of its own.
pytestmark = pytest.mark.multiprocess

DEVICES = ",".join(map(str, range(8)))


@pytest.mark.slow
def test_spmd_fsdp_example_trains_with_sharded_parameters():
    output = _run("spmd_fsdp.py")
    assert f"{{devices=[8,1]{DEVICES}}}" in output  # embedding / qkv rows over 'fsdp'
    assert f"{{devices=[1,8]{DEVICES}}}" in output  # the largest dimension is the second
    assert f"{{devices=[8]{DEVICES}}}" in output  # 1-D parameters are split too
    # one program for every step: AdamW's moments are filled on the host
    assert "compilations 1" in output and "Counter: UncachedCompile\n  Value: 1" in output


@pytest.mark.slow
def test_spmd_2d_example_matches_eager_cpu():
    output = _run("spmd_2d.py")
    assert "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}" in output  # up.weight
    assert "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}" in output  # down.weight
    assert "MISMATCH" not in output


@pytest.mark.slow
def test_spmd_2d_example_on_a_4x2_mesh():
    output = _run("spmd_2d.py", "--data", "4", "--model", "2", "--steps", "3")
    assert "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}" in output


@pytest.mark.slow
def test_checkpoint_resume_example_continues_the_uninterrupted_run_after_sigkill():
    output = _run("checkpoint_resume.py")
    assert "killed with SIGKILL after step 8" in output
    # step 6's write normally completes before the kill; a slow disk may leave it unfinished
    assert re.search(r"resumed from step [36] on mesh \{'data': 4, 'fsdp': 2\}", output)
    assert "[4x2] compilations 1" in output  # the resumed loop compiles once, AdamW state included
    assert "largest relative difference" in output and "FAILED" not in output


@pytest.mark.slow
def test_paged_decode_example_generates_eager_cpus_tokens_with_one_program():
    """Prefill and five decode steps of three sequences through ragged paged attention over a
    paged cache: eager CPU's tokens, and one program for every step."""
    output = _run("paged_decode.py")
    assert "step 5: tokens" in output and "generated 6 tokens for 3 sequences" in output
    assert "compilations 1" in output
    assert "MISMATCH" not in output and "FAILED" not in output


@pytest.mark.slow
def test_profile_mnist_example_captures_steps_regions_and_program(tmp_path):
    output = _run("profile_mnist.py", "--logdir", str(tmp_path), "--steps", "4")
    assert "host region train_step: 4" in output and "host region forward: 4" in output
    assert re.search(r"device program jit_SyncTensorsGraph_[0-9a-f]{8}: 4 runs", output)


@pytest.mark.slow
def test_llama_example_matches_eager_cpu_and_resumes_bit_exact_on_another_mesh_and_host_count(
    tmp_path,
):
    """Trained in float32 on one host's (2, 4) mesh, its first losses are eager CPU's; resumed
    by two hosts on a (4, 2) mesh in bf16, every parameter and AdamW bit is the one saved."""
    ckpt = str(tmp_path)
    first = _run(
        "llama_pod.py", "--precision", "fp32", "--check-eager", "2", "--steps", "3", "--ckpt", ckpt
    )
    assert "mesh {'fsdp': 2, 'tensor': 4} over 1 host(s)" in first
    differences = re.findall(r"eager cpu step \d loss \S+ relative difference (\S+)", first)
    assert len(differences) == 2 and all(float(d) <= 1e-5 for d in differences), first
    # the layers' stacks, then one step program for every step (AdamW's moments filled on the
    # host before the first)
    assert "training compilations 2" in first
    saved = re.search(r"saved step 2: checksum (\S+)", first).group(1)

    resumed = _run("llama_pod.py", "--steps", "5", "--mesh", "4x2", "--ckpt", ckpt, hosts=2)
    assert "mesh {'fsdp': 4, 'tensor': 2} over 2 host(s)" in resumed
    assert f"resumed from step 2: checksum {saved}, bit-exact True" in resumed
    # the stacks (the layers' and AdamW's moments': one small program, their shapes and layouts
    # alike), then one step program for both steps
    assert "training compilations 2" in resumed
    steps = re.findall(r"^(?:\[host 0\] )?step \d loss (\S+)", first + resumed, re.MULTILINE)
    losses = [float(loss) for loss in steps]
    assert len(losses) == 5 and losses == sorted(losses, reverse=True), losses
    assert "FAILED" not in resumed
