"""A small transformer-style model trained 5 steps under bfloat16 autocast with sync-free AdamW:
losses as eager CPU autocast training gives them, within bfloat16 tolerance, and no step reads
anything back from the device."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import spmd_torch
from spmd_torch.amp import autocast, syncfree
from tests.helpers import assert_close, assert_counter_delta, tolerance

_STEPS = 5


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(x)


def _loss(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_bf16_autocast_training_matches_eager_cpu_autocast():
    torch.manual_seed(0)
    cpu_model = _Model()
    xla_model = copy.deepcopy(cpu_model).to(spmd_torch.device())
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=3e-3, weight_decay=0.01)
    xla_opt = syncfree.AdamW(xla_model.parameters(), lr=3e-3, weight_decay=0.01)
    batches = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))] * _STEPS  # memorised
    device_batches = [(t.to(spmd_torch.device()), y.to(spmd_torch.device())) for t, y in batches]
    spmd_torch.sync()

    cpu_losses, xla_losses = [], []
    for (tokens, targets), (device_tokens, device_targets) in zip(batches, device_batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(cpu_model, tokens, targets)
        loss.backward()
        cpu_opt.step()
        cpu_opt.zero_grad()
        cpu_losses.append(loss.detach())

        with assert_counter_delta("TransferFromDevice", 0):
            with autocast(spmd_torch.device()):
                loss = _loss(xla_model, device_tokens, device_targets)
            loss.backward()
            xla_opt.step(found_inf=torch.zeros((), device=spmd_torch.device()))
            xla_opt.zero_grad()
            xla_losses.append(loss.detach())
            spmd_torch.sync()

    assert all(loss.dtype == torch.float32 for loss in xla_losses)  # cross_entropy: float32 row
    # bf16 results may round differently on the two sides (CPU's kernels, XLA's): bf16 tolerance.
    actual = torch.stack([loss.cpu() for loss in xla_losses])
    assert_close(actual, torch.stack(cpu_losses), **tolerance(torch.bfloat16))
    assert cpu_losses[-1] < cpu_losses[0] - 0.1
