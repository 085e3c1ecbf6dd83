"""accelerate's training loop as its users write it: Accelerator(), prepare, backward, gather,
save_state/load_state. With torch_xla visible accelerate picks the xla device by itself."""

from __future__ import annotations

import tempfile

import torch
from _common import captured, compiles, report
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn


def main() -> None:
    accelerator = Accelerator()
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, compiles_per_epoch = [], []
    for _ in range(3):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
        compiles_per_epoch.append(compiles())
    trained = [p.detach().cpu().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as directory:
        accelerator.save_state(directory)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        accelerator.load_state(directory)
    restored = all(torch.equal(a, p.detach().cpu()) for a, p in zip(trained, model.parameters()))
    report(
        device=str(accelerator.device),
        distributed_type=str(accelerator.distributed_type),
        losses=losses,
        restored=restored,
        compiles_per_epoch=compiles_per_epoch,
        captured=captured(),
    )


main()
