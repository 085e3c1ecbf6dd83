"""XLA's quick codegen, for the suite's own process and the processes its tests start with
``child_flags()``.

LLVM's optimizations off and XLA's older CPU fusion emitters: programs compile 2-3x faster
(test_scan, test_lowering_nn and test_attention: 84.6 against 35.4 s; the Llama example's two runs
31 against 18 s), and compiling is most of this suite's time. The HLO is the one users' programs
get, so every check against a reference within a tolerance holds as under XLA's defaults; the
roundings are not (no fused multiply-adds), so a test of results bit-exact with ATen's is marked
``users_codegen`` and compiles as users' programs do. This module imports no JAX: its flags must
be set before JAX starts its backend."""

from __future__ import annotations

import glob
import importlib.util
import mmap
import os

QUICK_CODEGEN = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
USERS_CODEGEN = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def _known_to_xla(names) -> list[str]:
    """The XLA flags among ``names`` the installed jaxlib has (an unknown flag aborts XLA, and
    a later release may drop one): the ones its library names."""
    package = os.path.dirname(importlib.util.find_spec("jaxlib").origin)
    libraries = glob.glob(os.path.join(package, "*.so"))
    if not libraries:
        return []
    with (
        open(max(libraries, key=os.path.getsize), "rb") as handle,  # XLA's
        mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as library,
    ):
        return [name for name in names if library.find(name.encode()) >= 0]


def quick(users_flags: str) -> list[str]:
    """The quick codegen's flag names to add to ``users_flags`` (none off the CPU backend, and
    none a run sets itself)."""
    if os.environ.get("JAX_PLATFORMS", "cpu") != "cpu":
        return []
    return [name for name in _known_to_xla(QUICK_CODEGEN) if name not in users_flags]


def child_flags(devices: int = 8) -> str:
    """``XLA_FLAGS`` for a process a test starts: ``devices`` virtual CPU devices, compiled with
    the quick codegen (a child's checks are within tolerances, or against another child's run)."""
    own = f"--xla_force_host_platform_device_count={devices}"
    return " ".join([own, *(f"--{name}={QUICK_CODEGEN[name]}" for name in quick(own))])
