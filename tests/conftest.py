"""Test-wide setup: 8 virtual CPU devices and XLA's quick codegen before JAX initialises, a
per-test hang guard, and a guard that fails a test leaking engine state (SPMD mode, pending
tensors) into the next."""

import faulthandler
import gc
import os

from tests.xla_codegen import QUICK_CODEGEN, USERS_CODEGEN, quick

os.environ.setdefault("JAX_PLATFORMS", "cpu")
USERS_FLAGS = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in USERS_FLAGS:
    USERS_FLAGS = f"{USERS_FLAGS} --xla_force_host_platform_device_count=8".strip()
QUICK = quick(USERS_FLAGS)  # a run's own choice stays
os.environ["XLA_FLAGS"] = " ".join([USERS_FLAGS, *(f"--{n}={QUICK_CODEGEN[n]}" for n in QUICK)])

import jax  # noqa: E402

jax.devices()  # XLA reads its flags as its backend starts
# Back to the run's own: left set, the users_codegen tests compiled quickly in full runs of the
# suite (something in this process reads the variable again), and lost their bits. Children that
# compile quickly are given xla_codegen.child_flags().
os.environ["XLA_FLAGS"] = USERS_FLAGS

import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

import spmd_torch.debug.graph as graph  # noqa: E402
import spmd_torch.runtime as xr  # noqa: E402
from spmd_torch._lazy import engine  # noqa: E402

_HANG_SECONDS = 300
_SPMD_FROM_ENV = "XLA_USE_SPMD" in os.environ  # xr.use_spmd() sets it too, as PyTorch/XLA does


# --- XLA's quick codegen ---------------------------------------------------------------------------

_compile = jax.stages.Lowered.compile
_users_codegen_on = [False]


def _compile_as_users(self, compiler_options=None, **kwargs):
    """A ``users_codegen`` test's program compiles with XLA's defaults over the quick flags."""
    if _users_codegen_on[0]:
        defaults = {name: USERS_CODEGEN[name] for name in QUICK}
        compiler_options = {**defaults, **(compiler_options or {})}
    return _compile(self, compiler_options, **kwargs)


jax.stages.Lowered.compile = _compile_as_users


@pytest.fixture(autouse=True)
def _users_codegen(request):
    """A ``users_codegen`` test compiles with XLA's defaults, into a compile cache of its own (the
    shared one holds the same programs compiled quickly). Its JAX programs compile through
    ``Lowered.compile``, as the engine's do."""
    if request.node.get_closest_marker("users_codegen") is None:
        yield
        return
    own = engine.current()
    shared, own.cache, _users_codegen_on[0] = own.cache, engine.CompileCache(), True
    try:
        yield
    finally:
        own.cache, _users_codegen_on[0] = shared, False


@pytest.fixture(autouse=True)
def _hang_guard():
    """Dump every thread's traceback and abort if one test hangs."""
    faulthandler.dump_traceback_later(_HANG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def engine_leaks(spmd_expected: bool = False) -> list[str]:
    """What the engine still holds that a finished test should have let go of: every switch user
    code left changed (``Engine.leftovers``: mode, profiler scope, compile region, eager mode,
    marked step, global mesh, step closures) and pending tensors."""
    own = engine.current()
    leaks = [
        f"{what} (call spmd_torch.runtime.reset())"
        for what in own.leftovers()
        if not (what.startswith("mode ") and (spmd_expected or _SPMD_FROM_ENV))
    ]
    if graph.pending_count():
        gc.collect()  # cycles (autograd graphs) may hold tensors the test no longer reaches
    pending = graph.pending_count()
    if pending:
        text = graph.pending_text().splitlines()
        if any("= full_to_shard(" in line for line in text):
            leaks.append("a manual region was entered (enable_manual_sharding) and never left")
        shown = "\n    ".join(text[:8] + (["..."] if len(text) > 8 else []))
        leaks.append(
            f"{pending} tensors still hold pending values; sync() or drop them:\n    {shown}"
        )
    return leaks


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed or hasattr(report, "wasxfail")
    return report


@pytest.fixture(autouse=True)
def _no_engine_leaks(request):
    """Fail a passing test that leaves engine state behind (a failed one's traceback holds its
    tensors: nothing to add); reset the engine either way."""
    yield
    leaks = engine_leaks(spmd_expected="spmd_mode" in request.fixturenames)
    xr.reset()
    if leaks and not request.node.stash.get(_CALL_FAILED, False):
        pytest.fail(f"{request.node.nodeid} leaked engine state:\n- " + "\n- ".join(leaks))


@pytest.fixture
def restore_jax_cache_config():
    """The test may turn JAX's persistent compilation cache on (``xr.initialize_cache``): its
    settings come back afterwards, and JAX sets the cache up again from them."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_persistent_cache_min_compile_time_secs",
    )
    old = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in old.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
