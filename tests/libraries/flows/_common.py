"""What every flow shares: the device the library ran on and the compiles it cost, one JSON line."""

from __future__ import annotations

import json
import sys


def compiles() -> int | None:
    """Programs compiled so far, or None on eager CPU (no torch_xla)."""
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return None
    return met.counter_value("UncachedCompile") or 0


def captured() -> list[str]:
    """The callables spmd_torch's automatic capture runs through Dynamo (none where it is off, or
    on eager CPU)."""
    capture = sys.modules.get("spmd_torch.core.auto_capture")
    return capture.callables().get("captured", []) if capture and capture.enabled() else []


def report(**result) -> None:
    print(json.dumps(result), file=sys.stdout, flush=True)
