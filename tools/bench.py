"""Benchmarks spmd_torch against eager PyTorch and hand-written JAX on the same math.

Workloads:
  W1  tracing overhead: 2000 cheap elementwise ops on a 256x256 tensor, host µs per op.
  W2  MLP 784-1024-1024-10 (ReLU), batch 256, cross-entropy, SGD lr 0.01 momentum 0.9.
  W3  GPT decoder, 4 layers, d_model 256, 4 heads, seq 128, batch 8, vocab 1024, AdamW.
  W4  FSDP: the W3 GPT at batch 16, AdamW, every 2-D param and the batch sharded on dim 0 over
      an 8-device mesh with axis 'fsdp' (8 virtual CPU devices; --gpu: min(8, GPUs)), the rest
      replicated. Implementations jax and spmd_torch only; also reports param bytes per device.
  W2mp  W2's MLP data parallel over 8 devices (8 virtual CPU devices; --gpu: every local GPU), two
      ways: ``mp``, a per-device multiprocessing script (``spmd_torch.launch``, batch 32 per
      replica, ``xm.optimizer_step`` all-reducing the gradients) against ``spmd_torch``, one SPMD
      program (global batch 32 x devices sharded over a 1-D 'data' mesh). Batches are uploaded
      once before the loop with .to(device), as in W2 (no MpDeviceLoader). Steps/s is the median
      of timed windows of pipelined steps; then one window of blocked steps with probes patched
      in breaks the host time per step down (mp: tracing of each replica, turn hand-offs, the
      merged run's assembly and call). Compiles count UncachedCompile.
  W3amp  W3 under bfloat16 autocast: eager ``torch.autocast('cpu', torch.bfloat16)`` with
      torch.optim.AdamW against spmd_torch's ``spmd_torch.amp.autocast`` with
      ``spmd_torch.amp.syncfree.AdamW`` (same hyperparameters). spmd_torch also reports the
      device-to-host transfers counted inside its steps (TransferFromDevice; 0 expected);
      ``--check`` compares losses to bfloat16 tolerance.
  W5  checkpoints: W4's model and AdamW state after 2 steps (8-device 'fsdp' mesh), saved and
      restored by spmd_torch.experimental.distributed_checkpoint against orbax used directly on
      the same jax arrays (PyTreeCheckpointHandler, compression off), alternated rep by rep in one
      process: save, save_async (the time it blocks the loop, and until written), restore onto the
      same layout and onto a (4,2) mesh; seconds, MB/s, bytes on disk, and the peak growth of the
      process's RSS during each (sampled every ms) against the state's bytes.

Each (workload, implementation) pair runs in its own subprocess (``--only W3:jax``), so compile
caches, thread pools and device peak memory never leak from one run into the next. The parent
collects one ``BENCH_RESULT {...}`` line from each child, prints a table per workload and ends
with one ``BENCH_JSON {...}`` line for docs/performance.md.

Usage:
  python3 tools/bench.py                          # all workloads, all implementations, CPU
  python3 tools/bench.py --workloads W2 --steps 50
  python3 tools/bench.py --impls eager,jax        # skip spmd_torch
  python3 tools/bench.py --check                  # 3 steps each from one init: loss differences
  python3 tools/bench.py --gpu                    # spmd_torch and JAX on CUDA (and eager if it can)
  python3 tools/bench.py --workloads W4 --impls jax
  python3 tools/bench.py --workloads W2mp --rounds 3  # mp and SPMD, alternated 3 times
  python3 tools/bench.py --workloads W5               # checkpoints vs orbax directly
  python3 tools/bench.py --only W2:jax            # one run in this process (what the parent runs)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

WORKLOADS = ("W1", "W2", "W3", "W3amp", "W4", "W2mp", "W5")
IMPLS = ("eager", "jax", "spmd_torch", "mp")
# The implementations of each workload (default: eager, jax, spmd_torch). W4 is about sharding,
# which eager PyTorch has no say in; W2mp sets spmd_torch's two ways of data parallelism apart.
WORKLOAD_IMPLS = {
    "W3amp": ("eager", "spmd_torch"),
    "W4": ("jax", "spmd_torch"),
    "W2mp": ("mp", "spmd_torch"),
    "W5": ("spmd_torch",),
}
_DEFAULT_IMPLS = ("eager", "jax", "spmd_torch")
_IMPL_ALIASES = {
    "eager": "eager",
    "torch": "eager",
    "jax": "jax",
    "spmd": "spmd_torch",
    "spmd_torch": "spmd_torch",
    "mp": "mp",
}
# Workloads whose CPU runs need FSDP.mesh_devices virtual devices.
_MESH_WORKLOADS = ("W4", "W2mp", "W5")
# (warm-up, timed) steps per workload; W1 counts repetitions of the whole 2000-op chain.
DEFAULT_STEPS = {
    "W1": (2, 10),
    "W2": (5, 20),
    "W3": (3, 10),
    "W3amp": (3, 10),
    "W4": (3, 10),
    "W2mp": (5, 50),
    "W5": (1, 5),
}
CHECK_STEPS = 3
# Losses of the three implementations must agree to this relative tolerance under --check.
CHECK_RTOL = 1e-4
# bfloat16 workloads: one bf16 ulp (2**-8 to 2**-7 of a value) between two implementations' roundings.
CHECK_RTOL_OF = {"W3amp": 8e-3}
RESULT_TAG = "BENCH_RESULT "
SUMMARY_TAG = "BENCH_JSON "


# ------------------------------------------------------------------------------------------------
# Configuration shared by all three implementations


@dataclass(frozen=True)
class ChainConfig:
    n_ops: int = 2000
    size: int = 256


@dataclass(frozen=True)
class MLPConfig:
    sizes: tuple[int, ...] = (784, 1024, 1024, 10)
    batch: int = 256
    lr: float = 0.01
    momentum: float = 0.9


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    vocab: int = 1024
    seq: int = 128
    batch: int = 8
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    ln_eps: float = 1e-5


@dataclass(frozen=True)
class FSDPConfig:
    mesh_devices: int = 8  # on CPU, virtual host devices forced in the child's XLA_FLAGS
    axis: str = "fsdp"


CHAIN = ChainConfig()
MLP_CFG = MLPConfig()
GPT_CFG = GPTConfig()
# W4 trains the W3 model; only the batch grows, so it splits evenly over the mesh.
GPT_W4_CFG = dataclasses.replace(GPT_CFG, batch=16)
FSDP = FSDPConfig()

# The W1 chain. Each op is written with Python operators so the same lambdas build torch eager
# ops, lazy spmd_torch nodes and traced jnp ops. x -> ((x + y) * 0.5 - y + 1) * w contracts, so
# 2000 ops stay finite. Scalar operands are constant across repetitions: one graph key.
_CHAIN_OPS: tuple[Callable[[Any, Any, Any], Any], ...] = (
    lambda x, y, w: x + y,  # add, tensor operand
    lambda x, y, w: x * 0.5,  # mul, scalar operand
    lambda x, y, w: x - y,  # sub, tensor operand
    lambda x, y, w: x + 1.0,  # add, scalar operand
    lambda x, y, w: x * w,  # mul, tensor operand
)


def _chain(x: Any, y: Any, w: Any, n_ops: int) -> Any:
    """Applies the W1 op chain; shared by every implementation."""
    for i in range(n_ops):
        x = _CHAIN_OPS[i % len(_CHAIN_OPS)](x, y, w)
    return x


def _chain_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    shape = (CHAIN.size, CHAIN.size)
    x = rng.randn(*shape).astype(np.float32)
    y = rng.randn(*shape).astype(np.float32)
    w = (1.0 + 0.01 * rng.randn(*shape)).astype(np.float32)
    return x, y, w


def _mlp_data(batch: int = MLP_CFG.batch) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1)
    x = rng.randn(batch, MLP_CFG.sizes[0]).astype(np.float32)
    y = rng.randint(0, MLP_CFG.sizes[-1], size=(batch,)).astype(np.int64)
    return x, y


def _gpt_data(cfg: GPTConfig = GPT_CFG) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(2)
    tokens = rng.randint(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1)).astype(np.int64)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


# ------------------------------------------------------------------------------------------------
# PyTorch models: used as-is by eager and spmd_torch; their initial weights seed the JAX params.


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig = MLP_CFG) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.sizes[0], cfg.sizes[1])
        self.fc2 = nn.Linear(cfg.sizes[1], cfg.sizes[2])
        self.fc3 = nn.Linear(cfg.sizes[2], cfg.sizes[3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPT_CFG) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _new_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


def _new_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


def _mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _gpt_loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _new_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=MLP_CFG.lr, momentum=MLP_CFG.momentum)


def _new_adamw(model: nn.Module) -> torch.optim.Optimizer:
    c = GPT_CFG
    return torch.optim.AdamW(
        model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
    )


# ------------------------------------------------------------------------------------------------
# JAX: the same math by hand. Params are a dict keyed by the torch parameter names.


def _jax_params(model: nn.Module) -> dict[str, Any]:
    """Copies the torch initial weights, so all three implementations start from one point."""
    import jax.numpy as jnp

    return {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in model.named_parameters()}


def _jax_linear(p: dict[str, Any], name: str, x: Any) -> Any:
    y = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def _jax_layer_norm(p: dict[str, Any], name: str, x: Any, eps: float) -> Any:
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]


def _jax_cross_entropy(logits: Any, targets: Any) -> Any:
    """Mean of logsumexp(logits) - logits[target], like F.cross_entropy."""
    import jax
    import jax.numpy as jnp

    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def _jax_mlp_loss(p: dict[str, Any], x: Any, y: Any) -> Any:
    import jax

    h = jax.nn.relu(_jax_linear(p, "fc1", x))
    h = jax.nn.relu(_jax_linear(p, "fc2", h))
    return _jax_cross_entropy(_jax_linear(p, "fc3", h), y)


def _jax_attention(p: dict[str, Any], name: str, x: Any, heads: int) -> Any:
    import jax
    import jax.numpy as jnp

    b, t, c = x.shape
    hd = c // heads
    q, k, v = jnp.split(_jax_linear(p, f"{name}.qkv", x), 3, axis=2)
    q, k, v = (a.reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
    att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
    return _jax_linear(p, f"{name}.proj", y)


def _jax_gpt_loss(p: dict[str, Any], idx: Any, tgt: Any) -> Any:
    import jax

    c = GPT_CFG
    t = idx.shape[1]
    x = p["wte.weight"][idx] + p["wpe.weight"][:t]
    for i in range(c.layers):
        pre = f"blocks.{i}"
        x = x + _jax_attention(
            p, f"{pre}.attn", _jax_layer_norm(p, f"{pre}.ln1", x, c.ln_eps), c.heads
        )
        h = _jax_linear(p, f"{pre}.fc1", _jax_layer_norm(p, f"{pre}.ln2", x, c.ln_eps))
        x = x + _jax_linear(p, f"{pre}.fc2", jax.nn.gelu(h, approximate=False))
    logits = _jax_linear(p, "head", _jax_layer_norm(p, "ln_f", x, c.ln_eps))
    return _jax_cross_entropy(logits.reshape(-1, c.vocab), tgt.reshape(-1))


def _jax_sgd_init(params: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.zeros_like, params)


def _jax_sgd_update(params: Any, grads: Any, bufs: Any) -> tuple[Any, Any]:
    """torch.optim.SGD, dampening 0, no Nesterov: buf = m*buf + g (buf starts as g), p -= lr*buf."""
    import jax

    c = MLP_CFG
    bufs = jax.tree.map(lambda b, g: c.momentum * b + g, bufs, grads)
    params = jax.tree.map(lambda p, b: p - c.lr * b, params, bufs)
    return params, bufs


def _jax_adamw_init(params: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"step": jnp.zeros((), jnp.float32), "m": zeros, "v": jax.tree.map(jnp.copy, zeros)}


def _jax_adamw_update(params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, Any]:
    """torch.optim.AdamW: decoupled decay p *= 1 - lr*wd, bias-corrected m / (sqrt(v_hat) + eps)."""
    import jax
    import jax.numpy as jnp

    c = GPT_CFG
    b1, b2 = c.betas
    step = state["step"] + 1.0
    step_size = c.lr / (1.0 - b1**step)
    bc2_sqrt = jnp.sqrt(1.0 - b2**step)
    m = jax.tree.map(lambda m, g: m + (1.0 - b1) * (g - m), state["m"], grads)  # torch lerp_
    v = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state["v"], grads)

    def update(p: Any, m: Any, v: Any) -> Any:
        p = p * (1.0 - c.lr * c.weight_decay)
        return p - step_size * (m / (jnp.sqrt(v) / bc2_sqrt + c.eps))

    return jax.tree.map(update, params, m, v), {"step": step, "m": m, "v": v}


def _jax_train_step(loss_fn: Callable, update_fn: Callable) -> Callable:
    """One jitted step; params and optimizer state are donated, as a real training loop would."""
    import jax

    def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        params, opt_state = update_fn(params, grads, opt_state)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------------------------------------------------------------------
# Shared timing


@dataclass
class Trainer:
    """What the shared timing loop needs from one implementation of W2 or W3."""

    step: Callable[[], Any]  # one full training step; returns a handle to the loss
    wait: Callable[[], None]  # blocks until all queued device work is done
    loss_value: Callable[[Any], float]
    compiles: Callable[[], int | None] = lambda: None
    cached_compiles: Callable[[], int | None] = lambda: None
    peak_bytes: Callable[[], int | None] = lambda: None
    # (bytes of one device's shards, bytes of the whole params), read after the timed steps so a
    # sharding lost during training shows; only W4 sets it.
    param_bytes: Callable[[], tuple[int, int] | None] = lambda: None
    # XLA's memory analysis of the steady-state step: bytes one device needs while it runs
    # (arguments + temporaries + outputs not aliased to arguments). Known on CPU too; W4 only.
    program_bytes: Callable[[], int | None] = lambda: None
    # Host seconds each step's barrier took (spmd_torch: linearise, cache key, dispatch); the
    # timed steps' median is reported as the barrier's host time.
    barrier_times: list[float] | None = None


def _program_bytes(compiled: Any) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (
        stats.argument_size_in_bytes
        + stats.temp_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )


def _now() -> float:
    return time.perf_counter()


def _run_trainer(tr: Trainer, warmup: int, steps: int, check: bool) -> dict[str, Any]:
    """Times steps one by one (each blocked, median), then a pipelined window (one wait at end)."""
    if check:
        losses = []
        for _ in range(steps):
            loss = tr.step()
            tr.wait()
            losses.append(tr.loss_value(loss))
        return {"losses": losses}

    t0 = _now()
    losses = [tr.step()]
    tr.wait()
    first_step_s = _now() - t0
    compiles_first = tr.compiles()
    for _ in range(warmup - 1):
        losses.append(tr.step())
        tr.wait()
    compiles_warm = tr.compiles()

    times = []
    barriers_before = len(tr.barrier_times or ())
    for _ in range(steps):
        t0 = _now()
        losses.append(tr.step())
        tr.wait()
        times.append(_now() - t0)
    barriers = (tr.barrier_times or [])[barriers_before:]

    t0 = _now()
    for _ in range(steps):
        losses.append(tr.step())
    tr.wait()
    window_s = _now() - t0

    compiles_end = tr.compiles()
    median_s = statistics.median(times)
    per_device, total = tr.param_bytes() or (None, None)
    return {
        "first_step_s": first_step_s,
        "median_step_s": median_s,
        "min_step_s": min(times),
        "max_step_s": max(times),
        "steps_per_s": 1.0 / median_s,
        "pipelined_steps_per_s": steps / window_s,
        "compiles_first_step": compiles_first,
        "compiles_total": compiles_end,
        "compiles_in_timed": _diff(compiles_end, compiles_warm),
        "cached_compiles": tr.cached_compiles(),
        "peak_bytes": tr.peak_bytes(),
        "param_bytes_per_device": per_device,
        "param_bytes_total": total,
        "program_bytes_per_device": tr.program_bytes(),
        "barrier_ms": statistics.median(barriers) * 1e3 if barriers else None,
        "loss_first": tr.loss_value(losses[0]),
        "loss_last": tr.loss_value(losses[-1]),
        "warmup": warmup,
        "steps": steps,
    }


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def _median_per_op(run: Callable[[], float], warmup: int, reps: int, n_ops: int) -> float:
    """Runs `run` (returns seconds measured) warmup + reps times; median µs per op."""
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(reps)) / n_ops * 1e6


# ------------------------------------------------------------------------------------------------
# Eager PyTorch


def _eager_device(gpu: bool) -> torch.device:
    return torch.device("cuda" if gpu and torch.cuda.is_available() else "cpu")


def _eager_wait(dev: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def _eager_peak(dev: torch.device) -> Callable[[], int | None]:
    return torch.cuda.max_memory_allocated if dev.type == "cuda" else (lambda: None)


def w1_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    dev = _eager_device(gpu)
    wait = _eager_wait(dev)
    x, y, w = (torch.from_numpy(a).to(dev) for a in _chain_data())
    if check:
        return {"losses": [_chain(x, y, w, CHAIN.n_ops).double().mean().item()]}

    def run() -> float:
        t0 = _now()
        _chain(x, y, w, CHAIN.n_ops)
        wait()
        return _now() - t0

    us = _median_per_op(run, warmup, steps, CHAIN.n_ops)
    return {"exec_us_per_op": us, "device": str(dev), "warmup": warmup, "steps": steps}


def _eager_trainer(
    model: nn.Module,
    opt_fn: Callable,
    loss_fn: Callable,
    data: tuple[np.ndarray, ...],
    dev: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> Trainer:
    """With ``autocast_dtype``, the forward pass runs under ``torch.autocast`` on ``dev``."""
    model.to(dev)
    opt = opt_fn(model)
    batch = [torch.from_numpy(a).to(dev) for a in data]
    region = contextlib.nullcontext
    if autocast_dtype is not None:
        region = lambda: torch.autocast(dev.type, dtype=autocast_dtype)  # noqa: E731

    def step() -> torch.Tensor:
        with region():
            loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return Trainer(step, _eager_wait(dev), lambda loss: loss.item(), peak_bytes=_eager_peak(dev))


def w2_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    dev = _eager_device(gpu)
    tr = _eager_trainer(_new_mlp(), _new_sgd, _mlp_loss, _mlp_data(), dev)
    return {**_run_trainer(tr, warmup, steps, check), "device": str(dev)}


def w3_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    dev = _eager_device(gpu)
    tr = _eager_trainer(_new_gpt(), _new_adamw, _gpt_loss, _gpt_data(), dev)
    return {**_run_trainer(tr, warmup, steps, check), "device": str(dev)}


def w3amp_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    dev = _eager_device(gpu)
    tr = _eager_trainer(_new_gpt(), _new_adamw, _gpt_loss, _gpt_data(), dev, torch.bfloat16)
    return {**_run_trainer(tr, warmup, steps, check), "device": str(dev)}


# ------------------------------------------------------------------------------------------------
# Hand-written JAX


def _jax_peak(devices: list[Any] | None = None) -> int | None:
    """Largest peak_bytes_in_use over `devices` (default: the first); None where JAX keeps no
    memory stats (CPU)."""
    import jax

    stats = [d.memory_stats() or {} for d in devices or jax.devices()[:1]]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return max(peaks) if peaks else None


def _fsdp_mesh_size() -> int:
    """FSDP.mesh_devices, or fewer where there are fewer (--gpu), rounded down to a power of two
    so the batch and every sharded dim 0 (128 to 1024) still split evenly."""
    import jax

    n = min(FSDP.mesh_devices, jax.device_count())
    return 1 << (n.bit_length() - 1)


def _fsdp_info(n: int) -> dict[str, Any]:
    """Result fields naming the mesh, so a GPU run on fewer than FSDP.mesh_devices says so."""
    import jax

    return {"device": f"{n}x {jax.devices()[0].platform} mesh", "mesh_devices": n}


def _jax_fsdp_where(mesh: Any) -> Callable[[Any], Any]:
    """W4's placement: 2-D arrays (weights, their AdamW moments, the batch) split on dim 0 over
    the mesh, everything else replicated. The moments follow their params as in any FSDP, and so
    the donated step gets back the shardings it was given (one compile). P(axis) is P(axis, None)
    for a 2-D array, but jit returns the short form, and jax 0.10's cache treats the long one as
    a different input sharding: a second compile at step 2."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharded = NamedSharding(mesh, P(FSDP.axis))
    replicated = NamedSharding(mesh, P())
    return lambda x: sharded if np.ndim(x) == 2 else replicated


def _jax_param_bytes(params: Any) -> tuple[int, int]:
    """Bytes of device 0's shards (every device holds an equal split) and of the whole params."""
    import jax

    leaves = jax.tree.leaves(params)
    return sum(p.addressable_shards[0].data.nbytes for p in leaves), sum(p.nbytes for p in leaves)


def w1_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    x, y, w = (jax.device_put(a, dev) for a in _chain_data())
    fn = jax.jit(lambda x, y, w: _chain(x, y, w, CHAIN.n_ops))
    if check:
        return {"losses": [float(np.asarray(fn(x, y, w), dtype=np.float64).mean())]}

    def run_exec() -> float:
        t0 = _now()
        fn(x, y, w).block_until_ready()
        return _now() - t0

    def run_trace() -> float:
        # A fresh function each time, so jax's trace cache cannot answer: cost of jax's own tracing.
        def fresh(x: Any, y: Any, w: Any) -> Any:
            return _chain(x, y, w, CHAIN.n_ops)

        t0 = _now()
        jax.make_jaxpr(fresh)(x, y, w)
        return _now() - t0

    exec_us = _median_per_op(run_exec, warmup, steps, CHAIN.n_ops)
    trace_us = _median_per_op(run_trace, 1, max(3, steps // 3), CHAIN.n_ops)
    return {
        "exec_us_per_op": exec_us,
        "jax_trace_us_per_op": trace_us,
        "device": str(dev),
        "warmup": warmup,
        "steps": steps,
    }


def _jax_trainer(
    loss_fn: Callable,
    init_fn: Callable,
    update_fn: Callable,
    model: nn.Module,
    data: tuple[np.ndarray, ...],
    mesh: Any = None,
) -> Trainer:
    """Single-device (W2, W3) or, given a mesh, W4's FSDP placement of params, state and batch."""
    import jax

    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    where = (lambda x: devices[0]) if mesh is None else _jax_fsdp_where(mesh)

    def put(tree: Any) -> Any:
        return jax.tree.map(lambda x: jax.device_put(x, where(x)), tree)

    params = put(_jax_params(model))
    opt_state = put(init_fn(params))
    batch = put([a.astype(np.int32) if a.dtype == np.int64 else a for a in data])
    train_step = _jax_train_step(loss_fn, update_fn)
    state = {"params": params, "opt": opt_state}

    def step() -> Any:
        state["params"], state["opt"], loss = train_step(state["params"], state["opt"], *batch)
        return loss

    def compiles() -> int | None:
        size = getattr(train_step, "_cache_size", None)
        return size() if callable(size) else None

    return Trainer(
        step,
        lambda: jax.block_until_ready(state),
        lambda loss: float(loss),
        compiles=compiles,
        peak_bytes=lambda: _jax_peak(devices),
        param_bytes=(lambda: None) if mesh is None else lambda: _jax_param_bytes(state["params"]),
        program_bytes=(lambda: None)
        if mesh is None
        else lambda: _program_bytes(
            train_step.lower(state["params"], state["opt"], *batch).compile()
        ),
    )


def w2_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    tr = _jax_trainer(_jax_mlp_loss, _jax_sgd_init, _jax_sgd_update, _new_mlp(), _mlp_data())
    return {**_run_trainer(tr, warmup, steps, check), "device": str(jax.devices()[0])}


def w3_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    tr = _jax_trainer(_jax_gpt_loss, _jax_adamw_init, _jax_adamw_update, _new_gpt(), _gpt_data())
    return {**_run_trainer(tr, warmup, steps, check), "device": str(jax.devices()[0])}


def w4_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    n = _fsdp_mesh_size()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (FSDP.axis,))
    data = _gpt_data(GPT_W4_CFG)
    tr = _jax_trainer(
        _jax_gpt_loss, _jax_adamw_init, _jax_adamw_update, _new_gpt(), data, mesh=mesh
    )
    return {**_run_trainer(tr, warmup, steps, check), **_fsdp_info(n)}


# ------------------------------------------------------------------------------------------------
# spmd_torch. Written against the public torch_xla-style API:
#   spmd_torch.device(), spmd_torch.sync(), core.xla_model.wait_device_ops(),
#   debug.metrics.metric_data('CompileTime') -> (count, total_ns, samples) | None,
#   debug.metrics.counter_value('CachedCompile') -> int | None.


def _import_spmd() -> Any:
    """Imports spmd_torch, from this checkout when it is not installed."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:
        sys.path.insert(1, repo)
    import spmd_torch

    return spmd_torch


def _spmd_compiles() -> int:
    import spmd_torch.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def _spmd_cached_compiles() -> int:
    import spmd_torch.debug.metrics as met

    return int(met.counter_value("CachedCompile") or 0)


def w1_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    spmd_torch = _import_spmd()
    import spmd_torch.core.xla_model as xm

    dev = spmd_torch.device()
    x, y, w = (torch.from_numpy(a).to(dev) for a in _chain_data())
    spmd_torch.sync()
    xm.wait_device_ops()
    if check:
        out = _chain(x, y, w, CHAIN.n_ops)
        spmd_torch.sync()
        return {"losses": [out.cpu().double().mean().item()]}

    sync_times = []

    def run() -> float:
        t0 = _now()
        out = _chain(x, y, w, CHAIN.n_ops)
        trace_s = _now() - t0
        t0 = _now()
        spmd_torch.sync()
        xm.wait_device_ops()
        sync_times.append(_now() - t0)
        del out
        return trace_s

    t0 = _now()
    run()
    first_rep_s = _now() - t0
    compiles_first = _spmd_compiles()
    trace_us = _median_per_op(run, warmup - 1, steps, CHAIN.n_ops)
    compiles_end = _spmd_compiles()
    return {
        "trace_us_per_op": trace_us,
        "sync_ms": statistics.median(sync_times[-steps:]) * 1e3,
        "first_rep_s": first_rep_s,
        "compiles_first_step": compiles_first,
        "compiles_total": compiles_end,
        "compiles_in_timed": compiles_end - compiles_first,
        "cached_compiles": _spmd_cached_compiles(),
        "device": str(dev),
        "warmup": warmup,
        "steps": steps,
    }


def _spmd_trainer(
    model: nn.Module,
    opt_fn: Callable,
    loss_fn: Callable,
    data: tuple[np.ndarray, ...],
    shard: Callable[[nn.Module, list[torch.Tensor]], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> Trainer:
    """`shard` marks the model and batch once they are on the device; the optimizer comes after,
    as PyTorch/XLA asks, so its state is made from the marked parameters. With `autocast_dtype`
    the forward pass runs under ``spmd_torch.amp.autocast``."""
    spmd_torch = _import_spmd()
    import spmd_torch.amp as amp
    import spmd_torch.core.xla_model as xm

    dev = spmd_torch.device()
    model.to(dev)
    batch = [torch.from_numpy(a).to(dev) for a in data]
    if shard is not None:
        shard(model, batch)
    opt = opt_fn(model)
    spmd_torch.sync()
    xm.wait_device_ops()
    barrier_times: list[float] = []
    region = contextlib.nullcontext
    if autocast_dtype is not None:
        region = lambda: amp.autocast(dev, dtype=autocast_dtype)  # noqa: E731

    def step() -> torch.Tensor:
        with region():
            loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()  # before sync, so it is an output of the step's one graph
        t0 = _now()
        spmd_torch.sync()
        barrier_times.append(_now() - t0)
        return loss

    return Trainer(
        step,
        xm.wait_device_ops,
        lambda loss: loss.item(),
        compiles=_spmd_compiles,
        cached_compiles=_spmd_cached_compiles,
        peak_bytes=_jax_peak,
        barrier_times=barrier_times,
    )


def w2_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    spmd_torch = _import_spmd()
    tr = _spmd_trainer(_new_mlp(), _new_sgd, _mlp_loss, _mlp_data())
    return {**_run_trainer(tr, warmup, steps, check), "device": str(spmd_torch.device())}


def w3_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    spmd_torch = _import_spmd()
    tr = _spmd_trainer(_new_gpt(), _new_adamw, _gpt_loss, _gpt_data())
    return {**_run_trainer(tr, warmup, steps, check), "device": str(spmd_torch.device())}


def _syncfree_adamw(model: nn.Module) -> torch.optim.Optimizer:
    from spmd_torch.amp import syncfree

    c = GPT_CFG
    return syncfree.AdamW(
        model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
    )


def w3amp_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    """W3 under bf16 autocast with syncfree AdamW; then counts the device-to-host transfers of
    `steps` more steps (the loss stays on the device: nothing should be read)."""
    spmd_torch = _import_spmd()
    from spmd_torch._lazy import counters

    tr = _spmd_trainer(
        _new_gpt(), _syncfree_adamw, _gpt_loss, _gpt_data(), autocast_dtype=torch.bfloat16
    )
    result = _run_trainer(tr, warmup, steps, check)
    if check:
        return result
    before = counters.COUNTERS.get("TransferFromDevice", 0)
    for _ in range(steps):
        tr.step()
    tr.wait()
    transfers = counters.COUNTERS.get("TransferFromDevice", 0) - before
    return {
        **result,
        "transfers_from_device_per_step": transfers / steps,
        "device": str(spmd_torch.device()),
    }


def _spmd_fsdp_shard(n: int) -> Callable[[nn.Module, list[torch.Tensor]], None]:
    """W4's marks, written as a PyTorch/XLA FSDP user would: every 2-D parameter and the batch
    split on dim 0 over an n-device mesh; everything else is left replicated."""
    import spmd_torch.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(n), (n,), (FSDP.axis,))

    def shard(model: nn.Module, batch: list[torch.Tensor]) -> None:
        for p in model.parameters():
            if p.dim() == 2:
                xs.mark_sharding(p, mesh, (FSDP.axis, None))
        for t in batch:
            xs.mark_sharding(t, mesh, (FSDP.axis, None))

    return shard


def _spmd_program_bytes() -> int | None:
    """The memory analysis of the last program compiled: W4's steady-state step."""
    from spmd_torch._lazy import engine

    executables = list(engine.current().cache.executables.values())
    return _program_bytes(executables[-1].compiled) if executables else None


def _spmd_param_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of device 0's shards of the parameters' device arrays, and the params' total."""
    from spmd_torch._lazy.execute import global_array

    per_device = sum(global_array(p).addressable_shards[0].data.nbytes for p in model.parameters())
    return per_device, sum(p.numel() * p.element_size() for p in model.parameters())


def w4_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    _import_spmd()
    import jax

    n = _fsdp_mesh_size()
    model = _new_gpt()
    data = _gpt_data(GPT_W4_CFG)
    tr = _spmd_trainer(model, _new_adamw, _gpt_loss, data, shard=_spmd_fsdp_shard(n))
    tr = dataclasses.replace(
        tr,
        peak_bytes=lambda: _jax_peak(jax.devices()[:n]),
        param_bytes=lambda: _spmd_param_bytes(model),
        program_bytes=_spmd_program_bytes,
    )
    return {**_run_trainer(tr, warmup, steps, check), **_fsdp_info(n)}


# ------------------------------------------------------------------------------------------------
# W2mp: W2's MLP data parallel, as a per-device multiprocessing script (launch, one replica per
# device) and as one SPMD program (the batch sharded over a 1-D mesh). Both run the same math on
# the same data from one init: the mean of the replicas' losses is the SPMD loss.

W2MP_BATCH = 32  # rows per replica (per device in the SPMD program)
W2MP_WINDOWS = 5  # timed windows; --steps is split between them
W2MP_AXIS = "data"


def _w2mp_devices() -> int:
    """Replicas (mp) and mesh size (SPMD): every local device, as ``launch`` uses."""
    import jax

    return jax.local_device_count()


def _w2mp_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A global batch of W2MP_BATCH rows per device; for 8 devices, W2's batch of 256 itself."""
    return _mlp_data(W2MP_BATCH * n)


def _spmd_uncached() -> int:
    import spmd_torch.debug.metrics as met

    return int(met.counter_value("UncachedCompile") or 0)


# A program's run on one device, and over the SPMD mesh (PyTorch/XLA's names).
_EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")


class _Probes:
    """perf_counter_ns totals and call counts of wrapped engine functions: the host-time
    breakdown. Patched in for one window only and taken out again, so the timed windows run the
    engine as it is."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._execute_seen = 0

    def add(self, name: str, ns: int) -> None:
        self.ns[name] = self.ns.get(name, 0) + ns
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        add = self.add

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                add(name, time.perf_counter_ns() - start)

        self._undo.append((owner, attr, original))
        setattr(owner, attr, timed)

    def wrap_turns(self, world_cls: Any) -> None:
        """Times each turn hand-off: from the holder passing the turn to the next replica's
        thread waking up with it (replicas.py World._pass_turn -> World._await_turn)."""
        pass_turn, await_turn = world_cls._pass_turn, world_cls._await_turn
        handed: dict[int, int] = {}
        add = self.add

        def timed_pass(world: Any) -> None:
            before = world.turn
            pass_turn(world)
            if world.turn is not None and world.turn != before:
                handed[world.turn] = time.perf_counter_ns()

        def timed_await(world: Any, replica: Any) -> None:
            await_turn(world, replica)
            start = handed.pop(replica.ordinal, None)
            if start is not None:
                add("handoff", time.perf_counter_ns() - start)

        self._undo += [(world_cls, "_pass_turn", pass_turn), (world_cls, "_await_turn", await_turn)]
        world_cls._pass_turn, world_cls._await_turn = timed_pass, timed_await

    def start(self, mp: bool) -> None:
        import jax

        from spmd_torch._lazy import compile as compiler
        from spmd_torch._lazy import counters, execute, replicas

        self._execute_seen = {name: len(counters.METRICS[name]) for name in _EXECUTE_METRICS}
        for attr in ("sync", "live_pending", "linearize", "_bind"):
            self.wrap(execute, attr, attr)
        self.wrap(compiler, "lookup_or_compile", "lookup")
        if mp:
            for attr in ("barrier", "_wait", "_run"):
                self.wrap(replicas.World, attr, attr.lstrip("_"))
            self.wrap(replicas, "_stacked", "stacked")
            self.wrap(jax, "make_array_from_single_device_arrays", "make_array")
            self.wrap(jax, "device_put", "device_put")
            self.wrap_turns(replicas.World)
        else:
            self.wrap(execute, "run", "run")

    def stop(self) -> None:
        from spmd_torch._lazy import counters

        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()
        executed = [
            ns
            for name, seen in self._execute_seen.items()
            for ns in counters.METRICS[name].since(seen)
        ]
        self.ns["execute"], self.calls["execute"] = sum(executed), len(executed)


def _run_windows(
    step: Callable[[], torch.Tensor],
    wait: Callable[[], None],
    warmup: int,
    windows: int,
    window: int,
    probes: _Probes | None,
    mp: bool,
) -> dict[str, Any]:
    """Warm-up, then `windows` timed windows of `window` pipelined steps (one wait at the end of
    each), then one more window of blocked steps with `probes` patched in: waiting for the device
    after each step keeps device work (on CPU, on the same cores) out of the host times. Every
    replica of a launch runs it (they meet at each step's barrier; only replica 0 has probes and
    its wait holds the turn), and replica 0's figures are the world's."""
    t0 = _now()
    losses = [step()]
    wait()
    first_step_s = _now() - t0
    compiles_first = _spmd_uncached()
    for _ in range(warmup - 1):
        step()
    wait()
    compiles_warm = _spmd_uncached()
    rates = []
    for _ in range(windows):
        t0 = _now()
        for _ in range(window):
            losses.append(step())
        wait()
        rates.append(window / (_now() - t0))
    compiles_timed = _spmd_uncached()
    first_probed = warmup + windows * window  # index of the first probed step
    if probes is not None:
        probes.start(mp)
    host_s = wait_s = 0.0
    for _ in range(window):
        t0 = _now()
        losses.append(step())
        t1 = _now()
        wait()
        host_s, wait_s = host_s + t1 - t0, wait_s + _now() - t1
    if probes is not None:
        probes.stop()
    return {
        "first_step_s": first_step_s,
        "steps_per_s": statistics.median(rates),
        "window_steps_per_s": rates,
        "compiles_first_step": compiles_first,
        "compiles_in_timed": compiles_timed - compiles_warm,
        "compiles_in_probe": _spmd_uncached() - compiles_timed,
        "probe_steps": (first_probed, first_probed + window),
        "probe_host_ms": host_s * 1e3 / window,  # in step(): all host work, serial
        "probe_wait_ms": wait_s * 1e3 / window,  # then waiting for the device
        "probe_ns": None if probes is None else probes.ns,
        "probe_calls": None if probes is None else probes.calls,
        "loss_first": losses[0].item(),
        "loss_last": losses[-1].item(),
    }


def _w2mp_windows(steps: int) -> tuple[int, int]:
    """(windows, steps per window) for `steps` timed steps."""
    windows = min(W2MP_WINDOWS, max(steps, 1))
    return windows, max(steps // windows, 1)


def _w2mp_replica(
    index: int,
    data: tuple[np.ndarray, np.ndarray],
    warmup: int,
    steps: int,
    check: bool,
) -> dict[str, Any]:
    """One replica of the mp script, as a PyTorch/XLA user writes it: the same init everywhere,
    its own rows of the batch (uploaded once, before the loop, as W2 does: no loader), gradients
    all-reduced by xm.optimizer_step, one barrier per step."""
    import spmd_torch.core.xla_model as xm

    dev = xm.xla_device()
    torch.manual_seed(0)
    model = MLP().to(dev)
    opt = _new_sgd(model)
    rows = slice(index * W2MP_BATCH, (index + 1) * W2MP_BATCH)
    x, y = (torch.from_numpy(a[rows]).to(dev) for a in data)
    xm.mark_step()
    xm.wait_device_ops()
    trace_ns: list[int] = []

    def step() -> torch.Tensor:
        start = time.perf_counter_ns()
        loss = _mlp_loss(model, x, y)
        loss.backward()
        xm.optimizer_step(opt)
        opt.zero_grad()
        loss = loss.detach()
        trace_ns.append(time.perf_counter_ns() - start)
        xm.mark_step()
        return loss

    if check:
        losses = [step() for _ in range(steps)]
        return {"losses": [loss.item() for loss in losses]}
    windows, window = _w2mp_windows(steps)
    probes = _Probes() if index == 0 else None
    result = _run_windows(step, xm.wait_device_ops, warmup, windows, window, probes, mp=True)
    return {**result, "trace_ns": trace_ns}


def _per_step(r: dict[str, Any]) -> Callable[[str], float]:
    """ms per probed step of one probe's total."""
    lo, hi = r["probe_steps"]
    return lambda name: r["probe_ns"].get(name, 0) / (hi - lo) / 1e6


def _mp_breakdown(r0: dict[str, Any], traces: list[list[int]]) -> dict[str, float]:
    """Host ms per step of the probed window, by where it went. It is all serial (replicas take
    turns; the last to arrive runs the merged program), so the parts add up to replica 0's time
    in step(); `unaccounted` is what no probe covers (lock, answers, RNG swaps, loop)."""
    ms = _per_step(r0)
    lo, hi = r0["probe_steps"]
    trace = sum(sum(t[lo:hi]) for t in traces) / (hi - lo) / 1e6
    out = {
        "host": r0["probe_host_ms"],
        "device_wait": r0["probe_wait_ms"],
        "trace_all": trace,
        "trace_per_replica": trace / len(traces),
        "sync_own": ms("sync") - ms("wait"),  # the replicas' barriers less their waiting
        "live_pending": ms("live_pending"),
        "linearize": ms("linearize"),
        "barrier_key": ms("barrier") - ms("wait"),  # World.barrier: arrays, scalars, key
        "bind": ms("_bind"),
        "handoff": ms("handoff"),
        "handoffs_per_step": r0["probe_calls"].get("handoff", 0) / (hi - lo),
        "run": ms("run"),
        "stacked": ms("stacked"),
        "make_array": ms("make_array"),
        "device_put": ms("device_put"),
        "lookup": ms("lookup"),
        "execute": ms("execute"),
    }
    out["run_other"] = out["run"] - out["stacked"] - out["device_put"] - out["lookup"]
    out["run_other"] -= out["execute"]
    out["unaccounted"] = out["host"] - trace - out["sync_own"] - out["run"] - out["handoff"]
    return out


def _spmd_breakdown(r: dict[str, Any]) -> dict[str, float]:
    """Host ms per step of the probed window: tracing, then the barrier (sync) and its parts."""
    ms = _per_step(r)
    return {
        "host": r["probe_host_ms"],
        "device_wait": r["probe_wait_ms"],
        "trace": r["probe_host_ms"] - ms("sync"),
        "barrier": ms("sync"),
        "live_pending": ms("live_pending"),
        "linearize": ms("linearize"),
        "run": ms("run"),
        "lookup": ms("lookup"),
        "execute": ms("execute"),
        "bind": ms("_bind"),
    }


def w2mp_mp(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    spmd_torch = _import_spmd()
    n = _w2mp_devices()
    before = _spmd_uncached()
    results = spmd_torch.launch(_w2mp_replica, args=(_w2mp_data(n), warmup, steps, check))
    replicas = [results[k] for k in range(n)]
    if check:  # the global batch's loss: the mean of the replicas' equal-sized batches' losses
        return {"losses": [float(np.mean(ls)) for ls in zip(*(r["losses"] for r in replicas))]}
    r0 = replicas[0]
    return {
        **{k: v for k, v in r0.items() if not k.startswith("probe_") and k != "trace_ns"},
        "compiles_total": _spmd_uncached() - before,
        "host_ms": _mp_breakdown(r0, [r["trace_ns"] for r in replicas]),
        "loss_first": float(np.mean([r["loss_first"] for r in replicas])),
        "loss_last": float(np.mean([r["loss_last"] for r in replicas])),
        "device": f"{n} replicas",
        "mesh_devices": n,
        "warmup": warmup,
        "steps": steps,
    }


def _spmd_dp_shard(n: int) -> Callable[[nn.Module, list[torch.Tensor]], None]:
    """W2mp's SPMD marks: the batch split on dim 0 over an n-device 1-D mesh; the parameters
    left unmarked, so replicated (data parallel)."""
    import spmd_torch.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(n), (n,), (W2MP_AXIS,))

    def shard(model: nn.Module, batch: list[torch.Tensor]) -> None:
        for t in batch:
            xs.mark_sharding(t, mesh, (W2MP_AXIS,) + (None,) * (t.dim() - 1))

    return shard


def w2mp_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    _import_spmd()
    n = _w2mp_devices()
    before = _spmd_uncached()
    tr = _spmd_trainer(_new_mlp(), _new_sgd, _mlp_loss, _w2mp_data(n), shard=_spmd_dp_shard(n))
    if check:
        return _run_trainer(tr, warmup, steps, check)
    windows, window = _w2mp_windows(steps)
    r = _run_windows(tr.step, tr.wait, warmup, windows, window, _Probes(), mp=False)
    return {
        **{k: v for k, v in r.items() if not k.startswith("probe_")},
        "compiles_total": _spmd_uncached() - before,
        "host_ms": _spmd_breakdown(r),
        "device": f"{n}-device mesh",
        "mesh_devices": n,
        "warmup": warmup,
        "steps": steps,
    }


# ------------------------------------------------------------------------------------------------
# W5: checkpoints of W4's state, spmd_torch's against orbax's own on the same arrays


class _RssPeak:
    """The largest growth of this process's resident memory while the block runs (sampled each
    millisecond on a thread), in bytes."""

    def __enter__(self) -> _RssPeak:
        import threading

        self.base = self.peak = _rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _disk_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, files in os.walk(path)
        for name in files
    )


def w5_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    spmd_torch = _import_spmd()
    import shutil
    import tempfile

    import jax
    import orbax.checkpoint as ocp

    import spmd_torch.distributed.spmd as xs
    import spmd_torch.experimental.distributed_checkpoint as xc
    from spmd_torch._lazy.execute import global_array
    from spmd_torch.experimental.distributed_checkpoint import _tree

    n = _fsdp_mesh_size()
    dev = spmd_torch.device()

    def trained(mesh_shape: tuple, names: tuple, spec: tuple) -> tuple[nn.Module, Any]:
        mesh = xs.Mesh(np.arange(n), mesh_shape, names)
        model = _new_gpt().to(dev)
        for p in model.parameters():
            if p.dim() == 2:
                xs.mark_sharding(p, mesh, spec)
        return model, _new_adamw(model)

    model, opt = trained((n,), (FSDP.axis,), (FSDP.axis, None))
    batch = [torch.from_numpy(a).to(dev) for a in _gpt_data(GPT_W4_CFG)]
    for _ in range(2):
        _gpt_loss(model, *batch).backward()
        opt.step()
        opt.zero_grad()
        spmd_torch.sync()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    # Orbax's side: the very same device arrays, as a JAX user would hold them.
    split = _tree.split(state)
    direct, state_bytes = split.arrays, split.nbytes
    jax.block_until_ready(direct)
    other, other_opt = trained((n // 2, 2), ("a", "b"), ("a", "b"))
    other_state = {"model": other.state_dict(), "optim": other_opt.state_dict()}  # state: made
    # by the first restore, filled in place by the later ones
    handler = ocp.PyTreeCheckpointHandler(use_compression=False)
    orbax_writer = ocp.Checkpointer(handler)

    def orbax_restore(path: str, like: dict) -> Any:
        args = jax.tree.map(
            lambda a: (
                ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype)
                if isinstance(a, jax.Array)
                else ocp.RestoreArgs(restore_type=np.ndarray)
            ),
            like,
        )
        restored = ocp.Checkpointer(handler).restore(
            path, args=ocp.args.PyTreeRestore(item=like, restore_args=args, partial_restore=True)
        )
        return jax.block_until_ready(restored)

    root = tempfile.mkdtemp(prefix="w5-")
    times: dict[str, list[float]] = {}
    growth: dict[str, list[int]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        with _RssPeak() as rss:
            t0 = _now()
            fn()
            elapsed = _now() - t0
        times.setdefault(name, []).append(elapsed)
        growth.setdefault(name, []).append(rss.growth)

    manager = xc.CheckpointManager(os.path.join(root, "managed"), 1, chkpt_on_preemption=False)
    try:
        for rep in range(warmup + steps):
            ours, theirs = os.path.join(root, f"ours{rep}"), os.path.join(root, f"orbax{rep}")
            timed("save", lambda: xc.save(state, ours))
            timed("orbax_save", lambda: orbax_writer.save(theirs, args=ocp.args.PyTreeSave(direct)))
            timed(
                "restore",
                lambda: (
                    xc.load(state, ours),
                    jax.block_until_ready([global_array(t) for t in model.parameters()]),
                ),
            )
            timed("orbax_restore", lambda: orbax_restore(theirs, direct))
            timed(
                "restore_4x2",
                lambda: (
                    xc.load(other_state, ours),
                    jax.block_until_ready([global_array(t) for t in other.parameters()]),
                ),
            )
            other_like = _tree.split(other_state).arrays
            timed("orbax_restore_4x2", lambda: orbax_restore(theirs, other_like))
            timed("save_async_blocking", lambda: manager.save_async(rep, state, force=True))
            timed("save_async_total", manager.join)
            disk = {"ours": _disk_bytes(ours), "orbax": _disk_bytes(theirs)}
            shutil.rmtree(ours)
            shutil.rmtree(theirs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times = {k: v[warmup:] for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    median["save_async_total"] += median["save_async_blocking"]
    return {
        "device": f"{n}-device mesh",
        "mesh_devices": n,
        "warmup": warmup,
        "steps": steps,
        "state_bytes": state_bytes,
        "disk_bytes": disk,
        "seconds": median,
        "rss_growth_bytes": {k: max(v[warmup:]) for k, v in growth.items()},
    }


RUNNERS: dict[tuple[str, str], Callable[[int, int, bool, bool], dict[str, Any]]] = {
    ("W1", "eager"): w1_eager,
    ("W1", "jax"): w1_jax,
    ("W1", "spmd_torch"): w1_spmd,
    ("W2", "eager"): w2_eager,
    ("W2", "jax"): w2_jax,
    ("W2", "spmd_torch"): w2_spmd,
    ("W3", "eager"): w3_eager,
    ("W3", "jax"): w3_jax,
    ("W3", "spmd_torch"): w3_spmd,
    ("W3amp", "eager"): w3amp_eager,
    ("W3amp", "spmd_torch"): w3amp_spmd,
    ("W4", "jax"): w4_jax,
    ("W4", "spmd_torch"): w4_spmd,
    ("W2mp", "mp"): w2mp_mp,
    ("W2mp", "spmd_torch"): w2mp_spmd,
    ("W5", "spmd_torch"): w5_spmd,
}


# ------------------------------------------------------------------------------------------------
# Child process: one (workload, implementation)


def _configure_jax_env(gpu: bool, env: dict[str, str], workload: str = "") -> dict[str, str]:
    """Pins the JAX platform before jax is imported; drops a forced CPU device count (tests set 8),
    which would split the CPU thread pool between virtual devices, except for W4 and W2mp on CPU,
    whose meshes (and W2mp's replicas) need FSDP.mesh_devices of them."""
    env["JAX_PLATFORMS"] = "cuda" if gpu else "cpu"
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
    ).strip()
    if workload in _MESH_WORKLOADS and not gpu:
        flags += f" --xla_force_host_platform_device_count={FSDP.mesh_devices}"
        flags = flags.strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def _run_child(only: str, args: argparse.Namespace) -> int:
    workload, impl = _parse_only(only)
    _configure_jax_env(args.gpu, os.environ, workload)
    if args.matmul_precision and impl != "eager":
        import jax

        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    warmup, steps = _steps_for(workload, args)
    warmup = max(warmup, 1)
    t0 = _now()
    result = RUNNERS[workload, impl](warmup, steps, args.check, args.gpu)
    result.update(workload=workload, impl=impl, wall_s=_now() - t0)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def _workload_name(name: str) -> str:
    """The workload spelt as in WORKLOADS (names are case-insensitive: w2mp, W2MP); else `name`."""
    return {w.upper(): w for w in WORKLOADS}.get(name.strip().upper(), name.strip())


def _parse_only(only: str) -> tuple[str, str]:
    workload, sep, impl = only.partition(":")
    workload = _workload_name(workload)
    if not sep or workload not in WORKLOADS or impl not in _IMPL_ALIASES:
        raise SystemExit(
            f"--only expects WORKLOAD:IMPL with WORKLOAD in {WORKLOADS} and IMPL in "
            f"{sorted(_IMPL_ALIASES)}; got {only!r}"
        )
    impl = _IMPL_ALIASES[impl]
    if impl not in _impls_of(workload):
        raise SystemExit(f"--only {only}: {workload} has only {_impls_of(workload)}")
    return workload, impl


def _impls_of(workload: str) -> tuple[str, ...]:
    return WORKLOAD_IMPLS.get(workload, _DEFAULT_IMPLS)


def _steps_for(workload: str, args: argparse.Namespace) -> tuple[int, int]:
    if args.check:
        return 0, CHECK_STEPS
    warmup, steps = DEFAULT_STEPS[workload]
    return (
        warmup if args.warmup is None else args.warmup,
        steps if args.steps is None else args.steps,
    )


# ------------------------------------------------------------------------------------------------
# Parent process: spawn children, collect, report


def _spawn(workload: str, impl: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs one (workload, impl) in a fresh interpreter and returns its BENCH_RESULT."""
    warmup, steps = _steps_for(workload, args)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--only",
        f"{workload}:{impl}",
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
    ]
    cmd += ["--gpu"] * args.gpu + ["--check"] * args.check
    if args.matmul_precision:
        cmd += ["--matmul-precision", args.matmul_precision]
    env = _configure_jax_env(args.gpu, dict(os.environ), workload)
    print(f"... {workload}:{impl}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(
            cmd, check=False, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"workload": workload, "impl": impl, "error": f"timed out after {args.timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {
        "workload": workload,
        "impl": impl,
        "error": f"exit {proc.returncode}: {tail}",
        "stderr_tail": proc.stderr[-4000:],
    }


def _gpu_available(env: dict[str, str]) -> str | None:
    """Asks a throwaway interpreter, so the parent never initialises (or preallocates) the GPU."""
    probe = "import jax; d = jax.devices()[0]; print(d.platform, d.device_kind)"
    proc = subprocess.run(
        [sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.startswith("gpu") else None


def _fmt(value: Any, spec: str = ".3g", unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}" if isinstance(value, (int, float)) else str(value)


def _fmt_bytes(value: int | None, gpu: bool) -> str:
    if not gpu:
        return "n/a"
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _print_errors(results: dict[str, dict[str, Any]]) -> None:
    for impl, r in results.items():
        if "error" in r:
            print(f"  {impl} error: {r['error']}")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _report_w1(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for impl, r in results.items():
        if "error" in r:
            rows.append([impl, "error", "", ""])
            continue
        if impl == "spmd_torch":
            what = f"trace {_fmt(r['trace_us_per_op'], '.2f')} µs/op"
            extra = (
                f"sync {_fmt(r['sync_ms'], '.2f')} ms, first rep {_fmt(r['first_rep_s'], '.2f')}"
                f" s, compiles {r['compiles_total']} ({r['compiles_in_timed']} in timed)"
            )
        else:
            what = f"exec {_fmt(r['exec_us_per_op'], '.3f')} µs/op"
            extra = (
                f"jax trace {_fmt(r['jax_trace_us_per_op'], '.2f')} µs/op"
                if "jax_trace_us_per_op" in r
                else ""
            )
        rows.append([impl, r.get("device", ""), what, extra])
    spmd = results.get("spmd_torch", {}).get("trace_us_per_op")
    ratios = {
        "spmd_trace_over_eager_exec": _ratio(spmd, results.get("eager", {}).get("exec_us_per_op")),
        "spmd_trace_over_jax_trace": _ratio(
            spmd, results.get("jax", {}).get("jax_trace_us_per_op")
        ),
    }
    print(
        f"\nW1 tracing overhead: {CHAIN.n_ops} elementwise ops on {CHAIN.size}x{CHAIN.size} "
        f"(median µs per op)"
    )
    print(_table(["impl", "device", "per op", "notes"], rows))
    _print_errors(results)
    for name, value in ratios.items():
        print(f"  {name}: {_fmt(value, '.2f', 'x')}")
    return ratios


def _report_training(
    workload: str, title: str, results: dict[str, dict[str, Any]], gpu: bool
) -> dict[str, Any]:
    headers = [
        "impl",
        "device",
        "steps/s",
        "median ms",
        "pipelined steps/s",
        "first step s",
        "compiles (timed)",
        "peak mem",
        "loss first→last",
    ]
    rows = []
    for impl, r in results.items():
        if "error" in r:
            rows.append([impl, "error"] + [""] * (len(headers) - 2))
            continue
        compiles = (
            "-"
            if r["compiles_total"] is None
            else f"{r['compiles_total']} ({_fmt(r['compiles_in_timed'])})"
        )
        rows.append(
            [
                impl,
                r["device"],
                _fmt(r["steps_per_s"], ".2f"),
                _fmt(r["median_step_s"] * 1e3, ".1f"),
                _fmt(r["pipelined_steps_per_s"], ".2f"),
                _fmt(r["first_step_s"], ".2f"),
                compiles,
                _fmt_bytes(r["peak_bytes"], gpu),
                f"{r['loss_first']:.4f}→{r['loss_last']:.4f}",
            ]
        )
    speed = {impl: r.get("steps_per_s") for impl, r in results.items()}
    others = [i for i in _impls_of(workload) if i != "spmd_torch"]
    ratios = {f"spmd_over_{o}": _ratio(speed.get("spmd_torch"), speed.get(o)) for o in others}
    print(f"\n{workload} {title}")
    print(_table(headers, rows))
    _print_errors(results)
    shown = ", ".join(
        f"spmd_torch/{o} {_fmt(ratios[f'spmd_over_{o}'], '.2f', 'x')}" for o in others
    )
    print(f"  steps/s ratio (>1: spmd_torch faster): {shown}")
    transfers = results.get("spmd_torch", {}).get("transfers_from_device_per_step")
    if transfers is not None:
        print(f"  spmd_torch device-to-host transfers per step: {transfers:g}")
    barrier = results.get("spmd_torch", {}).get("barrier_ms")
    if barrier is not None:
        print(
            f"  spmd_torch barrier host time (sync(): linearise, key, dispatch): {barrier:.2f} ms"
        )
    return ratios


def _fmt_mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f} MiB"


def _report_param_bytes(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """W4: one device's param bytes against the ideal total/mesh; replicated 1-D params (biases,
    LayerNorms) keep it a little above 1x, a lost sharding shows as about mesh-size x."""
    out = {}
    for impl, r in results.items():
        per_device, total = r.get("param_bytes_per_device"), r.get("param_bytes_total")
        if per_device is None or total is None:
            continue
        ideal = total / r["mesh_devices"]
        out[impl] = {
            "per_device": per_device,
            "total": total,
            "total_over_mesh": ideal,
            "per_device_over_ideal": per_device / ideal,
        }
        print(
            f"  param bytes per device, {impl}: {_fmt_mib(per_device)} vs total/"
            f"{r['mesh_devices']} {_fmt_mib(ideal)} ({per_device / ideal:.3f}x; total "
            f"{_fmt_mib(total)}); compiled step needs "
            f"{_fmt_mib(r.get('program_bytes_per_device'))} per device"
        )
        out[impl]["program_bytes_per_device"] = r.get("program_bytes_per_device")
    return out


def _report_w2mp(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """W2mp: one row per way, the mp/SPMD steps/s ratio, and where each step's host time goes."""
    headers = [
        "impl",
        "device",
        "steps/s",
        "windows",
        "host ms/step",
        "device wait ms",
        "first step s",
        "compiles (timed, probed)",
        "loss first→last",
    ]
    rows = []
    for impl, r in results.items():
        if "error" in r:
            rows.append([impl, "error"] + [""] * (len(headers) - 2))
            continue
        windows, host = r["window_steps_per_s"], r["host_ms"]
        rows.append(
            [
                impl,
                r["device"],
                _fmt(r["steps_per_s"], ".2f"),
                f"{min(windows):.2f}-{max(windows):.2f}",
                _fmt(host["host"], ".1f"),
                _fmt(host["device_wait"], ".1f"),
                _fmt(r["first_step_s"], ".2f"),
                f"{r['compiles_total']} ({r['compiles_in_timed']}, {r['compiles_in_probe']})",
                f"{r['loss_first']:.4f}→{r['loss_last']:.4f}",
            ]
        )
    n = next((r["mesh_devices"] for r in results.values() if "mesh_devices" in r), 0)
    print(
        f"\nW2mp W2's MLP data parallel over {n} devices: mp (launch, {n} replicas of batch "
        f"{W2MP_BATCH}) vs one SPMD program (batch {W2MP_BATCH * n} sharded). steps/s: median of "
        f"{W2MP_WINDOWS} windows of pipelined steps; host ms/step: one window of blocked steps"
    )
    print(_table(headers, rows))
    _print_errors(results)
    speed = {impl: r.get("steps_per_s") for impl, r in results.items()}
    # Host ms/step without the compiled call (which blocks on the CPU backend, in plain JAX too):
    # the steps/s ratio to expect where the device is fast and the host sets the pace.
    bare = {
        impl: r["host_ms"]["host"] - r["host_ms"]["execute"]
        for impl, r in results.items()
        if "host_ms" in r
    }
    ratios = {
        "mp_over_spmd": _ratio(speed.get("mp"), speed.get("spmd_torch")),
        "host_bound_mp_over_spmd": _ratio(bare.get("spmd_torch"), bare.get("mp")),
    }
    shown = _fmt(ratios["mp_over_spmd"], ".2f", "x")
    print(f"  steps/s ratio mp/spmd_torch: {shown} (target 0.5x)")
    if ratios["host_bound_mp_over_spmd"] is not None:
        print(
            f"  host-bound estimate: host ms/step less the compiled call, spmd_torch "
            f"{bare['spmd_torch']:.1f} / mp {bare['mp']:.1f} = "
            f"{ratios['host_bound_mp_over_spmd']:.2f}x"
        )
    h = results.get("mp", {}).get("host_ms")
    if h:
        print(
            f"  mp host ms/step {h['host']:.1f}: tracing {h['trace_all']:.1f} ({n} x "
            f"{h['trace_per_replica']:.2f}); barriers' own work {h['sync_own']:.1f} (live_pending "
            f"{h['live_pending']:.1f}, linearize {h['linearize']:.1f}, key {h['barrier_key']:.1f}, "
            f"bind {h['bind']:.1f}); turn hand-offs {h['handoff']:.1f} "
            f"({h['handoffs_per_step']:.0f}); merged run {h['run']:.1f} (stacked "
            f"{h['stacked']:.1f} incl. make_array {h['make_array']:.1f}, device_put "
            f"{h['device_put']:.1f}, lookup {h['lookup']:.1f}, execute {h['execute']:.1f}, rest "
            f"{h['run_other']:.1f}); unaccounted {h['unaccounted']:.1f}"
        )
    h = results.get("spmd_torch", {}).get("host_ms")
    if h:
        print(
            f"  spmd_torch host ms/step {h['host']:.1f}: tracing {h['trace']:.1f}; barrier "
            f"{h['barrier']:.1f} (live_pending {h['live_pending']:.1f}, linearize "
            f"{h['linearize']:.1f}, run {h['run']:.1f}: lookup {h['lookup']:.1f}, execute "
            f"{h['execute']:.1f}; bind {h['bind']:.1f})"
        )
    return ratios


_TITLES = {
    "W2": "MLP 784-1024-1024-10, batch 256, SGD momentum",
    "W3": "GPT 4L d256 4H seq128 batch 8 vocab 1024, AdamW",
    "W3amp": "W3 under bfloat16 autocast; spmd_torch with syncfree AdamW",
    "W4": (
        f"FSDP: W3's GPT at batch {GPT_W4_CFG.batch}, AdamW, 2-D params and batch sharded on dim 0"
        f" over a '{FSDP.axis}' mesh (peak mem: the largest of its devices)"
    ),
}


def _report_check(workload: str, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Max |loss_a - loss_b| over the check steps, for each pair that ran."""
    ok = {impl: r["losses"] for impl, r in results.items() if "losses" in r}
    pairs = {}
    for i, a in enumerate(IMPLS):
        for b in IMPLS[i + 1 :]:
            if a in ok and b in ok:
                diff = max(abs(x - y) for x, y in zip(ok[a], ok[b]))
                scale = max(abs(x) for x in ok[a] + ok[b]) or 1.0
                rtol = CHECK_RTOL_OF.get(workload, CHECK_RTOL)
                pairs[f"{a}-{b}"] = {"max_abs_diff": diff, "ok": diff <= rtol * scale}
    what = "output mean" if workload == "W1" else f"losses of {CHECK_STEPS} steps"
    print(f"\n{workload} check ({what})")
    for impl in IMPLS:
        r = results.get(impl)
        if r is None:
            continue
        shown = (
            "error: " + r["error"] if "error" in r else ", ".join(f"{v:.6f}" for v in r["losses"])
        )
        print(f"  {impl:<11} {shown}")
    for name, p in pairs.items():
        print(f"  max |diff| {name}: {p['max_abs_diff']:.3g} {'OK' if p['ok'] else 'MISMATCH'}")
    return pairs


def _print_mesh_note(results: dict[str, dict[str, Any]]) -> None:
    """Says so when a run had fewer devices than W4 asks for (--gpu on a small machine)."""
    sizes = {r["mesh_devices"] for r in results.values() if "mesh_devices" in r}
    if sizes and sizes != {FSDP.mesh_devices}:
        print(
            f"  note: mesh of {', '.join(map(str, sorted(sizes)))} device(s), not "
            f"{FSDP.mesh_devices}: fewer devices visible (min({FSDP.mesh_devices}, device_count), "
            f"rounded down to a power of two)"
        )


def _run_parent(args: argparse.Namespace) -> int:
    workloads = [_workload_name(w) for w in args.workloads.split(",") if w.strip()]
    if args.impls is None:
        impls = list(IMPLS)  # each workload runs all of its own
    else:
        impls = [
            _IMPL_ALIASES.get(i.strip(), i.strip()) for i in args.impls.split(",") if i.strip()
        ]
    bad = [w for w in workloads if w not in WORKLOADS] + [i for i in impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"unknown workload or impl {bad}; workloads {WORKLOADS}, impls {IMPLS}")

    device = "cpu"
    if args.gpu:
        device = _gpu_available(_configure_jax_env(True, dict(os.environ)))
        if device is None:
            raise SystemExit(
                "--gpu: JAX sees no CUDA device (JAX_PLATFORMS=cuda failed); install "
                "jax[cuda12] or run without --gpu"
            )
        if not torch.cuda.is_available():
            print("--gpu: torch has no CUDA; eager PyTorch runs on CPU", file=sys.stderr)

    summary: dict[str, Any] = {
        "mode": "check" if args.check else "bench",
        "device": device,
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "jax": _jax_version(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "results": {},
    }
    failed = False  # a child that failed, or a --check mismatch
    for workload in workloads:
        skipped = [i for i in impls if i not in _impls_of(workload)]
        if skipped and args.impls is not None:
            print(f"\n{workload}: no {', '.join(skipped)} implementation; skipped")
        entries = []
        for _ in range(args.rounds):  # rounds alternate the implementations: a, b, a, b...
            results = {impl: _spawn(workload, impl, args) for impl in impls if impl not in skipped}
            if not results:
                break
            entry, bad_round = _report_round(workload, results, args)
            failed |= bad_round
            if skipped and args.impls is not None:
                entry["skipped"] = skipped
            entries.append(entry)
        if not entries:
            continue
        if len(entries) == 1:
            summary["results"][workload] = entries[0]
        else:
            summary["results"][workload] = {"rounds": entries}
            if not args.check:
                _report_rounds(workload, entries)
    print()
    print(SUMMARY_TAG + json.dumps(summary), flush=True)
    return 1 if failed else 0


def _report_round(
    workload: str, results: dict[str, dict[str, Any]], args: argparse.Namespace
) -> tuple[dict[str, Any], bool]:
    """Prints one round's results; returns its summary entry and whether anything failed."""
    failed = False
    for r in results.values():
        if "error" in r:
            failed = True
            print(f"{workload}:{r['impl']} failed:\n{r.pop('stderr_tail', '')}", file=sys.stderr)
    entry: dict[str, Any] = {impl: r for impl, r in results.items()}
    if args.check:
        entry["check"] = _report_check(workload, results)
        failed |= not all(p["ok"] for p in entry["check"].values())
    elif workload == "W1":
        entry["ratios"] = _report_w1(results)
    elif workload == "W2mp":
        entry["ratios"] = _report_w2mp(results)
    elif workload == "W5":
        entry["ratios"] = _report_w5(results["spmd_torch"])
    else:
        entry["ratios"] = _report_training(workload, _TITLES[workload], results, args.gpu)
    if workload == "W4" and not args.check:
        entry["param_bytes"] = _report_param_bytes(results)
        _print_mesh_note(results)
    return entry, failed


def _report_w5(r: dict[str, Any]) -> dict[str, float]:
    """W5's table: each operation's median seconds, MB/s and peak RSS growth, ours against orbax
    directly; the ratios are orbax's time over ours (1.0: as fast as orbax)."""
    if "seconds" not in r:
        return {}
    mb = r["state_bytes"] / 2**20
    sec, rss = r["seconds"], r["rss_growth_bytes"]
    print(
        f"\nW5 checkpoints of W4's model + AdamW state ({mb:.1f} MB, {r['mesh_devices']}-device "
        f"mesh), median of {r['steps']} reps; on disk: ours {r['disk_bytes']['ours'] / 2**20:.1f}"
        f" MB, orbax {r['disk_bytes']['orbax'] / 2**20:.1f} MB"
    )
    print(
        f"  {'operation':24s} {'ours s':>8s} {'MB/s':>7s} {'orbax s':>8s} {'MB/s':>7s} "
        f"{'ratio':>6s} {'RSS+ MB':>8s}"
    )
    ratios = {}
    for op in ("save", "restore", "restore_4x2"):
        ours, theirs = sec[op], sec[f"orbax_{op}"]
        ratios[op] = theirs / ours
        print(
            f"  {op:24s} {ours:8.3f} {mb / ours:7.0f} {theirs:8.3f} {mb / theirs:7.0f} "
            f"{ratios[op]:5.2f}x {rss[op] / 2**20:8.1f}"
        )
    for op in ("save_async_blocking", "save_async_total"):
        print(
            f"  {op:24s} {sec[op]:8.3f} {mb / sec[op]:7.0f} {'':>8s} {'':>7s} {'':>6s} "
            f"{rss[op] / 2**20:8.1f}"
        )
    ratios["async_blocking_of_save"] = sec["save_async_blocking"] / sec["save"]
    ratios["rss_growth_of_state"] = max(rss["save"], rss["restore"]) / r["state_bytes"]
    print(
        f"  save_async blocks for {ratios['async_blocking_of_save']:.1%} of a save; peak RSS "
        f"growth {ratios['rss_growth_of_state']:.2f}x the state's bytes"
    )
    return ratios


def _report_rounds(workload: str, entries: list[dict[str, Any]]) -> None:
    """The median of each ratio over the rounds (each measured side by side in its round)."""
    names = sorted({name for e in entries for name in e.get("ratios", {})})
    print(f"\n{workload} over {len(entries)} rounds (median of the rounds' ratios):")
    for name in names:
        values = [e["ratios"].get(name) for e in entries]
        values = [v for v in values if v is not None]
        shown = ", ".join(f"{v:.2f}" for v in values)
        median = _fmt(statistics.median(values) if values else None, ".2f", "x")
        print(f"  {name}: {median} ({shown})")


def _jax_version() -> str | None:
    """The installed version, read without importing jax (which would start a backend)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jax")
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="e.g. W1,W3")
    parser.add_argument(
        "--impls", help="subset of eager,jax,spmd_torch,mp (default: each workload's own)"
    )
    parser.add_argument("--steps", type=int, help="timed steps (W1: timed repetitions)")
    parser.add_argument("--warmup", type=int, help="warm-up steps, the first included")
    parser.add_argument("--gpu", action="store_true", help="run JAX and spmd_torch on CUDA")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"run {CHECK_STEPS} steps of each from one init; compare losses",
    )
    parser.add_argument(
        "--matmul-precision",
        choices=("default", "high", "highest"),
        help="jax_default_matmul_precision for jax and spmd_torch runs",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each workload's implementations this many times, alternating (a, b, a, b...)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    parser.add_argument("--only", metavar="W:IMPL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.only:
        return _run_child(args.only, args)
    return _run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
