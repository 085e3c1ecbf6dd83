"""Run a PyTorch/XLA test file, or script, with spmd_torch posing as a TPU host on this CPU one.

PyTorch/XLA's Pallas tests run only where ``xr.device_type()`` is ``'TPU'``. Posing as one, they
check spmd_torch's TPU path here: ``xr.device_type()`` answers ``'TPU'`` (``tpu.version()`` 4, as
does the block-size table of JAX's ragged paged attention kernel),
attention lowers for TPU (the Pallas flash kernel, not the CPU's choice), and every Pallas TPU
kernel runs through Pallas's HLO interpreter (no host callbacks: a kernel the partitioner splits
is traced while XLA compiles). Interpreted kernels are large programs, so their ops carry no
Python traceback (``jax_traceback_in_locations_limit`` 0), which made XLA's inlining slow.
What it does not check: Mosaic's own compilation, TPU memory, speed.

    python -m spmd_torch.run_as_torch_xla tools/pose_as_tpu.py -m pytest test_pallas.py -q
    python -m spmd_torch.run_as_torch_xla tools/pose_as_tpu.py scan/test_scan_pallas.py

``tools/run_pytorch_xla_tests.py --target as_tpu`` runs the TPU-gated files this way.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

import jax
from jax._src import config as jax_config
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    tuned_block_sizes as ragged_blocks,
)

import spmd_torch._internal.tpu as tpu
import spmd_torch.runtime as xr
from spmd_torch._lazy.lowering import attention


def pose() -> None:
    """Answer as a TPU host, and interpret the Pallas TPU kernels."""
    xr.device_type = lambda: "TPU"
    tpu.version = lambda: 4
    ragged_blocks.get_tpu_version = lambda: 4  # JAX's ragged paged attention's block table
    attention._platform = lambda: "tpu"
    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(True)
    jax.config.update("jax_traceback_in_locations_limit", 0)


def main(argv: list[str]) -> None:
    pose()
    if argv[:2] == ["-m", "pytest"]:
        import pytest

        sys.exit(pytest.main(argv[2:]))
    sys.argv = argv
    sys.path.insert(0, str(pathlib.Path(argv[0]).resolve().parent))  # as `python FILE` does
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
