"""The seed guide's distributed MNIST (``_mp_mnist_fn`` under ``torch_xla.launch``), on synthetic
MNIST-shaped data.

Unchanged from the guide except the imports (``torch_xla`` -> ``spmd_torch``) and the dataset (made
locally: a learnable signal drawn into each image). Every local device runs
one replica; ``xm.optimizer_step`` averages the gradients over them, and all replicas' steps run as
one program, compiled once. Run: python examples/mnist_mp.py
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

# PyTorch/XLA specific imports
import spmd_torch as torch_xla
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.runtime as xr


class MNISTNet(nn.Module):
    def __init__(self):
        super(MNISTNet, self).__init__()  # noqa: UP008  (as the seed guide writes it)
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=1, padding=1)
        self.fc1 = nn.Linear(7 * 7 * 64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 7 * 7 * 64)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


class SyntheticMNIST(torch.utils.data.Dataset):
    """MNIST-shaped samples: noise plus a bar whose row encodes the label."""

    def __init__(self, size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, 10, (size,), generator=generator)
        self.data = torch.randn(size, 1, 28, 28, generator=generator) * 0.3
        self.data[torch.arange(size), 0, self.targets * 2 + 4, 4:24] += 2.0

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.data[index], self.targets[index]


def _mp_mnist_fn(index, args):
    torch.manual_seed(args.seed)  # the same initial model on every replica

    device = xm.xla_device()
    model = MNISTNet().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.learning_rate, momentum=args.momentum)
    loss_fn = nn.NLLLoss()
    mp_train_loader = pl.MpDeviceLoader(args.train_loader, device)

    print(
        f"Process {index} (Global Ordinal {xr.global_ordinal()}): "
        f"Starting training on {xm.xla_device_hw(device)}..."
    )
    losses = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(mp_train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)  # averages the gradients over the replicas
            losses.append(loss)

            if batch_idx % args.log_interval == 0:
                if xm.is_master_ordinal(local=False):
                    print(
                        f"Process {index} - Train Epoch: {epoch} "
                        f"[{batch_idx * len(data) * xr.world_size()}/"
                        f"{len(args.train_loader.dataset)} "
                        f"({100.0 * batch_idx / len(args.train_loader):.0f}%)]\tLoss: "
                        f"{loss.item():.6f}"
                    )

    if xm.is_master_ordinal(local=False):
        print(f"Process {index}: Training finished!")
    return [loss.item() for loss in losses]


class Args:
    epochs = 1
    learning_rate = 0.01
    momentum = 0.5
    batch_size = 64  # the per-device batch size
    seed = 42
    log_interval = 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50, help="batches per replica")
    parser.add_argument("--batch-size", type=int, default=Args.batch_size)
    cli = parser.parse_args()

    args = Args()
    args.batch_size = cli.batch_size
    train_dataset = SyntheticMNIST(cli.steps * args.batch_size)
    args.train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=1,  # Can be > 0
    )

    print("Launching distributed MNIST training...")
    losses = torch_xla.launch(_mp_mnist_fn, args=(args,))  # this host's replicas' results
    ordinal = min(losses)
    first, last = losses[ordinal][0], losses[ordinal][-1]
    print(f"replica {ordinal} loss {first:.4f} -> {last:.4f} over {len(losses[ordinal])} steps")
    print(f"compiles: {met.counter_value('UncachedCompile')}")


if __name__ == "__main__":
    main()
