"""Training under launch: the data each replica sees, and the seed guide's distributed MNIST
against an eager-CPU simulation of 8 replicas averaging their gradients."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn as nn

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.runtime as xr
from tests.helpers import assert_close, load_example, run_example, tolerance

WORLD = 8


mnist_mp = load_example("mnist_mp")


def _epoch_of_ids(index, dataset):
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=True, seed=3
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)
    seen = [ids for (ids,) in pl.MpDeviceLoader(loader, xm.xla_device())]
    return torch.cat([ids.cpu() for ids in seen]).tolist()


def test_distributed_sampler_epoch_sees_each_sample_once():
    dataset = torch.utils.data.TensorDataset(torch.arange(1000))
    seen = spmd_torch.launch(_epoch_of_ids, args=(dataset,))
    everything = [i for ids in seen.values() for i in ids]
    assert sorted(everything) == list(range(1000))
    assert all(len(ids) == 125 for ids in seen.values())


class ReplicaShard(torch.utils.data.Sampler):
    """Replica k reads samples k, k + 8, ...: its ordinal is read when iteration starts, which
    MpDeviceLoader does on the replica's own thread."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        return iter(range(xr.global_ordinal(), self.size, xr.world_size()))

    def __len__(self):
        return self.size // WORLD


def _eager_reference(dataset, args, steps: int) -> np.ndarray:
    """[replica, step] losses of 8 simulated replicas: each its own batch, gradients averaged."""
    torch.manual_seed(args.seed)
    model = mnist_mp.MNISTNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=args.momentum)
    loss_fn = nn.NLLLoss()
    losses = np.zeros((WORLD, steps))
    for step in range(steps):
        grads = []
        for k in range(WORLD):
            ids = list(range(k, len(dataset), WORLD))[step * args.batch_size :][: args.batch_size]
            data, target = dataset.data[ids], dataset.targets[ids]
            model.zero_grad()
            loss = loss_fn(model(data), target)
            loss.backward()
            losses[k, step] = loss.item()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, replica_grads in zip(model.parameters(), zip(*grads)):
            p.grad = torch.stack(replica_grads).mean(0)
        optimizer.step()
    return losses


@pytest.mark.parametrize("workers", [0, 2])
def test_mnist_mp_losses_match_eager_replicas_averaging_gradients(workers):
    """With worker processes too (each replica's epoch forks its own): the same losses."""
    steps, args = 10, mnist_mp.Args()
    args.batch_size, args.log_interval = 16, 5
    dataset = mnist_mp.SyntheticMNIST(WORLD * steps * args.batch_size)
    args.train_loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=ReplicaShard(len(dataset)), num_workers=workers
    )
    before = met.counter_value("UncachedCompile") or 0
    losses = spmd_torch.launch(mnist_mp._mp_mnist_fn, args=(args,))
    compiles = (met.counter_value("UncachedCompile") or 0) - before
    got = np.array([losses[k] for k in range(WORLD)])
    want = _eager_reference(dataset, args, steps)
    # the losses are float32 results held as Python floats: float32's row
    assert_close(torch.from_numpy(got), torch.from_numpy(want), **tolerance(torch.float32))
    assert len(set(got[:, 0])) == WORLD  # the replicas really saw different data
    assert compiles <= 2, compiles  # step 1 (no momentum buffers yet), then every later step


@pytest.mark.multiprocess  # runs the example as a script
def test_mnist_mp_example_runs_with_two_compiles():
    output = run_example("mnist_mp.py", "--steps", "50", "--batch-size", "8")
    assert "compiles: 2\n" in output
    assert output.count("Starting training on CPU") == WORLD
    assert output.count("Loss:") == 5  # the master logs every 10th of 50 steps, once
    first, last = (float(x) for x in re.search(r"loss (\S+) -> (\S+)", output).groups())
    assert last < first - 0.3
