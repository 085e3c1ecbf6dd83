"""huggingface_hub's save_pretrained of a model whose weights are on the device (tied weights, a
pending in-place update), loaded back with from_pretrained."""

from __future__ import annotations

import tempfile

import torch
from _common import report
from huggingface_hub import PyTorchModelHubMixin
from torch import nn


class Tiny(nn.Module, PyTorchModelHubMixin):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.head = nn.Linear(width, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def main() -> None:
    torch.manual_seed(0)
    model = Tiny(width=4)
    try:
        import torch_xla

        model.to(torch_xla.device())
    except ImportError:
        pass
    with torch.no_grad():
        model.embed.weight.mul_(2)  # pending on the device: saving computes it
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = Tiny.from_pretrained(directory)
    report(
        device=str(model.embed.weight.device),
        weight=loaded.embed.weight.tolist(),
        out=loaded(torch.arange(3)).tolist(),
        config=loaded._hub_mixin_config,
    )


main()
