"""Profile the MNIST training loop of examples/mnist.py: a capture TensorBoard and Perfetto open.

Each step is an ``xp.StepTrace`` (which also issues the step's barrier, so the loader does not),
and the forward and backward passes are ``xp.Trace`` regions, which also name the ops of the
compiled program. The capture covers steps after the first, so the compilation stays out of it.

    python examples/profile_mnist.py --logdir /tmp/profile            # in-process capture
    python examples/profile_mnist.py --logdir /tmp/profile --server   # through a profiler server
    tensorboard --logdir /tmp/profile   # Profile tab (needs tensorboard-plugin-profile)
    # or open plugins/profile/<run>/*.trace.json.gz at https://ui.perfetto.dev

At the end the script reads the capture back and prints what it holds.
"""

import argparse
import collections
import pathlib
import socket
import tempfile

import jax
import torch
import torch.nn as nn
from mnist import MNIST, synthetic_mnist

import spmd_torch.core.xla_model as xm
import spmd_torch.debug.profiler as xp
import spmd_torch.distributed.parallel_loader as pl


def train(model, optimizer, loader, first_step: int) -> float:
    """One pass over ``loader``: each step a StepTrace with 'forward' and 'backward' regions."""
    loss_fn = nn.NLLLoss()
    for step, (data, target) in enumerate(loader, start=first_step):
        with xp.StepTrace("train_step", step_num=step):
            optimizer.zero_grad()
            with xp.Trace("forward"):
                loss = loss_fn(model(data), target)
            with xp.Trace("backward"):
                loss.backward()
            optimizer.step()
    return loss.item()


def summary(logdir: pathlib.Path) -> None:
    """What the capture holds: host regions and the device programs that ran."""
    [xplane] = logdir.glob("plugins/profile/*/*.xplane.pb")
    regions, programs = collections.Counter(), collections.defaultdict(set)
    for plane in jax.profiler.ProfileData.from_file(str(xplane)).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if event.name in ("train_step", "forward", "backward"):
                    regions[event.name] += 1
                if "hlo_module" in stats and "run_id" in stats:
                    programs[stats["hlo_module"]].add(stats["run_id"])
    print(f"capture: {xplane}")
    for name, count in sorted(regions.items()):
        print(f"  host region {name}: {count}")
    for module, runs in sorted(programs.items()):
        print(f"  device program {module}: {len(runs)} runs")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="steps captured (after 2 unprofiled)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--logdir", default=None, help="default: a new temporary directory")
    parser.add_argument("--server", action="store_true", help="capture through start_server")
    args = parser.parse_args()
    logdir = pathlib.Path(args.logdir or tempfile.mkdtemp(prefix="profile_mnist_"))

    torch.manual_seed(1)
    device = xm.xla_device()
    model = MNIST().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    model.train()
    batches = list(synthetic_mnist(2 + args.steps, args.batch_size))
    warmup, profiled = batches[:2], batches[2:]

    loss = train(model, optimizer, pl.MpDeviceLoader(warmup, device), first_step=0)
    print(f"compiled; loss {loss:.4f}")
    if args.server:
        with socket.socket() as probe:  # a free port for the server
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = xp.start_server(port)
        capture = xp.trace_detached(f"localhost:{port}", logdir, duration_ms=2000)
        step = 2
        while capture.is_alive():  # keep training while the server captures
            loss = train(model, optimizer, pl.MpDeviceLoader(profiled, device), first_step=step)
            step += len(profiled)
        capture.join()
        server.stop()
    else:
        xp.start_trace(logdir)
        loss = train(model, optimizer, pl.MpDeviceLoader(profiled, device), first_step=2)
        xp.stop_trace()
    print(f"profiled; loss {loss:.4f}")
    summary(logdir)


if __name__ == "__main__":
    main()
