"""spmd_torch.core.lazy_model: the lazy-tensor-core guide's names are xla_model's functions (the
guide's blocks run with them in tests/seeds/test_seed_guides.py)."""

from __future__ import annotations

import pytest

import spmd_torch.core.lazy_model as ltm
import spmd_torch.core.xla_model as xm


@pytest.mark.parametrize(
    "old, new",
    [
        ("lazy_device", "xla_device"),
        ("is_lazy_tensor", "is_xla_tensor"),
        ("get_lazy_supported_devices", "get_xla_supported_devices"),
        ("lazy_real_devices", "xla_real_devices"),
        ("lazy_device_hw", "xla_device_hw"),
        ("lazy_replication_devices", "xla_replication_devices"),
        ("parse_lazy_device", "parse_xla_device"),
        ("ToLazyTensorArena", "ToXlaTensorArena"),
        ("mark_step", "mark_step"),
        ("save", "save"),
        ("get_ordinal", "get_ordinal"),
        ("optimizer_step", "optimizer_step"),
        ("add_step_closure", "add_step_closure"),
        ("send_cpu_data_to_device", "send_cpu_data_to_device"),
        ("RateTracker", "RateTracker"),
        ("all_reduce", "all_reduce"),
        ("mesh_reduce", "mesh_reduce"),
    ],
)
def test_old_name_is_the_xla_model_function(old, new):
    assert getattr(ltm, old) is getattr(xm, new)
