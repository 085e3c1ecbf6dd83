"""W1, tracing overhead: the 2000-op elementwise chain, in host µs per op.

Eager and JAX report what running the chain costs (and JAX what tracing it costs); spmd_torch
reports what recording it costs (the compiled program's run is the barrier, timed apart).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from . import harness
from .models import CHAIN, chain, chain_data


def w1_eager(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    dev = harness.eager_device(gpu)
    wait = harness.eager_wait(dev)
    x, y, w = (torch.from_numpy(a).to(dev) for a in chain_data())
    if check:
        return {"losses": [chain(x, y, w).double().mean().item()]}

    def run() -> float:
        t0 = harness.now()
        chain(x, y, w)
        wait()
        return harness.now() - t0

    us = harness.median_per_op(run, warmup, steps, CHAIN.n_ops)
    return {"exec_us_per_op": us, "device": str(dev), "warmup": warmup, "steps": steps}


def w1_jax(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    x, y, w = (jax.device_put(a, dev) for a in chain_data())
    fn = jax.jit(lambda x, y, w: chain(x, y, w))
    if check:
        return {"losses": [float(np.asarray(fn(x, y, w), dtype=np.float64).mean())]}

    def run_exec() -> float:
        t0 = harness.now()
        fn(x, y, w).block_until_ready()
        return harness.now() - t0

    def run_trace() -> float:
        # A fresh function each time, so jax's trace cache cannot answer: cost of jax's own tracing.
        def fresh(x: Any, y: Any, w: Any) -> Any:
            return chain(x, y, w)

        t0 = harness.now()
        jax.make_jaxpr(fresh)(x, y, w)
        return harness.now() - t0

    exec_us = harness.median_per_op(run_exec, warmup, steps, CHAIN.n_ops)
    trace_us = harness.median_per_op(run_trace, 1, max(3, steps // 3), CHAIN.n_ops)
    return {
        "exec_us_per_op": exec_us,
        "jax_trace_us_per_op": trace_us,
        "device": str(dev),
        "warmup": warmup,
        "steps": steps,
    }


def w1_spmd(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    """Recording time per op (median over repetitions); the barrier and the device's run are
    timed apart as sync_ms, so they stay out of the per-op figure."""
    import spmd_torch
    import spmd_torch.core.xla_model as xm

    dev = spmd_torch.device()
    x, y, w = (torch.from_numpy(a).to(dev) for a in chain_data())
    spmd_torch.sync()
    xm.wait_device_ops()
    if check:
        out = chain(x, y, w)
        spmd_torch.sync()
        return {"losses": [out.cpu().double().mean().item()]}

    sync_times = []

    def run() -> float:
        t0 = harness.now()
        out = chain(x, y, w)
        trace_s = harness.now() - t0
        t0 = harness.now()
        spmd_torch.sync()
        xm.wait_device_ops()
        sync_times.append(harness.now() - t0)
        del out
        return trace_s

    t0 = harness.now()
    run()
    first_rep_s = harness.now() - t0
    compiles_first = harness.spmd_compiles()
    trace_us = harness.median_per_op(run, warmup - 1, steps, CHAIN.n_ops)
    compiles_end = harness.spmd_compiles()
    wrapper_us = _empty_wrapper_us_per_op(warmup, steps)
    return {
        "trace_us_per_op": trace_us,
        "empty_wrapper_us_per_op": wrapper_us,
        "trace_over_empty_wrapper": trace_us / wrapper_us,
        "sync_ms": statistics.median(sync_times[-steps:]) * 1e3,
        "first_rep_s": first_rep_s,
        "compiles_first_step": compiles_first,
        "compiles_total": compiles_end,
        "compiles_in_timed": compiles_end - compiles_first,
        "cached_compiles": harness.spmd_cached_compiles(),
        "device": str(dev),
        "warmup": warmup,
        "steps": steps,
    }


class _EmptyWrapper(torch.Tensor):
    """The floor of per-op tracing in Python: a ``__torch_dispatch__`` wrapper subclass that
    records nothing and returns a new wrapper of the op's first tensor's shape (W1's ops keep it)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> _EmptyWrapper:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _EmptyWrapper(next(a for a in args if isinstance(a, torch.Tensor)))


def _empty_wrapper_us_per_op(warmup: int, steps: int) -> float:
    """W1's chain through ``_EmptyWrapper``, in the same process as spmd_torch's tracing."""
    x, y, w = (_EmptyWrapper(torch.from_numpy(a)) for a in chain_data())

    def run() -> float:
        t0 = harness.now()
        chain(x, y, w)
        return harness.now() - t0

    return harness.median_per_op(run, warmup, steps, CHAIN.n_ops)
