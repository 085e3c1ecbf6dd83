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


def test_each_overwritten_tensor_keeps_its_own_buffer():
    """A new value takes over the buffer of the value it replaces, not another input's of its
    shape: here ``m``'s new value reads ``p`` first, as AdamW's moments read the parameters."""
    p, m = (torch.randn(11, 5).to(dev) for _ in range(2))

    def step() -> list[int]:
        m.copy_(p * 0.1 + m * 0.9)
        p.sub_(m)
        spmd_torch.sync()
        return [global_array(t).unsafe_buffer_pointer() for t in (p, m)]

    buffers = step()  # uploads, not yet program outputs
    assert step() == buffers  # the program's first run
    assert step() == buffers  # and from the cache


def test_an_adamw_step_writes_parameters_and_moments_in_place():
    """From the first step on (whose moments begin as fills computed before it), every
    parameter and moment stays in its own buffer."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(4, 6).to(dev)

    def step() -> list[int]:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        spmd_torch.sync()
        state = [
            optimizer.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")
        ]
        return [global_array(t).unsafe_buffer_pointer() for t in [*model.parameters(), *state]]

    buffers = step()
    assert step() == buffers
    assert step() == buffers
