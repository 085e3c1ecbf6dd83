"""W7cpu: GPT-2 small's structure at tiny widths, so that a step is host work on any machine.

gpu.py's GPT-2 (12 layers, the embedding tied to the output layer,
``F.scaled_dot_product_attention`` with ``is_causal``, tanh GELU, LayerNorm) at d_model 64, 4
heads, seq 64, batch 2, vocab 512, in float32, trained by ``torch.optim.AdamW`` with W3's
hyperparameters and default arguments otherwise: foreach and fused are what torch.optim picks for
the device by itself. Implementations: eager, jax (the same math by hand, XLA's attention),
spmd_torch, spmd_compile (opt-in). ``--tiny``: 2 layers.

What it measures is spmd_torch's host work per step. Besides the timings, the spmd_torch run
reports, from the harness's probe of its blocked steps, its host time (the main thread's CPU
time and wall time), the nodes per program (``TensorsGraphSize``), the ops recorded (the sum of
the ``xla::<op>`` counters) and traced (``LazyTracing``'s samples) per step, and the compiles in
the timed steps. Then it traces one more step in parts (``program_parts``): the nodes pending after
the forward, after the backward and after ``optimizer.step()`` (``debug.graph.pending_program``;
new nodes are a part's), so the optimizer's nodes (and the ops it recorded), and the attention
nodes each way: those whose op names ``scaled_dot_product``, ``_softmax`` (not the loss's
``_log_softmax``) or ``bmm``, per attention call. Each figure is None (n/a) where the checkout
imported (--against an older one) lacks what it reads.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch
from torch import nn

from . import compiled, harness
from .gpu import (
    GPT2_TINY,
    GPT2Config,
    gpt2_data,
    gpt2_eager,
    gpt2_jax,
    gpt2_spmd,
    gpt2_spmd_compile,
)
from .models import gpt_loss

W7CPU = GPT2Config(layers=12, d_model=64, heads=4, vocab=512, seq=64, batch=2, name="w7cpu")
# What W7cpu is for (issue 32): each spmd_torch figure at most this (host CPU: this fraction of
# BASE's, read off --against's table).
TARGETS = {
    "nodes_per_program": 1300,
    "optimizer_nodes": 12,
    "attention_nodes_per_call": 1,
    "host_cpu_over_base": 0.5,
}
BASE = "132f57f"  # the commit whose host time the target halves
ATTENTION_OP = re.compile(r"scaled_dot_product|bmm|(?<!_log)_softmax")


def config(tiny: bool) -> GPT2Config:
    return GPT2_TINY if tiny else W7CPU


def _pending() -> dict[int, Any]:
    """The nodes the next sync would run, by id (the dict holds them, so no id is reused)."""
    import spmd_torch.debug.graph as graph

    return {id(n): n for n in graph.pending_program().nodes}


def _ops(nodes: dict[int, Any], without: dict[int, Any]) -> list[str]:
    """The op names of `nodes` that are not in `without`: one part's nodes."""
    return [str(n.op) for k, n in nodes.items() if k not in without]


def program_parts(model: nn.Module, opt: torch.optim.Optimizer, cfg: GPT2Config) -> dict[str, Any]:
    """One more training step, traced part by part (forward, backward, optimizer.step()), then
    synced as the trainer's are (the same program: no compile expected, `compiles` says). None
    where the checkout has no pending_program."""
    import spmd_torch
    import spmd_torch.debug.graph as graph

    if not hasattr(graph, "pending_program"):
        return {"parts": None}
    dev = spmd_torch.device()
    batch = [torch.from_numpy(a).to(dev) for a in gpt2_data(cfg)]
    compiles = harness.spmd_compiles()
    loss = gpt_loss(model, *batch)
    forward = _pending()
    loss.backward()
    backward = _pending()
    recorded = harness.recorded_ops()
    opt.step()
    recorded = harness.diff(harness.recorded_ops(), recorded)
    full = _pending()
    opt.zero_grad()
    loss = loss.detach()  # as the trainer's step returns it: an output of the program
    spmd_torch.sync()
    parts = {"forward": _ops(forward, {}), "backward": _ops(backward, forward)}
    attention = {
        k: Counter(op for op in ops if ATTENTION_OP.search(op)) for k, ops in parts.items()
    }
    return {
        "parts": {
            "nodes": {
                **{k: len(ops) for k, ops in parts.items()},
                "optimizer": len(_ops(full, backward)),
                "total": len(full),
            },
            "optimizer_recorded_ops": recorded,
            "attention": {k: dict(c) for k, c in attention.items()},
            "attention_per_call": {k: c.total() / cfg.layers for k, c in attention.items()},
            "compiles": harness.spmd_compiles() - compiles,
        }
    }


# ------------------------------------------------------------------------------------------------
# Runners


def w7cpu_eager(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    return gpt2_eager(warmup, steps, check, gpu, config(tiny), None)


def w7cpu_jax(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    return gpt2_jax(warmup, steps, check, config(tiny), False, "xla")


def w7cpu_spmd(warmup: int, steps: int, check: bool, gpu: bool, tiny: bool) -> dict[str, Any]:
    cfg = config(tiny)
    return gpt2_spmd(warmup, steps, check, cfg, None, lambda m, o: program_parts(m, o, cfg))


def w7cpu_spmd_compile(
    warmup: int, steps: int, check: bool, gpu: bool, tiny: bool, backend: str = compiled.BACKEND
) -> dict[str, Any]:
    return gpt2_spmd_compile(warmup, steps, check, config(tiny), None, backend)
