"""A small GPT trained with fully sharded data parallelism (FSDP) on an 8-device mesh.

SpmdFullyShardedDataParallel shards every parameter along the mesh's 'fsdp' axis and each block's
output along the batch; GSPMD then gathers weights where they are used and reduce-scatters their
gradients. MpDeviceLoader uploads each batch sharded on dim 0 over 'fsdp' too. A training step is
one program: the first step and the steady state (once AdamW has its state) compile, nothing else
does.

Data is synthetic: each sequence counts up by a stride of its own, modulo the vocabulary, so the
next token follows from the previous two and the loss falls fast. Exits non-zero if the loss does
not fall or the loop compiles more than twice.

Run: python examples/spmd_fsdp.py   (on CPU it sets up 8 virtual devices itself)
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
import functools  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import spmd_torch.core.xla_model as xm  # noqa: E402
import spmd_torch.debug.metrics as met  # noqa: E402
import spmd_torch.distributed.parallel_loader as pl  # noqa: E402
import spmd_torch.distributed.spmd as xs  # noqa: E402
import spmd_torch.runtime as xr  # noqa: E402
from spmd_torch.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, seq_len)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm decoder blocks, a head tied to the embedding."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq_len: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, seq_len) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def counting_sequences(count: int, seq_len: int, vocab: int) -> TensorDataset:
    """(input, target) token sequences: start + stride * i (mod vocab), targets shifted by one."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    stride = torch.randint(1, 8, (count, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    device = xm.xla_device()

    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, heads=4, layers=args.layers, seq_len=args.seq_len)
    # Each Block is wrapped (its parameters and its output sharded); the root shards the rest.
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    print(f"mesh {dict(mesh.shape())}, {sum(p.numel() for p in model.parameters())} parameters")
    # Each parameter is split over 'fsdp' along its largest dimension (the first of equals).
    gpt = model.module
    shown = {
        "tok_emb.weight (= head.weight)": gpt.tok_emb.weight,
        "pos_emb.weight": gpt.pos_emb.weight,
        "blocks.0.attn.qkv.weight": gpt.blocks[0].attn.qkv.weight,
        "blocks.0.mlp.2.weight": gpt.blocks[0].mlp[2].weight,
        "blocks.0.ln1.bias": gpt.blocks[0].ln1.bias,
    }
    for name, param in shown.items():
        print(f"  {name:32s} {tuple(param.shape)!s:10s} {xs.get_xla_sharding_spec(param)}")

    met.clear_all()
    losses = []
    start = time.perf_counter()
    dataset = counting_sequences(args.steps * args.batch_size, args.seq_len, args.vocab)
    loader = DataLoader(dataset, batch_size=args.batch_size, drop_last=True)
    # Batches are uploaded in the background, each device receiving only its rows.
    input_sharding = xs.ShardingSpec(mesh, ("fsdp", None))
    device_loader = pl.MpDeviceLoader(loader, device, input_sharding=input_sharding)
    for step, (tokens, targets) in enumerate(device_loader):
        optimizer.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        xm.mark_step()  # MpDeviceLoader would issue it at the next batch; loss.item() needs it now
        losses.append(loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - start
    compiles = met.counter_value("UncachedCompile") or 0
    print(f"{args.steps} steps in {elapsed:.1f}s, compilations {compiles}")

    print(f"batch tokens {tuple(tokens.shape)}: {xs.get_xla_sharding_spec(tokens)}")
    weight = gpt.blocks[0].mlp[0].weight
    print(f"blocks.0.mlp.0.weight {tuple(weight.shape)} after training, rows split over 'fsdp':")
    xs.visualize_tensor_sharding(weight)
    print(met.metrics_report(), end="")

    failures = []
    if not losses[-1] < losses[0]:
        failures.append(f"the loss did not decrease: {losses[0]:.4f} -> {losses[-1]:.4f}")
    if compiles > 1:  # AdamW's moments are filled on the host: every step runs one program
        failures.append(f"{compiles} compilations, expected 1")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
