"""A Megatron-style MLP on a 2-D (data, model) mesh: data parallel x tensor parallel, by annotation.

The first Linear is split by columns (its output features) over 'model', the second by rows (its
input features), so the hidden activation never needs gathering: each model shard computes a
slice of it, and GSPMD inserts one all-reduce after the second matmul. The batch is split over
'data'. Every step's loss is checked against the same model trained on eager CPU; the script
exits non-zero on a mismatch beyond 1e-4 relative, or if the loop compiles more than twice.

Run: python examples/spmd_2d.py [--data 2 --model 4]   (on CPU it sets up 8 virtual devices)
"""

from __future__ import annotations

import os

if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and (
    "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import spmd_torch.core.xla_model as xm  # noqa: E402
import spmd_torch.debug.metrics as met  # noqa: E402
import spmd_torch.distributed.spmd as xs  # noqa: E402
import spmd_torch.runtime as xr  # noqa: E402


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def shard_megatron(mlp: MLP, mesh: xs.Mesh) -> None:
    """Column-parallel ``up``, row-parallel ``down``; nn.Linear weights are [out, in]."""
    xs.mark_sharding(mlp.up.weight, mesh, ("model", None))
    xs.mark_sharding(mlp.up.bias, mesh, ("model",))
    xs.mark_sharding(mlp.down.weight, mesh, (None, "model"))
    xs.mark_sharding(mlp.down.bias, mesh, (None,))  # added after the all-reduce: replicated


def regression_batches(steps: int, batch_size: int, dim: int):
    """(x, y) pairs with y a fixed smooth function of x, so the loss can fall."""
    generator = torch.Generator().manual_seed(0)
    mix = torch.randn(dim, dim, generator=generator) / dim**0.5
    for _ in range(steps):
        x = torch.randn(batch_size, dim, generator=generator)
        yield x, torch.tanh(x @ mix)


def train(model: MLP, device: torch.device, args, mesh: xs.Mesh | None = None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for x, y in regression_batches(args.steps, args.batch_size, args.dim):
        x, y = x.to(device), y.to(device)
        if mesh is not None:
            xs.mark_sharding(x, mesh, ("data", None))
            xs.mark_sharding(y, mesh, ("data", None))
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if mesh is not None:
            xm.mark_step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=int, default=2, help="size of the 'data' mesh axis")
    parser.add_argument("--model", type=int, default=4, help="size of the 'model' mesh axis")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(args.data * args.model), (args.data, args.model), ("data", "model"))
    device = xm.xla_device()

    torch.manual_seed(0)
    reference = MLP(args.dim, args.hidden)
    model = copy.deepcopy(reference).to(device)
    shard_megatron(model, mesh)
    print(f"mesh {dict(mesh.shape())}")
    for name, param in model.named_parameters():
        print(f"  {name:12s} {tuple(param.shape)!s:10s} {xs.get_xla_sharding_spec(param)}")
    print("up.weight: row blocks over 'model', each replicated over 'data':")
    xs.visualize_tensor_sharding(model.up.weight)

    met.clear_all()
    actual = train(model, device, args, mesh)
    compiles = met.counter_value("UncachedCompile") or 0
    expected = train(reference, torch.device("cpu"), args)

    failures = []
    for step, (a, e) in enumerate(zip(actual, expected)):
        error = abs(a - e) / abs(e)
        flag = "" if error <= 1e-4 else "  MISMATCH"
        print(f"step {step:3d}  loss {a:.6f}  eager cpu {e:.6f}  rel err {error:.1e}{flag}")
        if flag:
            failures.append(f"step {step}: loss {a} on the mesh, {e} on eager CPU")
    for name, param in model.named_parameters():
        print(f"  {name:12s} after training {xs.get_xla_sharding_spec(param)}")
    print(met.metrics_report(), end="")

    if compiles > 2:
        failures.append(f"{compiles} compilations, expected at most 2")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
