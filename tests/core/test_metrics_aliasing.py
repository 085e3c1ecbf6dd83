"""``InputOutputAliasCount``: one sample per compiled program, the number of its input buffers
donated to its outputs (PyTorch/XLA records its buffer donors so)."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
import spmd_torch.debug.metrics as met
from spmd_torch._lazy.execute import global_array

dev = spmd_torch.device()

pytestmark = pytest.mark.usefixtures("isolated_metrics")  # tests here clear the store


def _samples(name: str) -> list[float]:
    data = met.metric_data(name)
    return [] if data is None else [value for _, value in data[2]]


def test_alias_count_is_the_donated_buffers_of_each_compiled_program():
    p, q, x = (torch.randn(13, 7).to(dev) for _ in range(3))  # a shape no other test compiles
    spmd_torch.sync()
    met.clear_all()

    def step():
        p.mul_(0.5)  # p and q are overwritten: their old buffers can be donated
        q.add_(x)  # x is still held and read: kept
        spmd_torch.sync()

    before = [global_array(t) for t in (p, q, x)]
    step()
    assert [a.is_deleted() for a in before] == [True, True, False]  # the independent count
    assert _samples("InputOutputAliasCount") == [2.0]
    assert met.counter_value("CreateCompileHandles") == 1
    step()  # the same program from the cache: nothing compiled, nothing recorded
    assert _samples("InputOutputAliasCount") == [2.0]
    assert "InputOutputAliasCount" in met.short_metrics_report(
        metric_names=["InputOutputAliasCount"]
    )
