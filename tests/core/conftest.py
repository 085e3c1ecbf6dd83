"""Fixtures of the core tests."""

from __future__ import annotations

import copy

import pytest

import spmd_torch
from spmd_torch._lazy import counters


@pytest.fixture
def isolated_metrics():
    """The test may clear or fill the metrics store: it gets a copy, the original comes back."""
    saved_counters, saved_ops = dict(counters.COUNTERS), dict(counters.OPS)
    saved_metrics = copy.deepcopy(dict(counters.METRICS))
    yield
    spmd_torch.sync()
    counters.clear()
    counters.COUNTERS.update(saved_counters)
    counters.OPS.update(saved_ops)
    counters.METRICS.update(saved_metrics)
