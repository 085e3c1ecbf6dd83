"""Test-wide setup: 8 virtual CPU devices before JAX initialises, and a per-test hang guard."""

import faulthandler
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import pytest  # noqa: E402

_HANG_SECONDS = 300


@pytest.fixture(autouse=True)
def _hang_guard():
    """Dump every thread's traceback and abort if one test hangs."""
    faulthandler.dump_traceback_later(_HANG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
