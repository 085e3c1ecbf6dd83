"""Lightning's own XLA accelerator and single-device XLA strategy fitting a LightningModule.

Lightning offers its XLA accelerator only where ``torch_xla._internal.tpu`` counts TPU devices;
off TPU a subclass that says it is available (what a user running Lightning's XLA path on a GPU
would write) lets the same path run here on JAX's CPU devices."""

from __future__ import annotations

import lightning as L
import torch
from _common import captured, compiles, report
from torch import nn


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses = []
        self.compiles_per_epoch = []

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        self.losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        self.compiles_per_epoch.append(compiles())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def accelerator() -> dict:
    try:
        import torch_xla.runtime as xr
    except ImportError:
        return {"accelerator": "cpu", "devices": 1}
    from lightning.pytorch.accelerators import XLAAccelerator

    class AnyXLAAccelerator(XLAAccelerator):
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def auto_device_count() -> int:
            return xr.addressable_runtime_device_count()

    return {"accelerator": AnyXLAAccelerator(), "devices": 1}


def main() -> None:
    L.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    )
    model = Net()
    trainer = L.Trainer(
        max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **accelerator(),
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
    report(
        device=str(trainer.strategy.root_device),
        strategy=type(trainer.strategy).__name__,
        losses=[float(loss) for loss in model.losses],
        weight=model.net[0].weight.detach().cpu().tolist(),
        compiles_per_epoch=model.compiles_per_epoch,
        captured=captured(),
    )


main()
