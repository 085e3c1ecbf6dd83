"""The seed guide's single-device MNIST training loop, on synthetic MNIST-shaped data.

The only spmd_torch-specific lines are the device and the barrier (xm.mark_step); everything else is
plain PyTorch. Run: python examples/mnist.py
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met


class MNIST(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.bn1(x)
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = self.bn2(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, p=0.2, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_mnist(batches: int, batch_size: int):
    """MNIST-shaped batches made locally: a learnable signal (the label drawn into the image)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(batches):
        target = torch.randint(0, 10, (batch_size,), generator=generator)
        data = torch.randn(batch_size, 1, 28, 28, generator=generator) * 0.3
        data[torch.arange(batch_size), 0, target * 2 + 4, 4:24] += 2.0
        yield data, target


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(1)
    device = xm.xla_device()
    model = MNIST().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    loss_fn = nn.NLLLoss()

    model.train()
    for step, (data, target) in enumerate(synthetic_mnist(args.steps, args.batch_size)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = loss_fn(model(data), target)
        loss.backward()
        optimizer.step()
        xm.mark_step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    print(met.metrics_report())


if __name__ == "__main__":
    main()
