"""xf.SyncBatchNorm: under launch each replica's output and gradients equal eager BatchNorm over
the concatenated global batch; outside launch it is plain BatchNorm; running statistics follow
BatchNorm's; bad input is named."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
import spmd_torch.core.functions as xf
import spmd_torch.core.xla_model as xm
from tests.helpers import assert_close

WORLD = 8
CHANNELS = 3


def local_batch(index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + index)
    return torch.randn(2, CHANNELS, 4, generator=generator) * (index + 1) + index


def affine() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([1.5, -0.5, 2.0]), torch.tensor([0.1, 0.2, -0.3])


def loss_weights(index: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 2 * CHANNELS * 4).reshape(2, CHANNELS, 4) * (index + 1)


def eager_reference():
    """BatchNorm over all replicas' batches together; the loss is the sum of theirs."""
    norm = torch.nn.BatchNorm1d(CHANNELS)
    weight, bias = affine()
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
    batch = torch.cat([local_batch(k) for k in range(WORLD)]).requires_grad_()
    out = norm(batch)
    (out * torch.cat([loss_weights(k) for k in range(WORLD)])).sum().backward()
    return out.detach(), batch.grad, norm


def test_sync_batch_norm_under_launch_matches_batch_norm_over_the_global_batch():
    def body(index):
        device = xm.xla_device()
        norm = xf.SyncBatchNorm(CHANNELS).to(device)
        weight, bias = affine()
        with torch.no_grad():
            norm.weight.copy_(weight.to(device))
            norm.bias.copy_(bias.to(device))
        x = local_batch(index).to(device).requires_grad_()
        out = norm(x)
        (out * loss_weights(index).to(device)).sum().backward()
        grads = [norm.weight.grad, norm.bias.grad]
        xm.all_reduce(xm.REDUCE_SUM, grads)  # each replica holds its loss's share
        xm.mark_step()
        return [
            t.detach().cpu() for t in (out, x.grad, *grads, norm.running_mean, norm.running_var)
        ]

    results = spmd_torch.launch(body)
    out, grad, norm = eager_reference()
    for index, (y, gx, gw, gb, mean, var) in results.items():
        rows = slice(2 * index, 2 * index + 2)
        assert_close((y, mean, var), (out[rows], norm.running_mean, norm.running_var))
        expected_grads = (grad[rows], norm.weight.grad, norm.bias.grad)
        assert_close((gx, gw, gb), expected_grads, kind="grad")


def test_sync_batch_norm_in_one_program_is_batch_norm():
    device = xm.xla_device()
    batch = torch.cat([local_batch(k) for k in range(WORLD)]).unsqueeze(-1)  # 4 dimensions
    eager = torch.nn.BatchNorm2d(CHANNELS)
    norm = xf.SyncBatchNorm(CHANNELS).to(device)
    x = batch.clone().requires_grad_()
    xd = batch.to(device).requires_grad_()
    eager(x).square().sum().backward()
    norm(xd).square().sum().backward()
    xm.mark_step()
    assert_close((xd.grad, norm.weight.grad), (x.grad, eager.weight.grad), kind="grad")
    assert_close(norm.running_var, eager.running_var)
    norm.eval()
    eager.eval()
    assert_close(norm(batch.to(device)), eager(batch))


def test_sync_batch_norm_names_a_wrong_input():
    norm = xf.SyncBatchNorm(CHANNELS)
    with pytest.raises(ValueError, match=r"with 3 channels in dimension 1, got shape \(2, 4\)"):
        norm(torch.ones(2, 4))
