"""The workloads, their implementations and step counts, and the function running each pair."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from . import (
    attention,
    chain,
    checkpoint,
    compiled,
    cpu,
    gpu,
    llama,
    long,
    mp,
    pods,
    scan,
    training,
)
from .models import FSDP

# Workloads run as jobs of spmd_torch.distributed.run (tools/bench/pods.py): always on the
# launcher's CPU devices, and this checkout's only (--against does not apply).
POD_WORKLOADS = ("W4pod", "W2mppod", "PodStart", "PodFault")
# Workloads sized for a GPU: refused without --gpu, except in their --tiny config (CPU smoke test).
GPU_WORKLOADS = ("W7gpu", "Wlong")
# Workloads with a small config under --tiny (what tests run); Wattn's other forms: --gpu or not.
TINY_WORKLOADS = GPU_WORKLOADS + ("W7cpu", "Wattn")
# Workloads that run only where --workloads names them: depth against compile time (scan.py),
# whose unrolled 64 layers take minutes to compile on a CPU.
DEPTH_WORKLOADS = scan.WORKLOADS
WORKLOADS = (
    ("W1", "W2", "W3", "W3amp", "W4", "W2mp", "W5", "W6", "W7cpu", "Wattn")
    + GPU_WORKLOADS
    + POD_WORKLOADS
    + DEPTH_WORKLOADS
)
# jax_plain: hand-written JAX with XLA's plain attention, beside jax's cuDNN attention; the _scan
# ones loop over layers with scan_layers and lax.scan (DEPTH_WORKLOADS).
IMPLS = (
    "eager", "jax", "jax_plain", "spmd_torch", "mp", "inductor", "spmd_compile", "spmd_capture",
    "jax_scan", "spmd_scan",
)  # fmt: skip
# The implementations that import spmd_torch: the ones --against runs in the other checkout too.
SPMD_IMPLS = ("spmd_torch", "mp", "spmd_compile", "spmd_capture", "spmd_scan")
# Implementations that run only where --impls names them: spmd_compile, on spmd_torch's
# torch.compile backend (tools/bench/compiled.py), and spmd_capture, spmd_torch's unchanged lazy
# loop with automatic capture on (SPMD_TORCH_AUTO_CAPTURE=1), until they are the default.
OPT_IN_IMPLS = ("spmd_compile", "spmd_capture")
# Automatic capture arms after two equal steps and compiles at the third: its warm-up covers them.
CAPTURE_WARMUP = 5
# The implementations of each workload (default: eager, jax, spmd_torch). W4 is about sharding,
# which eager PyTorch has no say in; W2mp sets spmd_torch's two ways of data parallelism apart.
WORKLOAD_IMPLS = {
    "W2": ("eager", "jax", "spmd_torch", "spmd_compile", "spmd_capture"),
    "W3": ("eager", "jax", "spmd_torch", "spmd_compile", "spmd_capture"),
    "W6": ("eager", "jax", "spmd_torch", "spmd_compile", "spmd_capture"),
    "W7cpu": ("eager", "jax", "spmd_torch", "spmd_compile", "spmd_capture"),
    "W7gpu": (
        "eager",
        "inductor",
        "jax",
        "jax_plain",
        "spmd_torch",
        "spmd_compile",
        "spmd_capture",
    ),
    "Wattn": ("eager", "inductor", "jax", "jax_plain", "spmd_torch"),
    "Wlong": ("eager", "jax", "jax_plain", "spmd_torch", "spmd_capture"),
    "W3amp": ("eager", "spmd_torch"),
    "W4": ("jax", "spmd_torch"),
    "W2mp": ("mp", "spmd_torch"),
    "W5": ("spmd_torch",),
    "W4pod": ("spmd_torch",),
    "W2mppod": ("mp",),
    "PodStart": ("spmd_torch",),
    "PodFault": ("spmd_torch",),
    **dict.fromkeys(DEPTH_WORKLOADS, scan.IMPLS),
}
_DEFAULT_IMPLS = ("eager", "jax", "spmd_torch")
IMPL_ALIASES = {
    "eager": "eager",
    "torch": "eager",
    "jax": "jax",
    "jax_plain": "jax_plain",
    "spmd": "spmd_torch",
    "spmd_torch": "spmd_torch",
    "mp": "mp",
    "inductor": "inductor",
    "spmd_compile": "spmd_compile",
    "spmd_capture": "spmd_capture",
    "jax_scan": "jax_scan",
    "spmd_scan": "spmd_scan",
}
# Workloads whose CPU runs need FSDP.mesh_devices virtual devices (meshes, W2mp's replicas).
_MESH_WORKLOADS = ("W4", "W2mp", "W5")
# (warm-up, timed) steps per workload; W1 counts repetitions of the whole 2000-op chain, PodStart
# the jobs of each layout (PodFault has no steps to set). W4pod and W2mppod take W4's and W2mp's.
DEFAULT_STEPS = {
    "W1": (2, 10),
    "W2": (5, 20),
    "W3": (3, 10),
    "W3amp": (3, 10),
    "W4": (3, 10),
    "W2mp": (5, 50),
    "W5": (1, 5),
    "W6": (3, 10),
    "W7cpu": (3, 10),
    "Wattn": (1, 2),
    "W7gpu": (3, 10),
    "Wlong": (2, 5),
    "W4pod": (3, 10),
    "W2mppod": (5, 50),
    "PodStart": (0, 3),
    "PodFault": (0, 1),
    **dict.fromkeys(DEPTH_WORKLOADS, (3, 5)),
}
CHECK_STEPS = 3
# Losses of the three implementations must agree to this relative tolerance under --check.
CHECK_RTOL = 1e-4
# bfloat16 workloads (Wattn: its --gpu form): one bf16 ulp (2**-8 to 2**-7 of a value) between
# two implementations' roundings.
CHECK_RTOL_OF = {"W3amp": 8e-3, "W7gpu": 8e-3, "Wattn": 8e-3, "Wlong": 8e-3}
# At most this many programs compiled over a whole run, where a workload sets a target.
MAX_COMPILES = {"W6": 2}

# (warmup, steps, check, gpu, **runner_options) -> result
Runner = Callable[..., dict[str, Any]]
RUNNERS: dict[tuple[str, str], Runner] = {
    ("W1", "eager"): chain.w1_eager,
    ("W1", "jax"): chain.w1_jax,
    ("W1", "spmd_torch"): chain.w1_spmd,
    ("W2", "eager"): training.w2_eager,
    ("W2", "jax"): training.w2_jax,
    ("W2", "spmd_torch"): training.w2_spmd,
    ("W3", "eager"): training.w3_eager,
    ("W3", "jax"): training.w3_jax,
    ("W3", "spmd_torch"): training.w3_spmd,
    ("W2", "spmd_compile"): compiled.w2_spmd_compile,
    ("W3", "spmd_compile"): compiled.w3_spmd_compile,
    ("W3amp", "eager"): training.w3amp_eager,
    ("W3amp", "spmd_torch"): training.w3amp_spmd,
    ("W4", "jax"): training.w4_jax,
    ("W4", "spmd_torch"): training.w4_spmd,
    ("W2mp", "mp"): mp.w2mp_mp,
    ("W2mp", "spmd_torch"): mp.w2mp_spmd,
    ("W5", "spmd_torch"): checkpoint.w5_spmd,
    ("W6", "eager"): llama.w6_eager,
    ("W6", "jax"): llama.w6_jax,
    ("W6", "spmd_torch"): llama.w6_spmd,
    ("W6", "spmd_compile"): llama.w6_spmd_compile,
    ("W7gpu", "eager"): gpu.w7_eager,
    ("W7gpu", "inductor"): gpu.w7_inductor,
    ("W7gpu", "jax"): gpu.w7_jax,
    ("W7gpu", "jax_plain"): gpu.w7_jax_plain,
    ("W7gpu", "spmd_torch"): gpu.w7_spmd,
    ("W7gpu", "spmd_compile"): gpu.w7_spmd_compile,
    ("W7gpu", "spmd_capture"): gpu.w7_spmd,
    ("W7cpu", "eager"): cpu.w7cpu_eager,
    ("W7cpu", "jax"): cpu.w7cpu_jax,
    ("W7cpu", "spmd_torch"): cpu.w7cpu_spmd,
    ("W7cpu", "spmd_compile"): cpu.w7cpu_spmd_compile,
    ("W2", "spmd_capture"): training.w2_spmd,
    ("W3", "spmd_capture"): training.w3_spmd,
    ("W6", "spmd_capture"): llama.w6_spmd,
    ("W7cpu", "spmd_capture"): cpu.w7cpu_spmd,
    ("Wattn", "eager"): attention.wattn_eager,
    ("Wattn", "inductor"): attention.wattn_inductor,
    ("Wattn", "jax"): attention.wattn_jax,
    ("Wattn", "jax_plain"): attention.wattn_jax_plain,
    ("Wattn", "spmd_torch"): attention.wattn_spmd,
    ("Wlong", "eager"): long.wlong_eager,
    ("Wlong", "jax"): long.wlong_jax,
    ("Wlong", "jax_plain"): long.wlong_jax_plain,
    ("Wlong", "spmd_torch"): long.wlong_spmd,
    ("Wlong", "spmd_capture"): long.wlong_spmd,
    ("W4pod", "spmd_torch"): pods.w4pod,
    ("W2mppod", "mp"): pods.w2mppod,
    ("PodStart", "spmd_torch"): pods.pod_start,
    ("PodFault", "spmd_torch"): pods.pod_fault,
    **scan.RUNNERS,
}


def impls_of(workload: str) -> tuple[str, ...]:
    return WORKLOAD_IMPLS.get(workload, _DEFAULT_IMPLS)


def default_workloads(with_gpu_sized: bool) -> tuple[str, ...]:
    """What runs without --workloads: every workload but the depth ones, the GPU-sized ones only
    where asked (--gpu, or --tiny for their small configs)."""
    return tuple(
        w
        for w in WORKLOADS
        if (with_gpu_sized or w not in GPU_WORKLOADS) and w not in DEPTH_WORKLOADS
    )


def refuse_gpu_only(names: list[str], gpu: bool, tiny: bool) -> None:
    """Exits naming the GPU-sized workloads asked for without --gpu (and without --tiny)."""
    refused = [w for w in names if w in GPU_WORKLOADS]
    if refused and not (gpu or tiny):
        raise SystemExit(
            f"{', '.join(refused)} runs only with --gpu (sized for one GPU); --tiny runs its "
            f"small config on CPU as a smoke test"
        )


def runner_options(workload: str, impl: str, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of the pair's runner beyond (warmup, steps, check, gpu)."""
    options: dict[str, Any] = {}
    if workload in TINY_WORKLOADS:
        options["tiny"] = args.tiny
    if impl == "spmd_compile":
        options["backend"] = args.compile_backend
    return options


def cpu_devices(workload: str) -> int | None:
    """Virtual CPU devices the workload's child needs (None: one, JAX's whole thread pool)."""
    return FSDP.mesh_devices if workload in _MESH_WORKLOADS else None


def workload_name(name: str) -> str:
    """The workload spelt as in WORKLOADS (names are case-insensitive: w2mp, W2MP); else `name`."""
    return {w.upper(): w for w in WORKLOADS}.get(name.strip().upper(), name.strip())


def parse_only(only: str) -> tuple[str, str]:
    """--only W:IMPL as (workload, implementation), refusing pairs that do not exist."""
    workload, sep, impl = only.partition(":")
    workload = workload_name(workload)
    if not sep or workload not in WORKLOADS or impl not in IMPL_ALIASES:
        raise SystemExit(
            f"--only expects WORKLOAD:IMPL with WORKLOAD in {WORKLOADS} and IMPL in "
            f"{sorted(IMPL_ALIASES)}; got {only!r}"
        )
    impl = IMPL_ALIASES[impl]
    if impl not in impls_of(workload):
        raise SystemExit(f"--only {only}: {workload} has only {impls_of(workload)}")
    return workload, impl


def steps_for(workload: str, args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up, timed) steps: the workload's defaults unless given; --check runs CHECK_STEPS."""
    if args.check:
        return 0, CHECK_STEPS
    warmup, steps = DEFAULT_STEPS[workload]
    return (
        warmup if args.warmup is None else args.warmup,
        steps if args.steps is None else args.steps,
    )
