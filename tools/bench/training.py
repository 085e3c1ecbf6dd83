"""W2, W3, W3amp and W4: training steps, each implementation wrapped as a harness.Trainer.

W2 is the MLP with SGD, W3 the GPT with AdamW, W3amp W3 under bfloat16 autocast (spmd_torch with
syncfree AdamW) and W4 W3's GPT FSDP-style over an 8-device 'fsdp' mesh (jax and spmd_torch).
spmd_torch is written against its public torch_xla-style API (device, sync, wait_device_ops,
debug.metrics); W4's byte counts also read the engine's arrays and compiled program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from . import harness
from .harness import Trainer, run_trainer
from .models import (
    FSDP,
    GPT_CFG,
    GPT_W4_CFG,
    gpt_data,
    gpt_loss,
    jax_adamw_init,
    jax_adamw_update,
    jax_gpt_loss,
    jax_mlp_loss,
    jax_params,
    jax_sgd_init,
    jax_sgd_update,
    jax_train_step,
    mlp_data,
    mlp_loss,
    new_adamw,
    new_gpt,
    new_mlp,
    new_sgd,
)

# ------------------------------------------------------------------------------------------------
# Eager PyTorch


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

    return Trainer(
        step, harness.eager_wait(dev), lambda loss: loss.item(), peak_bytes=harness.eager_peak(dev)
    )


def _eager(
    warmup: int,
    steps: int,
    check: bool,
    gpu: bool,
    model: nn.Module,
    opt_fn: Callable,
    loss_fn: Callable,
    data: tuple[np.ndarray, ...],
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """One eager run on the device --gpu asks for (CPU where torch has no CUDA)."""
    dev = harness.eager_device(gpu)
    tr = _eager_trainer(model, opt_fn, loss_fn, data, dev, autocast_dtype)
    return {**run_trainer(tr, warmup, steps, check), "device": str(dev)}


def w2_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    return _eager(warmup, steps, check, gpu, new_mlp(), new_sgd, mlp_loss, mlp_data())


def w3_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    return _eager(warmup, steps, check, gpu, new_gpt(), new_adamw, gpt_loss, gpt_data())


def w3amp_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    model, data = new_gpt(), gpt_data()
    return _eager(warmup, steps, check, gpu, model, new_adamw, gpt_loss, data, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Hand-written JAX


def fsdp_mesh_size() -> int:
    """FSDP.mesh_devices, or fewer where there are fewer (--gpu), rounded down to a power of two
    so the batch and every sharded dim 0 (128 to 1024) still split evenly."""
    import jax

    n = min(FSDP.mesh_devices, jax.device_count())
    return 1 << (n.bit_length() - 1)


def fsdp_info(n: int) -> dict[str, Any]:
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


def _shard_bytes(arrays: list) -> tuple[int, int]:
    """Bytes of device 0's shards (every device holds an equal split) and of the whole arrays."""
    return sum(a.addressable_shards[0].data.nbytes for a in arrays), sum(a.nbytes for a in arrays)


def _jax_param_bytes(params: Any) -> tuple[int, int]:
    import jax

    return _shard_bytes(jax.tree.leaves(params))


def _state_bytes_fields(per_device: int, total: int) -> dict[str, int]:
    """W4's optimizer-state byte counts as result fields: AdamW's moments follow their params, so
    one device holds about total / mesh, not the total."""
    return {"opt_state_bytes_per_device": per_device, "opt_state_bytes_total": total}


def _jax_trainer(
    loss_fn: Callable,
    init_fn: Callable,
    update_fn: Callable,
    model: nn.Module,
    data: tuple[np.ndarray, ...],
    mesh: Any = None,
    state: dict | None = None,
    analyse: bool = False,
) -> Trainer:
    """Single-device (W2, W3) or, given a mesh, W4's FSDP placement of params, state and batch;
    ``state`` (if given) is filled with the live params and optimizer state. With a mesh, or
    `analyse`, the trainer also reads XLA's memory analysis of the step (one more compile)."""
    import jax

    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    where = (lambda x: devices[0]) if mesh is None else _jax_fsdp_where(mesh)

    def put(tree: Any) -> Any:
        return jax.tree.map(lambda x: jax.device_put(x, where(x)), tree)

    params = put(jax_params(model))
    opt_state = put(init_fn(params))
    batch = put([a.astype(np.int32) if a.dtype == np.int64 else a for a in data])
    train_step = jax_train_step(loss_fn, update_fn)
    state = {} if state is None else state
    state.update(params=params, opt=opt_state)

    def step() -> Any:
        state["params"], state["opt"], loss = train_step(state["params"], state["opt"], *batch)
        return loss

    def compiles() -> int | None:
        size = getattr(train_step, "_cache_size", None)
        return size() if callable(size) else None

    def compiled_bytes() -> int | None:
        return harness.program_bytes(
            train_step.lower(state["params"], state["opt"], *batch).compile()
        )

    return Trainer(
        step,
        lambda: jax.block_until_ready(state),
        lambda loss: float(loss),
        compiles=compiles,
        peak_bytes=lambda: harness.jax_peak(devices),
        param_bytes=(lambda: None) if mesh is None else lambda: _jax_param_bytes(state["params"]),
        program_bytes=compiled_bytes if mesh is not None or analyse else lambda: None,
    )


def w2_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    tr = _jax_trainer(jax_mlp_loss, jax_sgd_init, jax_sgd_update, new_mlp(), mlp_data())
    return {**run_trainer(tr, warmup, steps, check), "device": str(jax.devices()[0])}


def w3_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    tr = _jax_trainer(jax_gpt_loss, jax_adamw_init, jax_adamw_update, new_gpt(), gpt_data())
    return {**run_trainer(tr, warmup, steps, check), "device": str(jax.devices()[0])}


def w4_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    n = fsdp_mesh_size()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (FSDP.axis,))
    data = gpt_data(GPT_W4_CFG)
    state: dict = {}
    tr = _jax_trainer(
        jax_gpt_loss, jax_adamw_init, jax_adamw_update, new_gpt(), data, mesh=mesh, state=state
    )
    result = run_trainer(tr, warmup, steps, check)
    opt_bytes = _state_bytes_fields(*_shard_bytes(jax.tree.leaves(state["opt"])))
    return {**result, **fsdp_info(n), **opt_bytes}


# ------------------------------------------------------------------------------------------------
# spmd_torch


def spmd_trainer(
    model: nn.Module,
    opt_fn: Callable,
    loss_fn: Callable,
    data: tuple[np.ndarray, ...],
    shard: Callable[[nn.Module, list[torch.Tensor]], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
    compile_backend: str | None = None,
) -> Trainer:
    """`shard` marks the model and batch once they are on the device; the optimizer comes after,
    as PyTorch/XLA asks, so its state is made from the marked parameters. With `autocast_dtype`
    the forward pass runs under ``spmd_torch.amp.autocast``. With `compile_backend` the step
    (forward, backward, optimizer step) runs under ``torch.compile`` with that backend, as
    PyTorch/XLA's dynamo guide writes it; sync() stays outside. Each step's time in sync() is
    kept, in wall and in CPU time: the barrier's host time, and with it the tracing time (the rest
    of the step)."""
    import spmd_torch
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
    barrier_cpu_times: list[float] = []
    region = contextlib.nullcontext
    if autocast_dtype is not None:
        region = lambda: amp.autocast(dev, dtype=autocast_dtype)  # noqa: E731

    def train_step() -> torch.Tensor:
        with region():
            loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()  # before sync, so it is an output of the step's one graph

    if compile_backend is not None:
        train_step = torch.compile(train_step, backend=compile_backend)

    def step() -> torch.Tensor:
        loss = train_step()
        c0, t0 = time.thread_time(), harness.now()
        spmd_torch.sync()
        barrier_times.append(harness.now() - t0)
        barrier_cpu_times.append(time.thread_time() - c0)
        return loss

    return Trainer(
        step,
        xm.wait_device_ops,
        lambda loss: loss.item(),
        compiles=harness.spmd_compiles,
        cached_compiles=harness.spmd_cached_compiles,
        peak_bytes=harness.jax_peak,
        barrier_times=barrier_times,
        barrier_cpu_times=barrier_cpu_times,
    )


def w2_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import spmd_torch  # before the model is made, as every spmd_torch run does

    tr = spmd_trainer(new_mlp(), new_sgd, mlp_loss, mlp_data())
    return {**run_trainer(tr, warmup, steps, check), "device": str(spmd_torch.device())}


def w3_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import spmd_torch

    tr = spmd_trainer(new_gpt(), new_adamw, gpt_loss, gpt_data())
    return {**run_trainer(tr, warmup, steps, check), "device": str(spmd_torch.device())}


def _syncfree_adamw(model: nn.Module) -> torch.optim.Optimizer:
    from spmd_torch.amp import syncfree

    c = GPT_CFG
    return syncfree.AdamW(
        model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
    )


def w3amp_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    """W3 under bf16 autocast with syncfree AdamW; then counts the device-to-host transfers of
    `steps` more steps (the loss stays on the device: nothing should be read)."""
    import spmd_torch
    import spmd_torch.debug.metrics as met

    tr = spmd_trainer(
        new_gpt(), _syncfree_adamw, gpt_loss, gpt_data(), autocast_dtype=torch.bfloat16
    )
    result = run_trainer(tr, warmup, steps, check)
    if check:
        return result
    before = met.counter_value("TransferFromDevice") or 0
    for _ in range(steps):
        tr.step()
    tr.wait()
    transfers = (met.counter_value("TransferFromDevice") or 0) - before
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


def _spmd_param_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of device 0's shards of the parameters' device arrays, and the params' total."""
    from spmd_torch._lazy.execute import global_array

    per_device = sum(global_array(p).addressable_shards[0].data.nbytes for p in model.parameters())
    return per_device, sum(p.numel() * p.element_size() for p in model.parameters())


def _spmd_state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of device 0's shards of the optimizer state's device arrays, and their total."""
    from spmd_torch._lazy.execute import global_array

    tensors = [
        v
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.device.type == "xla"
    ]
    return _shard_bytes([global_array(t) for t in tensors])


def w4_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    import spmd_torch  # noqa: F401  (before the model is made, as every spmd_torch run does)

    n = fsdp_mesh_size()
    model = new_gpt()
    data = gpt_data(GPT_W4_CFG)
    made: list = []  # the optimizer spmd_trainer makes, for its state's bytes
    tr = spmd_trainer(
        model,
        lambda m: made.append(new_adamw(m)) or made[0],
        gpt_loss,
        data,
        shard=_spmd_fsdp_shard(n),
    )
    tr = dataclasses.replace(
        tr,
        peak_bytes=lambda: harness.jax_peak(jax.devices()[:n]),
        param_bytes=lambda: _spmd_param_bytes(model),
        program_bytes=harness.spmd_program_bytes,
    )
    result = run_trainer(tr, warmup, steps, check)
    return {**result, **fsdp_info(n), **_state_bytes_fields(*_spmd_state_bytes(made[0]))}
