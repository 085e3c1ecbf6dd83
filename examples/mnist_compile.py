"""The MNIST loop with its training step under torch.compile: recorded once, then each step runs
without tracing its ops in Python. Same model and synthetic data as examples/mnist.py.

Run: python examples/mnist_compile.py (add --backend openxla under python -m
spmd_torch.run_as_torch_xla, where PyTorch's own openxla backend finds torch_xla)
"""

import argparse
import time

import torch
import torch.nn as nn
from mnist import MNIST, synthetic_mnist

import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--backend", default="spmd_torch")
    args = parser.parse_args()

    torch.manual_seed(1)
    device = xm.xla_device()
    model = MNIST().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    loss_fn = nn.NLLLoss()

    @torch.compile(backend=args.backend)
    def train_step(data, target):
        optimizer.zero_grad()
        loss = loss_fn(model(data), target)
        loss.backward()
        optimizer.step()
        return loss

    model.train()
    host = []
    for step, (data, target) in enumerate(synthetic_mnist(args.steps, args.batch_size)):
        start = time.perf_counter()
        loss = train_step(data.to(device), target.to(device))  # no mark_step: the next call runs it
        host.append(time.perf_counter() - start)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    host_ms = sorted(host[3:])[len(host[3:]) // 2] * 1e3
    print(f"{met.metric_data('CompileTime')[0]} compilations; {host_ms:.1f} ms host per step")


if __name__ == "__main__":
    main()
