"""F.ctc_loss forward and backward against eager PyTorch in float64 on the CPU: padded and
concatenated targets, repeated labels, an empty target, an impossible alignment with and without
zero_infinity, every reduction, lengths as lists and as device tensors; no CPU fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.debug.metrics as met
from tests.helpers import assert_close

dev = spmd_torch.device()
T, N, C = 12, 4, 6
INPUT_LENGTHS = [12, 9, 3, 1]
TARGET_LENGTHS = [4, 3, 3, 0]


def _targets(generator: torch.Generator) -> torch.Tensor:
    targets = torch.randint(1, C, (N, 5), generator=generator)
    targets[0, 1] = targets[0, 2]  # a repeated label needs a blank between: two frames
    targets[2, :3] = torch.tensor([2, 2, 2])  # needs 5 frames, has 3: impossible, loss inf
    return targets


@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("layout", ["padded", "concatenated"])
def test_ctc_loss_matches_eager(layout, reduction, zero_infinity):
    generator = torch.Generator().manual_seed(len(layout) + len(reduction) + zero_infinity)
    logits = torch.randn(T, N, C, generator=generator, dtype=torch.float64, requires_grad=True)
    padded = _targets(generator)
    targets = padded
    if layout == "concatenated":
        targets = torch.cat([padded[i, :n] for i, n in enumerate(TARGET_LENGTHS)])
    kwargs = dict(reduction=reduction, zero_infinity=zero_infinity)
    loss = F.ctc_loss(logits.log_softmax(2), targets, INPUT_LENGTHS, TARGET_LENGTHS, **kwargs)
    weights = torch.randn(loss.shape, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)

    met.clear_all()
    logits_d = logits.detach().float().to(dev).requires_grad_()
    lengths = [torch.tensor(INPUT_LENGTHS).to(dev), torch.tensor(TARGET_LENGTHS).to(dev)]
    if layout == "padded":
        lengths = [INPUT_LENGTHS, TARGET_LENGTHS]
    loss_d = F.ctc_loss(logits_d.log_softmax(2), targets.to(dev), *lengths, **kwargs)
    (grad_d,) = torch.autograd.grad((loss_d * weights.float().to(dev)).sum(), logits_d)
    assert_close(loss_d, loss.float(), rtol=1e-5, atol=1e-5)
    assert_close(grad_d, grad.float(), rtol=1e-5, atol=1e-5)
    assert met.executed_fallback_ops() == []


def test_ctc_backward_on_log_probs_is_atens():
    """Taken on the log-probabilities themselves, ATen's gradient is exp(log_probs) minus the
    posterior (the gradient through the log_softmax that makes them), not the plain derivative."""
    generator = torch.Generator().manual_seed(7)
    log_probs = torch.randn(T, N, C, generator=generator, dtype=torch.float64).log_softmax(2)
    log_probs.requires_grad_()
    targets = torch.randint(1, C, (N, 4), generator=generator)
    lengths = ([12, 9, 8, 2], [4, 3, 2, 1])
    (grad,) = torch.autograd.grad(
        F.ctc_loss(log_probs, targets, *lengths, reduction="sum"), log_probs
    )
    log_probs_d = log_probs.detach().float().to(dev).requires_grad_()
    loss_d = F.ctc_loss(log_probs_d, targets.to(dev), *lengths, reduction="sum")
    (grad_d,) = torch.autograd.grad(loss_d, log_probs_d)
    assert_close(grad_d, grad.float(), rtol=1e-5, atol=1e-5)
    assert grad[9:, 1].abs().max() == 0 and grad_d.cpu()[9:, 1].abs().max() == 0  # past its length
